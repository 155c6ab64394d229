"""Speculative decoding end to end (``speculative.py``, ``runner/verify.py``): greedy outputs equal
decoding without it on dense, sliding-window, Mamba2 and Gated DeltaNet models, with prefix-cache
hits on blocks that verification computed; stops, logprobs and logits processing as without it;
sampled outputs keep the model's distribution (a small vocabulary, an exact reference).

Random tiny models seldom repeat themselves, so most tests draft from an oracle: the reference
run's own continuation, with drafts corrupted at random, so that every step accepts some, all or
none of its drafts. The n-gram proposer itself is tested on plain data (tests/unit)."""

from __future__ import annotations

import random

import pytest
import torch

from hyprefix import LLM, SamplingParams
from hyprefix.metrics import ServerMetrics
from hyprefix.speculative import DraftState
from tests.support.compare import random_prompts
from tests.support.models import TINY_CASCADE, save_tiny_checkpoint

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


class Oracle:
    """Drafts for a context that is a prefix of a known sequence: its next tokens, each draft
    corrupted at one position with probability ``corrupt``; no drafts for unknown contexts."""

    def __init__(self, sequences: list[list[int]], corrupt: float = 0.5, seed: int = 0) -> None:
        self.sequences = sequences
        self.corrupt = corrupt
        self.rng = random.Random(seed)
        self.calls = 0

    def __call__(self, state: DraftState, tokens: list[int], k: int) -> list[int]:
        self.calls += 1
        for seq in self.sequences:
            if len(seq) > len(tokens) and seq[:len(tokens)] == tokens:
                drafts = seq[len(tokens):len(tokens) + k]
                if self.rng.random() < self.corrupt:
                    i = self.rng.randrange(len(drafts))
                    drafts[i] = (drafts[i] + 1) % 50 + 3
                return drafts
        return []


def make(path, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 256)
    return LLM(str(path), dtype=kwargs.pop("dtype", "float32"), log_stats_interval=0, **kwargs)


def checked_generate(llm: LLM, prompts, params) -> list[list[int]]:
    """Generate with the engine's invariants checked after every step."""
    engine = llm.engine
    step = engine.step

    def checked():
        out = step()
        engine.check_invariants()
        return out

    engine.step = checked
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        engine.step = step


def prompts_for(seed: int) -> list[list[int]]:
    a, b, c = random_prompts([37, 21, 300], seed=seed)
    return [a, a[:30] + b, c]  # the second shares the first's blocks; the third is long (cascade reads)


def assert_same_with_drafts(monkeypatch, path, prompts, params=GREEDY, corrupt=0.5, **kwargs):
    """Reference outputs without speculation, then with oracle drafts; then a second round whose
    prompts extend the first's outputs, so its hits land on blocks verification computed."""
    reference = make(path, **kwargs)
    ref = checked_generate(reference, prompts, params)
    follow = [p + out[:25] for p, out in zip(prompts, ref, strict=True)]
    ref_follow = checked_generate(reference, follow, params)
    oracle = Oracle([p + o for p, o in zip(prompts + follow, ref + ref_follow, strict=True)], corrupt)
    monkeypatch.setattr(DraftState, "propose", lambda self, tokens, k: oracle(self, tokens, k))
    llm = make(path, speculative_config=SPEC, **kwargs)
    assert checked_generate(llm, prompts, params) == ref
    hits_before = llm.get_stats()["prefix_cache_hits"]
    assert checked_generate(llm, follow, params) == ref_follow
    stats = llm.get_stats()
    assert stats["prefix_cache_hits"] - hits_before >= sum(len(p) for p in prompts) // 16 * 16 - 16
    assert stats["spec_decode_num_drafts"] > 10
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    return llm


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_greedy_identical_with_drafts_dense(tiny_models, monkeypatch, arch):
    assert_same_with_drafts(monkeypatch, tiny_models[arch][0], prompts_for(1), **TINY_CASCADE)


def test_greedy_identical_with_drafts_batch_invariant(tiny_models, monkeypatch):
    """The batch-invariant mode reads each verify row as a query row of its own."""
    assert_same_with_drafts(monkeypatch, tiny_models["qwen3"][0], prompts_for(10), batch_invariant=True)


def test_greedy_identical_with_drafts_gemma3_window_pool(gemma3_model, monkeypatch):
    llm = assert_same_with_drafts(monkeypatch, gemma3_model[0], prompts_for(2))
    assert llm.get_stats()["swa_blocks_total"] > 0  # the sliding layers' own pool was in play


@pytest.mark.hybrid_graphs  # plain decode steps through the compiled graphs, verifications eager
@pytest.mark.parametrize("arch", ["nemotron_h", "qwen3_5"])
def test_greedy_identical_with_drafts_hybrids(hybrid_models, monkeypatch, arch):
    """Mamba2 and Gated DeltaNet: the state after the last accepted token comes from the scratch
    taps; checkpoints and hybrid hits work as without drafts."""
    llm = assert_same_with_drafts(monkeypatch, hybrid_models[arch][0], prompts_for(3))
    assert llm.get_stats()["mamba_checkpoints_used"] > 0


def test_greedy_identical_through_the_int8_decode_kernel(tiny_models, monkeypatch):
    """The one-call decode kernel verifies drafts as rows of one sequence; its attention's fixed
    runs make each row's result the bits a one-row step gives, so even int8 matmuls (whose
    activation rounding amplifies any difference) decode the same tokens."""
    from hyprefix.kernels import decode_layers

    if not decode_layers.available():
        pytest.skip("the decode_layers kernel does not run here")
    llm = assert_same_with_drafts(monkeypatch, tiny_models["llama"][0], prompts_for(4), quantization="int8",
                                  dtype="auto")
    assert llm.get_stats()["decode_steps_kernel"] > 0


def test_ngram_drafts_on_text_that_repeats(tiny_models):
    """The proposer itself: a prompt that repeats a span drafts from it; outputs are unchanged."""
    path = tiny_models["qwen3"][0]
    (span,) = random_prompts([24], seed=5)
    prompts = [span * 4, span[:10] * 6]
    ref = checked_generate(make(path), prompts, GREEDY)
    llm = make(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                                         "prompt_lookup_max": 4})
    assert checked_generate(llm, prompts, GREEDY) == ref
    assert llm.get_stats()["spec_decode_num_drafts"] > 0


def test_stops_logprobs_and_processing_as_without_drafts(tiny_models, monkeypatch):
    path = tiny_models["llama"][0]
    prompts = prompts_for(6)
    reference = make(path)
    base = reference.generate(prompts, GREEDY, use_tqdm=False)
    stop_text = reference.engine.tokenizer.decode([base[0].outputs[0].token_ids[12]])
    cases = [
        SamplingParams(temperature=0, max_tokens=30, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.4, frequency_penalty=0.6,
                       presence_penalty=0.3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=20, stop_token_ids=base[1].outputs[0].token_ids[3:6]),
        SamplingParams(temperature=0, max_tokens=30, stop=[stop_text], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
    ]
    refs = [reference.generate(prompts, p, use_tqdm=False) for p in cases]
    sequences = [p + o.outputs[0].token_ids for p, o in zip(prompts, base, strict=True)]
    sequences += [p + o.outputs[0].token_ids for outs in refs for p, o in zip(prompts, outs, strict=True)]
    oracle = Oracle(sequences, corrupt=0.3)
    monkeypatch.setattr(DraftState, "propose", lambda self, tokens, k: oracle(self, tokens, k))
    llm = make(path, speculative_config=SPEC)
    for params, expected in zip(cases, refs, strict=True):
        got = llm.generate(prompts, params, use_tqdm=False)
        for g, e in zip(got, expected, strict=True):
            assert g.outputs[0].token_ids == e.outputs[0].token_ids, params
            assert g.outputs[0].text == e.outputs[0].text
            assert (g.outputs[0].finish_reason, g.outputs[0].stop_reason) == \
                (e.outputs[0].finish_reason, e.outputs[0].stop_reason)
            if params.logprobs:
                assert len(g.outputs[0].logprobs) == len(g.outputs[0].token_ids)
                for a, b in zip(g.outputs[0].logprobs, e.outputs[0].logprobs, strict=True):
                    assert list(a) == list(b)
                    assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
        llm.engine.check_invariants()
    assert refs[3][0].outputs[0].stop_reason == stop_text  # the stop string case did stop early
    assert llm.get_stats()["spec_decode_num_accepted_tokens"] > 0


def test_structured_outputs_decode_without_drafts(tiny_models, monkeypatch):
    """A request with a grammar never drafts (its parser would have to check and take back
    drafts): its output is what decoding without speculation gives, beside a drafting request."""
    path = tiny_models["qwen3"][0]
    prompts = prompts_for(9)[:2]
    regex = SamplingParams(temperature=0, max_tokens=30, structured_outputs={"regex": "[a-z]{3,12}( [a-z]{2,9})*"})
    reference = make(path)
    expected = [o.outputs[0].text for o in reference.generate(prompts, [regex, GREEDY], use_tqdm=False)]
    free = checked_generate(reference, prompts[1:], GREEDY)
    oracle = Oracle([prompts[1] + free[0]], corrupt=0.3)
    monkeypatch.setattr(DraftState, "propose", lambda self, tokens, k: oracle(self, tokens, k))
    llm = make(path, speculative_config=SPEC)
    outs = llm.generate(prompts, [regex, GREEDY], use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == expected
    assert outs[0].metrics.spec_num_drafts == 0 and outs[1].metrics.spec_num_drafts > 0


def test_drafts_that_keep_failing_back_off(tiny_models, monkeypatch):
    path = tiny_models["llama"][0]
    prompts = prompts_for(7)[:1]
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    ref = checked_generate(make(path), prompts, params)
    wrong = Oracle([prompts[0] + ref[0]], corrupt=0.0)

    def always_wrong(self, tokens, k):
        drafts = wrong(self, tokens, k)
        return [(t + 7) % 4000 + 3 for t in drafts]

    monkeypatch.setattr(DraftState, "propose", lambda self, tokens, k: (
        [] if self.skip and not (self.__setattr__("skip", self.skip - 1)) else always_wrong(self, tokens, k)))
    llm = make(path, speculative_config=SPEC)
    assert checked_generate(llm, prompts, params) == ref
    verifications = llm.get_stats()["spec_decode_num_drafts"]
    assert 0 < verifications <= 12  # 119 decode steps, 1 + 2 + 4 + ... + 32 of them skipped


def test_metrics_per_request_and_on_the_server(tiny_models, monkeypatch):
    path = tiny_models["qwen3"][0]
    prompts = prompts_for(8)[:2]
    ref = checked_generate(make(path), prompts, GREEDY)
    oracle = Oracle([p + o for p, o in zip(prompts, ref, strict=True)], corrupt=0.0)
    monkeypatch.setattr(DraftState, "propose", lambda self, tokens, k: oracle(self, tokens, k))
    llm = make(path, speculative_config=SPEC)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for out in outs:
        m = out.metrics
        assert m.spec_num_drafts > 0 and m.spec_num_accepted_tokens == m.spec_num_draft_tokens  # every draft right
        assert m.spec_mean_accepted_length == 1 + m.spec_num_accepted_tokens / m.spec_num_drafts
        assert len(out.outputs[0].token_ids) == 40
    stats = llm.get_stats()
    assert stats["spec_decode_num_drafts"] == sum(o.metrics.spec_num_drafts for o in outs)
    assert stats["spec_decode_num_accepted_tokens_pos0"] == stats["spec_decode_num_drafts"]
    text = ServerMetrics(llm.get_stats, "m").exposition().decode()
    drafts = stats["spec_decode_num_drafts"]
    assert f'hyprefix:spec_decode_num_drafts_total{{model_name="m"}} {float(drafts)}' in text
    assert 'hyprefix:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="3"}' in text


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    """A tiny Llama over 16 tokens: the whole distribution of each position is one logprobs call."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.3, eos_token_id=2, bos_token_id=0, pad_token_id=0,
                         tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("small-vocab") / "llama16"
    save_tiny_checkpoint(model, path)
    return path


def _chi_square_p(observed: dict, expected: dict[object, float]) -> float:
    """Goodness of fit of counts to expected counts, cells expecting fewer than 5 pooled."""
    small = [c for c, e in expected.items() if e < 5]
    obs = [observed.get(c, 0) for c, e in expected.items() if e >= 5]
    exp = [e for e in expected.values() if e >= 5]
    if small:
        obs.append(sum(observed.get(c, 0) for c in small))
        exp.append(sum(expected[c] for c in small))
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    return float(torch.special.gammaincc(torch.tensor((len(exp) - 1) / 2), torch.tensor(stat / 2)))


def test_sampled_outputs_keep_the_models_distribution(small_vocab_model, monkeypatch):
    """Rejection sampling leaves each position's distribution exactly the model's: the joint
    of the first two tokens (the second verified against a draft) and the third token after the
    likeliest pair match the probabilities the model gives, within a chi-square test."""
    path = small_vocab_model
    prompt = [5, 9, 3, 7, 5, 9, 3]
    exact = make(path, enable_prefix_caching=False)
    probe = SamplingParams(temperature=0, max_tokens=1, logprobs=16)

    temperature = 2.0  # flattens the peaked distributions: drafts are refused often

    def dist(context: list[int]) -> dict[int, float]:
        entry = exact.generate([context], probe, use_tqdm=False)[0].outputs[0].logprobs[0]
        weights = {t: float(torch.tensor(lp.logprob / temperature).exp()) for t, lp in entry.items()}
        total = sum(weights.values())
        return {t: w / total for t, w in weights.items()}

    first = dist(prompt)
    second = {t: dist([*prompt, t]) for t in range(16)}
    joint = {(a, b): first[a] * second[a][b] for a in range(16) for b in range(16)}
    pair = max(joint, key=joint.get)
    third = dist(prompt + list(pair))
    likeliest = {a: max(second[a], key=second[a].get) for a in range(16)}

    # drafts: the likeliest second token after the first, then the likeliest third after the pair
    def drafts(self, tokens, k):
        if len(tokens) != len(prompt) + 1:
            return []
        return [likeliest[tokens[-1]], max(third, key=third.get)][:k]

    monkeypatch.setattr(DraftState, "propose", drafts)
    llm = make(path, speculative_config={"method": "ngram", "num_speculative_tokens": 2}, max_num_seqs=128,
               seed=1234)
    n = 4000
    outs = llm.generate([prompt] * n, SamplingParams(temperature=temperature, max_tokens=4,
                                                                 ignore_eos=True),
                        use_tqdm=False)
    samples = [tuple(o.outputs[0].token_ids) for o in outs]
    stats = llm.get_stats()
    assert stats["spec_decode_num_drafts"] == n  # every sequence verified its drafts once
    assert 0 < stats["spec_decode_num_accepted_tokens_pos0"] < n  # accepted and refused both ran
    assert stats["spec_decode_num_accepted_tokens_pos1"] > 0
    # the event the drafts bet on, the second token being the draft: its exact probability
    q = sum(first[a] * second[a][likeliest[a]] for a in range(16))
    hits = sum(s[1] == likeliest[s[0]] for s in samples)
    assert abs(hits - n * q) < 4.5 * (n * q * (1 - q)) ** 0.5, (hits, n * q)
    counts: dict = {}
    for s in samples:
        counts[s[:2]] = counts.get(s[:2], 0) + 1
    assert _chi_square_p(counts, {c: n * p for c, p in joint.items()}) > 1e-4
    after = [s[2] for s in samples if s[:2] == pair]
    assert len(after) > 200
    third_counts = {t: after.count(t) for t in set(after)}
    assert _chi_square_p(third_counts, {t: len(after) * p for t, p in third.items()}) > 1e-4
