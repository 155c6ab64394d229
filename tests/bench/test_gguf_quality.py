"""tools/bench/gguf_quality.py on a tiny GGUF (the one-layer Llama of ``test_gguf_native``, its
matrices in Q4_K, Q6_K, Q4_0, Q5_0, Q4_1 and Q8_0 blocks): the metrics are what they say (KL of known
distributions, common prefixes), the all-position logits end in what the engine's prefill gives
for the last token, and the report has every format, the reference against itself at exactly 0
and the default (the file's blocks, activations rounded to int8) a small positive KL."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from hyprefix import LLM
from hyprefix.kernels import quant_linear as quant_kernel
from hyprefix.text import common_prefix
from tests.models.test_gguf_errors import VOCAB
from tests.models.test_gguf_native import TYPES, write_mixed_gguf
from tests.support.compare import our_last_logits, random_prompts
from tools.bench import gguf_quality as gq

pytestmark = pytest.mark.skipif(not quant_kernel.available(), reason="quant_linear does not build or run here")

BAD = gq.Format("unknown quantization", "int3", "float32")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """``test_gguf_native``'s mixed-type file (its matrices in ``TYPES``)."""
    return write_mixed_gguf(tmp_path_factory.mktemp("quality") / "mixed.gguf")


@pytest.fixture(scope="module")
def engine_args(tiny_models) -> dict:
    return {"tokenizer": str(tiny_models["llama"][0]), "max_model_len": 64, "num_kv_blocks": 64,
            "enforce_eager": True, "log_stats_interval": 0}


@pytest.fixture(scope="module")
def report(tiny_gguf, engine_args) -> dict:
    texts = random_prompts([48, 29, 33], seed=1, vocab=VOCAB)
    prompts = random_prompts([5, 9, 6, 7], seed=2, vocab=VOCAB)
    return gq.evaluate_file(str(tiny_gguf), texts, prompts, formats=(*gq.FORMATS, BAD), max_tokens=8,
                            ignore_eos=True, engine_args=engine_args)


def test_metrics_of_known_inputs() -> None:
    logits = torch.randn(5, 7)
    assert torch.equal(gq.kl_divergence(logits, logits), torch.zeros(5, dtype=torch.float64))
    # p = (1/2, 1/2), q = (3/4, 1/4): KL(p || q) = ln(2/3) / 2 + ln(2) / 2
    kl = gq.kl_divergence(torch.zeros(1, 2), torch.tensor([[math.log(3.0), 0.0]], dtype=torch.float64))
    assert kl.item() == pytest.approx(0.5 * math.log(2 / 3) + 0.5 * math.log(2), rel=1e-12)
    assert gq.kl_divergence(torch.tensor([[5.0, 0.0]]), torch.tensor([[0.0, 5.0]])).item() > 0
    stats = gq.distribution_agreement([logits], [logits.flip(-1)], [[0, 1, 2, 3, 4]])
    assert stats["positions"] == 5 and stats["mean_kl"] > 0 and stats["max_kl"] >= stats["p99_kl"] >= 0
    assert set(stats) == {"mean_kl", "p99_kl", "max_kl", "top1_pct", "positions", "mean_nll"}
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([], [1]) == 0
    agreement = gq.greedy_agreement([[1, 2, 3], [4, 5], [6]], [[1, 2, 3], [4, 6], [7, 7]])
    assert agreement == {"identical_pct": pytest.approx(100 / 3), "mean_common_prefix": pytest.approx(4 / 3),
                         "mean_ref_tokens": 2.0, "completions": 3}


def test_position_logits_end_in_the_engines_last_token_logits(tiny_gguf, engine_args) -> None:
    """Every position's logits, the last equal to ``our_last_logits``'s, each prefix's the same as
    the whole prompt's at those positions (causal); the KV slots are given back."""
    llm = LLM(str(tiny_gguf), quantization=None, dtype="float32", **engine_args)
    prompt = random_prompts([37], seed=3, vocab=VOCAB)[0]
    free = llm.engine.cache.kv.pool.num_free
    logits = gq.position_logits(llm, prompt, rows=8)
    assert logits.shape == (len(prompt), VOCAB) and logits.dtype == torch.float32
    assert llm.engine.cache.kv.pool.num_free == free
    torch.testing.assert_close(logits[-1], our_last_logits(llm, [prompt])[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(logits[:20], gq.position_logits(llm, prompt[:20]), rtol=0, atol=1e-5)


def test_report_has_every_format(report, tiny_gguf) -> None:
    rows = {r["name"]: r for r in report["formats"]}
    assert list(rows) == [f.name for f in (*gq.FORMATS, BAD)]
    assert "int3" in rows[BAD.name]["error"]  # reported, not raised
    for fmt in gq.FORMATS:
        row = rows[fmt.name]
        assert "error" not in row, row
        assert row["positions"] == 48 + 29 + 33 and row["completions"] == 4 and row["mean_ref_tokens"] == 8
        assert row["max_kl"] >= row["p99_kl"] >= 0 and row["max_kl"] >= row["mean_kl"] >= 0
        assert row["resident_bytes"] > 0 and math.isfinite(row["mean_nll"])
    assert report["file_bytes"] == tiny_gguf.stat().st_size
    assert report["file_types"] == dict(Counter([*TYPES.values(), *["F32"] * report["file_types"]["F32"]]))
    table = gq.markdown(report)
    assert all(f"| {f.name}" in table for f in gq.FORMATS) and "error: " in table


def test_reference_against_itself_is_exact(report) -> None:
    ref = report["formats"][0]
    assert ref["name"] == gq.REFERENCE.name
    assert ref["mean_kl"] == ref["p99_kl"] == ref["max_kl"] == 0.0
    assert ref["top1_pct"] == 100.0 and ref["identical_pct"] == 100.0
    assert ref["mean_common_prefix"] == ref["mean_ref_tokens"]


def test_file_blocks_are_close_to_the_dequantized_file(report) -> None:
    """The default format keeps the file's numbers and differs from the reference only by the
    activations' rounding to int8: a positive, small KL, the same argmax almost everywhere, in
    less memory than the float32 reference; int4, which rounds the file's Q6_K and Q8_0 matrices
    to 4 bits as well, is further off."""
    rows = {r["name"]: r for r in report["formats"]}
    ref, default, int4 = rows[gq.REFERENCE.name], rows[gq.FORMATS[1].name], rows[gq.FORMATS[3].name]
    assert 0 < default["mean_kl"] < 2e-2 and default["max_kl"] < 0.3  # random weights: loose bounds
    assert default["top1_pct"] >= 90
    assert int4["mean_kl"] > default["mean_kl"]
    assert default["resident_bytes"] < ref["resident_bytes"] / 3
