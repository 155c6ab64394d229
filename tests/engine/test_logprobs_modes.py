"""``--logprobs-mode`` (vLLM's four modes) and ``--lm-head-fp32``, through ``LLM``.

Processed logprobs are checked against a reference built here with plain torch from
transformers' logits of the same sequence (penalties, temperature, min-p, top-k, top-p,
log-softmax, the sampler's order); the float32 head against float32 arithmetic on the
model's own bfloat16 weights and hidden states."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from hyprefix.config import EngineArgs
from hyprefix.llm import LLM
from hyprefix.sampling import SamplingParams
from hyprefix.structured.grammar import allowed_masks
from tests.support.compare import random_prompts

VOCAB = 4096


def _engine(tiny_models, mode: str, arch: str = "qwen3") -> LLM:
    path, _ = tiny_models[arch]
    return LLM(str(path), dtype="float32", num_kv_blocks=128, block_size=16, enforce_eager=True,
               logprobs_mode=mode, max_logprobs=-1, log_stats_interval=0)


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _processed(row: torch.Tensor, params: SamplingParams, previous: list[int]) -> torch.Tensor:
    """The logits a token was sampled from, by the sampler's rules, written out in plain torch:
    presence / frequency penalties over the tokens generated before it; for a random row
    then temperature, min-p, top-k, top-p (what they drop: -inf)."""
    row = row.clone()
    if params.presence_penalty or params.frequency_penalty:
        counts = torch.bincount(torch.tensor(previous, dtype=torch.long), minlength=row.numel()).float() \
            if previous else torch.zeros_like(row)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    if params.greedy:
        return row
    row = row / params.temperature
    if params.min_p > 0:
        probs = row.softmax(-1)
        row[probs < probs.max() * params.min_p] = -math.inf
    if 0 < params.top_k < row.numel():
        row[row < row.topk(params.top_k).values[-1]] = -math.inf
    if params.top_p < 1.0:
        ordered, order = row.sort(descending=True)
        probs = ordered.softmax(-1)
        row[order[(probs.cumsum(-1) - probs) > params.top_p]] = -math.inf
    return row


def _check_entries(out, prompt: list[int], params: SamplingParams, hf, processed: bool, values: bool,
                   atol: float = 2e-4) -> None:
    """Every position's sampled token and top entries against the reference row."""
    tokens, entries = out.outputs[0].token_ids, out.outputs[0].logprobs
    assert len(entries) == len(tokens) == params.max_tokens
    logits = _hf_logits(hf, prompt + tokens)
    for i, (token, entry) in enumerate(zip(tokens, entries, strict=True)):
        row = logits[len(prompt) - 1 + i]
        if processed:
            row = _processed(row, params, tokens[:i])
        ref = row if values else row.log_softmax(-1)
        assert next(iter(entry)) == token
        assert math.isfinite(entry[token].logprob)  # a sampled token was possible
        assert abs(entry[token].logprob - ref[token].item()) < atol, (i, entry[token].logprob, ref[token].item())
        assert entry[token].rank == int((ref > ref[token]).sum()) + 1
        k = params.logprobs if params.logprobs >= 0 else VOCAB
        top = ref.topk(k)
        got = torch.tensor([entry[t].logprob for t in top.indices.tolist()])
        torch.testing.assert_close(got, top.values, atol=atol, rtol=0)  # -inf where both filtered it
        if params.logprobs < 0:  # every token: the kept ones and nothing else
            assert len(entry) == VOCAB
            finite = torch.isfinite(torch.tensor([entry[t].logprob for t in range(VOCAB)]))
            assert torch.equal(finite, torch.isfinite(ref))


SAMPLED = [
    SamplingParams(temperature=0.6, top_p=0.9, seed=1, max_tokens=6, ignore_eos=True, logprobs=-1),
    SamplingParams(temperature=0.8, top_k=20, seed=2, max_tokens=6, ignore_eos=True, logprobs=5),
    SamplingParams(temperature=1.0, min_p=0.3, seed=3, max_tokens=6, ignore_eos=True, logprobs=5),
    SamplingParams(temperature=0.7, top_p=0.95, presence_penalty=1.5, frequency_penalty=0.5, seed=4,
                   max_tokens=6, ignore_eos=True, logprobs=5),
]


def test_processed_logprobs_are_the_distribution_sampled_from(tiny_models):
    llm, (_, hf) = _engine(tiny_models, "processed_logprobs"), tiny_models["qwen3"]
    prompts = random_prompts((9, 17, 4, 23), seed=21)
    outs = llm.generate(prompts, SAMPLED, use_tqdm=False)  # every row random, every row asks
    for out, prompt, params in zip(outs, prompts, SAMPLED, strict=True):
        _check_entries(out, prompt, params, hf, processed=True, values=False)
    # the whole vocabulary: exp of the kept tokens' logprobs sums to 1, and filtering kept fewer than all
    for entry in outs[0].outputs[0].logprobs:
        kept = [e.logprob for e in entry.values() if math.isfinite(e.logprob)]
        assert 1 < len(kept) < VOCAB
        assert abs(math.fsum(math.exp(v) for v in kept) - 1.0) < 1e-4


def test_processed_logprobs_of_greedy_rows_in_a_mixed_batch(tiny_models):
    """Greedy rows: after logits processing, no temperature (and top-k / top-p do not apply);
    random rows beside them, and a row that asks for none."""
    llm, (_, hf) = _engine(tiny_models, "processed_logprobs"), tiny_models["qwen3"]
    params = [
        SamplingParams(temperature=0, presence_penalty=2.0, max_tokens=6, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.6, top_p=0.9, seed=5, max_tokens=6, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.9, seed=6, max_tokens=6, ignore_eos=True),  # asks for no logprobs
        SamplingParams(temperature=0, top_k=3, max_tokens=6, ignore_eos=True, logprobs=-1),
    ]
    prompts = random_prompts((12, 7, 15, 10), seed=22)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[2].outputs[0].logprobs is None
    for i in (0, 1, 3):
        _check_entries(outs[i], prompts[i], params[i], hf, processed=True, values=False)
    greedy = outs[3].outputs[0].logprobs
    assert all(sum(math.isfinite(e.logprob) for e in entry.values()) == VOCAB for entry in greedy)  # no top-k


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logits"])
def test_raw_and_logits_modes(tiny_models, mode):
    """raw_logprobs (the default) stays the model's log-softmax whatever the sampling;
    raw_logits the model's logits; processed_logits the processed ones (temperature applied,
    filtered tokens -inf). Prompt logprobs are raw logprobs in every mode."""
    llm, (_, hf) = _engine(tiny_models, mode), tiny_models["qwen3"]
    params = [SAMPLED[0], SAMPLED[3], SamplingParams(temperature=0, presence_penalty=1.0, max_tokens=4,
                                                     ignore_eos=True, logprobs=4, prompt_logprobs=2)]
    prompts = random_prompts((9, 17, 11), seed=23)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, prompt, p in zip(outs, prompts, params, strict=True):
        _check_entries(out, prompt, p, hf, processed=mode.startswith("processed"), values=mode.endswith("_logits"))
    reference = _hf_logits(hf, prompts[2]).log_softmax(-1)
    for pos in range(1, len(prompts[2])):
        token = prompts[2][pos]
        assert abs(outs[2].prompt_logprobs[pos][token].logprob - reference[pos - 1][token].item()) < 1e-4


def test_a_grammar_row_in_processed_mode_gets_minus_inf_for_what_it_refuses(tiny_models):
    """A grammar row asking for processed logprobs masks first (even with no top-k / top-p /
    min-p): every token its grammar refuses is -inf, the allowed ones sum to 1."""
    llm, (_, hf) = _engine(tiny_models, "processed_logprobs"), tiny_models["qwen3"]
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=8, logprobs=-1,
                            structured_outputs={"regex": "[a-z]{2,5}-[0-9]{1,3}"})
    prompt = random_prompts((10,), seed=24)[0]
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    grammar = llm.engine.grammars.grammar(params.structured_outputs)  # replayed on the output
    logits = _hf_logits(hf, prompt + out.token_ids)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        allowed = allowed_masks([grammar], VOCAB)[0]
        assert not allowed.all()
        got = torch.tensor([entry[t].logprob for t in range(VOCAB)])
        assert torch.equal(torch.isfinite(got), allowed)
        reference = logits[len(prompt) - 1 + i].masked_fill(~allowed, -math.inf).log_softmax(-1)
        torch.testing.assert_close(got[allowed], reference[allowed], atol=2e-4, rtol=0)
        assert grammar.accept(token)


def test_a_bad_logprobs_mode_and_lm_head_fp32_with_int8_are_startup_errors():
    with pytest.raises(ValueError, match="logprobs_mode"):
        EngineArgs(logprobs_mode="processed")
    with pytest.raises(ValueError, match="lm_head_fp32"):
        EngineArgs(lm_head_fp32=True, quantization="int8")


def _head_weights(model) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The model's own bf16 LM head (a tied one: the embedding table) and final norm, as loaded."""
    head = model.lm_head.weight if model.lm_head is not None else model.embed.weight
    assert head.dtype == torch.bfloat16 and head.numel()
    return head.detach().clone(), model.norm.weight.detach().clone(), model.norm.eps


def _fp32_reference(weights: tuple[torch.Tensor, torch.Tensor, float], hidden: torch.Tensor) -> torch.Tensor:
    """log_softmax(float32(RMSNorm(hidden)) @ float32(W_head)^T)."""
    head, norm, eps = weights
    h = hidden.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm.float()
    return (h @ head.float().T).log_softmax(-1)


def _captured_run(llm, prompt: list[int], params: SamplingParams):
    """Generate, keeping every forward's hidden states (eager steps)."""
    model, hidden = llm.engine.runner.model, []
    handle = model.register_forward_hook(lambda _m, _args, out: hidden.append(out.detach().clone()))
    try:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
    finally:
        handle.remove()
    return out, hidden


def test_lm_head_fp32_logprobs_are_float32_arithmetic_on_the_bf16_model(tiny_models):
    path, _ = tiny_models["llama"]
    prompt = random_prompts((13,), seed=25)[0]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=4, prompt_logprobs=1)
    errors, weights = {}, None
    for fp32 in (True, False):  # the flag's engine keeps the plain head (the other packs it)
        llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=64, block_size=16, enforce_eager=True,
                  lm_head_fp32=fp32, log_stats_interval=0)
        model = llm.engine.runner.model
        assert (model.head_forms.fp32 is not None) == fp32
        weights = weights or _head_weights(model)
        out, hidden = _captured_run(llm, prompt, params)
        assert len(hidden) == params.max_tokens and hidden[0].dtype == torch.bfloat16
        # the prefill's rows score the prompt and the first token; each decode's row the next one
        reference = _fp32_reference(weights, torch.cat([hidden[0], *(h[-1:] for h in hidden[1:])]))
        error = 0.0
        for i, (token, entry) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True)):
            row = reference[len(prompt) - 1 + i]
            assert not fp32 or token == int(row.argmax())  # greedy on the float32 logits
            error = max(error, *(abs(e.logprob - row[t].item()) for t, e in entry.items()))
        for pos in range(1, len(prompt)):
            token = prompt[pos]
            error = max(error, abs(out.prompt_logprobs[pos][token].logprob - reference[pos - 1][token].item()))
        errors[fp32] = error
    assert errors[True] < 2e-5
    assert errors[False] > 50 * errors[True]  # the bf16 head is visibly less exact


def _skip_layers_checkpoint(src, dst) -> None:
    """A copy of a tiny checkpoint whose layers add nothing (attention and MLP outputs zero):
    every step's hidden state is exactly its token's embedding row, on every path."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    for f in src.glob("*.safetensors"):
        tensors = load_file(f)
        save_file({k: torch.zeros_like(v) if k.endswith(("o_proj.weight", "down_proj.weight")) else v
                   for k, v in tensors.items()}, dst / f.name, metadata={"format": "pt"})


def test_lm_head_fp32_holds_on_the_compiled_decode_step(tiny_models, tmp_path):
    """The compiled decode step's head is the float32 one (a tied head here): with layers that
    add nothing, each logprob is float32 arithmetic on the token's bf16 embedding row."""
    src, _ = tiny_models["qwen3"]
    path = tmp_path / "skip"
    _skip_layers_checkpoint(src, path)
    llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=64, block_size=16, lm_head_fp32=True,
              log_stats_interval=0)
    runner = llm.engine.runner
    assert runner.decode_graphs is not None
    model = runner.model
    prompt = random_prompts((6,), seed=26)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    assert runner.decode_steps["graph"] == 4  # every decode step compiled
    previous = [prompt[-1], *out.token_ids[:-1]]
    weights = _head_weights(model)
    reference = _fp32_reference(weights, weights[0][torch.tensor(previous)])  # tied: the head is the table
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert token == int(reference[i].argmax())
        for t, e in entry.items():
            assert abs(e.logprob - reference[i][t].item()) < 2e-5


def test_lm_head_fp32_changes_nothing_for_a_float32_model(tiny_models):
    path, _ = tiny_models["qwen3"]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=32, block_size=16, enforce_eager=True, lm_head_fp32=True,
              log_stats_interval=0)
    assert llm.engine.runner.model.head_forms.fp32 is None
