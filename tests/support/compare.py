"""Reference helpers of the model tests: random prompts, transformers' greedy tokens, and our
engine's last-token logits against transformers'."""

from __future__ import annotations

import torch


def random_prompts(lengths, seed: int = 0, vocab: int = 4096) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation; EOS neither stops nor is masked (like ignore_eos)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                         eos_token_id=None)
    return out[0, len(prompt):].tolist()


def our_last_logits(llm, prompts: list[list[int]], chunk: int | None = None) -> torch.Tensor:
    """Prefill all prompts in one batch through the engine's runner (optionally the
    first ``chunk`` tokens first, then the rest reading them back through the block
    table and the Mamba state) and return the last-token logits."""
    from hyprefix.outputs import ScheduledSeq
    from hyprefix.runner.batch import build_batch
    from hyprefix.sampling import SamplingParams

    runner, kv = llm.engine.runner, llm.engine.cache.kv
    params = SamplingParams(temperature=0)
    for i, p in enumerate(prompts):
        assert kv.allocate_slots(f"t{i}", len(p))
    runner._apply_state_ops([(None, i) for i in range(len(prompts))] if runner.recurrent_states else [])

    def run(spans: list[tuple[int, int]]) -> torch.Tensor:
        seqs = [ScheduledSeq(f"t{i}", p[a:b], a, kv.block_table(f"t{i}"), True, params, state_slot=i)
                for i, (p, (a, b)) in enumerate(zip(prompts, spans, strict=True)) if b > a]
        with torch.inference_mode():
            batch = build_batch(seqs, kv.block_size, runner.device, runner.cascade_thresholds)
            hidden = runner.model(batch, runner.kv_caches, runner.recurrent_states)
            logits = runner.model.compute_logits(hidden[batch.logits_indices])
        order = {s.request_id: j for j, s in enumerate(batch.sample_seqs)}
        return logits[[order.get(f"t{i}", 0) for i in range(len(prompts))]]

    try:
        if chunk is not None:
            run([(0, min(chunk, len(p) - 1)) for p in prompts])
            return run([(min(chunk, len(p) - 1), len(p)) for p in prompts])
        return run([(0, len(p)) for p in prompts])
    finally:
        for i in range(len(prompts)):
            kv.free(f"t{i}")


def logit_errors(llm, hf, prompts: list[list[int]], chunk: int | None = None) -> list[tuple[float, float]]:
    """Per prompt: (max |our last-token logit - transformers'|, max |transformers' logit|)."""
    ours = our_last_logits(llm, prompts, chunk)
    out = []
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1].float()
        out.append(((ours[i] - ref).abs().max().item(), ref.abs().max().item()))
    return out


def with_threads(threads: int, fn):
    """fn() with torch's thread count set to ``threads``, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def generate_in_waves(llm, prompts: list[list[int]], params, waves: int) -> list:
    """Each prompt's first completion (``CompletionOutput``), the prompts submitted in ``waves``
    batches one after another (later ones can hit earlier ones' blocks), invariants checked after each."""
    size = -(-len(prompts) // waves)
    outs = []
    for i in range(0, len(prompts), size):
        outs += [o.outputs[0] for o in llm.generate(prompts[i:i + size], params, use_tqdm=False)]
        llm.check_invariants()
    return outs


def assert_same_up_to_a_near_tie(ref, got, near_tie: float) -> None:
    """Greedy outputs (with logprobs) of a reference and another engine: equal up to a near tie;
    where they first part the reference's top two were within ``near_tie``, and until then every
    chosen token's logprob is within ``near_tie`` of the reference's."""
    for step, (a, b) in enumerate(zip(ref.token_ids, got.token_ids, strict=True)):
        if a != b:
            top = sorted(p.logprob for p in ref.logprobs[step].values())[-2:]
            assert top[1] - top[0] < near_tie, f"step {step}: {top}"
            return
        assert abs(ref.logprobs[step][a].logprob - got.logprobs[step][a].logprob) < near_tie, f"step {step}"


def assert_first_step_near(ref, got, near_tie: float = 0.1, kl_bound: float = 0.05) -> None:
    """One-token outputs with top logprobs (``CompletionOutput``) of a reference and an engine
    whose K/V is perturbed (an 8-bit cache): the same token unless the reference's top two were
    within ``near_tie``, and the KL over the tokens both list below ``kl_bound``."""
    import math

    if ref.token_ids != got.token_ids:
        top = sorted(p.logprob for p in ref.logprobs[0].values())[-2:]
        assert top[1] - top[0] < near_tie
    ref, got = ref.logprobs[0], got.logprobs[0]
    shared = ref.keys() & got.keys()
    assert len(shared) >= 15
    assert abs(sum(math.exp(ref[t].logprob) * (ref[t].logprob - got[t].logprob) for t in shared)) < kl_bound
