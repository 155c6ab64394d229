"""LFM2 (gated short convolutions + attention) against transformers on tiny float32 weights: from
the HF checkpoint and from the GGUF file llama.cpp's own converter writes for it, greedy tokens
equal; prefix hits (the conv windows checkpointed as Mamba states are) change nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from hyprefix import LLM, SamplingParams
from tests.support.compare import hf_greedy, random_prompts
from tests.support.gguf_convert import run_converter
from tests.support.models import random_varied_model, save_tiny_checkpoint

LENGTHS = (3, 16, 23, 57)  # below, at and across the block size 16 and the chunk of 32
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _config():
    from transformers import Lfm2Config

    # conv / attention / conv / conv; the MLP width from transformers' auto-adjust (2/3, rounded to 32)
    return Lfm2Config(vocab_size=4096, hidden_size=64, intermediate_size=192, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, conv_L_cache=3,
                      norm_eps=1e-5, layer_types=["conv", "full_attention", "conv", "conv"], initializer_range=0.2,
                      eos_token_id=2, bos_token_id=0, pad_token_id=0, tie_word_embeddings=True,
                      block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0, block_multiple_of=32)


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory) -> tuple[Path, object]:
    """(checkpoint dir, HF model): norms varied off 1 so a misplaced norm shows."""
    model = random_varied_model(_config())
    path = tmp_path_factory.mktemp("lfm2") / "lfm2"
    save_tiny_checkpoint(model, path)
    return path, model


@pytest.fixture(scope="module")
def lfm2_gguf(lfm2, llama_converter, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lfm2-gguf") / "lfm2.gguf"
    run_converter(llama_converter, [(["--outtype", "f32", "--outfile", str(out), str(lfm2[0])], [])])
    return out


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_greedy_matches_transformers(lfm2, lfm2_gguf, source):
    path = lfm2[0] if source == "hf" else lfm2_gguf
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=16, max_num_batched_tokens=32,
              log_stats_interval=0)
    prompts = random_prompts(LENGTHS, seed=2)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(lfm2[1], prompt, GREEDY.max_tokens), f"{source} {len(prompt)}"
    llm.check_invariants()


def test_prefix_hits_change_nothing(lfm2):
    """A follow-up turn that extends an answered prompt hits the cache (its conv windows restored
    from a checkpoint) and decodes as an engine without the cache does."""
    path = lfm2[0]
    prompts = random_prompts((40, 9), seed=3)
    first, tail = prompts
    cached = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=16, log_stats_interval=0)
    answer = cached.generate([first], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    follow_up = first + list(answer) + tail
    hit = cached.generate([follow_up], GREEDY, use_tqdm=False)[0]
    assert hit.num_cached_tokens >= 32
    uncached = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=16, enable_prefix_caching=False,
                   log_stats_interval=0)
    assert hit.outputs[0].token_ids == uncached.generate([follow_up], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert hit.outputs[0].token_ids == hf_greedy(lfm2[1], follow_up, GREEDY.max_tokens)


@pytest.mark.hybrid_graphs
def test_compiled_decode_steps_match_transformers(lfm2):
    """The compiled decode steps (the conv windows updated inside the graph) as the eager ones."""
    llm = LLM(str(lfm2[0]), dtype="float32", num_kv_blocks=64, block_size=16, log_stats_interval=0)
    for prompt in random_prompts((5, 30), seed=4):  # one at a time: batch-1 graphs (batched ones are off here)
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(lfm2[1], prompt, GREEDY.max_tokens)
    assert llm.engine.runner.decode_steps["graph"] > 0
