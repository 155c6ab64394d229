"""A GRPO-style rollout loop on hyprefix: each step samples ``--n`` completions of every
prompt (a shared system prompt and a question each) with the sampled tokens' logprobs,
then a stand-in trainer perturbs the weights, saves them and the engine loads them in place
(``LLM.update_weights``). Per step it prints the prefix hit rate, the rollout and update
times, and checks that no block of an older weight version is hit: the previous step's
first prompt, sent again after the update, must find nothing cached.

    .venv/bin/python examples/rl_rollout.py [--model PATH] [--steps 4] [--flush-cache]

``--model``: a checkpoint directory, GGUF file or demo alias (default: the built-in dense
demo model).
``--flush-cache``: also drop the prefix cache after every update, as engines without
versioned block hashes must; compare its rollout throughput with the default.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from hyprefix import LLM, SamplingParams


def trainer_model(path: str):
    """The trainer's copy of the weights: transformers' model of the same checkpoint."""
    from transformers import AutoModelForCausalLM

    location = Path(path)
    if location.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(location.parent), gguf_file=location.name,
                                                    dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def save_checkpoint(model, path: Path) -> None:
    """config.json and model.safetensors (a tied LM head as its embedding only), what a
    trainer hands the engine."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(path)
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file({name: t.contiguous() for name, t in state.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})


def train_step(model, scale: float, generator: torch.Generator) -> None:
    """A stand-in for an optimizer step: every weight moves a little."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale * param.abs().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory or GGUF file (default: the demo model)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--system-len", type=int, default=384, help="tokens of the shared system prompt")
    parser.add_argument("--question-len", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--flush-cache", action="store_true", help="reset the prefix cache after every update")
    parser.add_argument("--save-dir", default=None, help="where the trainer saves each step (default: a temp dir)")
    args = parser.parse_args()

    if args.model is None:
        from hyprefix.demo import demo_model_path

        args.model = str(demo_model_path("dense"))
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, log_stats_interval=0)
    llm.engine.warmup()
    vocab = llm.engine.vocab_size
    rng = random.Random(0)
    # one step's shapes with other tokens, untimed: what compiles on first use does so here
    warm = [[rng.randrange(3, vocab) for _ in range(args.system_len + args.question_len)] for _ in range(args.prompts)]
    llm.generate(warm, SamplingParams(n=args.n, temperature=1.0, max_tokens=8, logprobs=0), use_tqdm=False)
    trainer = trainer_model(str(llm.engine.model_path))
    system = [rng.randrange(3, vocab) for _ in range(args.system_len)]
    generator = torch.Generator().manual_seed(0)
    save_root = Path(args.save_dir or tempfile.mkdtemp(prefix="rl-rollout-"))
    previous_first: list[int] | None = None
    totals = {"rollout_s": 0.0, "tokens": 0}
    print(f"model {args.model} ({llm.engine.model_facts.dtype}), {args.prompts} prompts x {args.n} samples a step, "
          f"{args.system_len}-token system prompt, {args.max_tokens} tokens each"
          + (", cache flushed at every update" if args.flush_cache else ""))
    for step in range(args.steps):
        stale = "-"
        if previous_first is not None:  # the last step's prompt: cached under the old weights only
            probe = llm.generate(previous_first, SamplingParams(max_tokens=1), use_tqdm=False)[0]
            stale = str(probe.num_cached_tokens)
            if probe.num_cached_tokens:
                raise SystemExit(f"step {step}: {probe.num_cached_tokens} tokens of an old weight version were hit")
        prompts = [system + [rng.randrange(3, vocab) for _ in range(args.question_len)] for _ in range(args.prompts)]
        params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, logprobs=0, ignore_eos=True,
                                seed=step)
        before = llm.get_stats()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        rollout = time.perf_counter() - t0
        after = llm.get_stats()
        queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
        hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
        samples = [c for o in outs for c in o.outputs]
        assert all(len(c.logprobs) == len(c.token_ids) for c in samples)  # the sampled tokens' logprobs
        tokens = sum(len(c.token_ids) for c in samples)
        totals["rollout_s"] += rollout
        totals["tokens"] += tokens
        previous_first = prompts[0]

        t1 = time.perf_counter()
        train_step(trainer, 1e-3, generator)
        path = save_root / f"step-{step + 1}"
        save_checkpoint(trainer, path)
        saved = time.perf_counter() - t1
        result = llm.update_weights(str(path), weight_version=f"step-{step + 1}")
        if args.flush_cache:
            llm.reset_prefix_cache()
        print(f"step {step}: rollout {rollout:.2f}s ({tokens / rollout:.0f} tok/s), prefix hit rate "
              f"{hits / max(1, queries):.1%}, old-version tokens hit {stale} | save {saved:.2f}s, update "
              f"{result['seconds']:.2f}s -> {result['weight_version']}")
    print(f"rollout throughput {totals['tokens'] / totals['rollout_s']:.0f} tok/s over {args.steps} steps; "
          f"no block of an old weight version was hit")


if __name__ == "__main__":
    main()
