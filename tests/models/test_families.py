"""SmolLM3, Phi-3 / Phi-4-mini and Granite 3.x (``models/smollm3.py``, ``phi3.py``, ``granite.py``)
against transformers, from their HF checkpoints and from the GGUF files llama.cpp's own converter
writes for them (``gguf_config`` rebuilds those files' configs).

Tiny random float32 checkpoints, one per case, built once per session, converted in one converter
run: SmolLM3 with a NoPE layer (the fourth of four) and a tied head; Phi-3 with an untied head and
a sliding window (24) the longer prompts cross; Phi-4-mini's shape (partial rotary 0.75, LongRoPE
with distinct short and long factors, tied head) with an original context of 64; Granite with all
four multipliers far from 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hyprefix import LLM, SamplingParams
from hyprefix.kernels import decode_layers, quant_linear
from hyprefix.models.layers import Linear
from hyprefix.models.loader import iter_gguf, load_config, load_tokenizer
from tests.support.compare import hf_greedy, random_prompts
from tests.support.gguf_convert import run_converter
from tests.support.models import save_tiny_checkpoint

FAMILIES = ("smollm3", "phi3", "phi4", "granite")
PHI4_ORIGINAL = 64  # the tiny Phi-4-mini's original_max_position_embeddings
TOKENS = 12
# case -> (family, engine arguments, prompt lengths). Phi-4-mini by default (max_model_len 1024)
# runs the long factors, which is what transformers computes past 64 tokens; with max_model_len 64
# the short ones, what it computes up to 64.
CASES = {
    "smollm3": ("smollm3", {}, (3, 17, 40, 70)),
    "phi3": ("phi3", {}, (3, 17, 40, 70)),
    "phi4_long": ("phi4", {}, (65, 70, 100)),
    "phi4_short": ("phi4", {"max_model_len": PHI4_ORIGINAL}, (3, 17, 40, PHI4_ORIGINAL - TOKENS)),
    "granite": ("granite", {}, (3, 17, 40, 70)),
}
Q8_FAMILIES = ("smollm3", "phi4")  # llama.cpp's q/k row order undone; fused q/k/v and gate/up


def _config(family: str):
    from transformers import GraniteConfig, Phi3Config, SmolLM3Config

    common = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  initializer_range=0.2, eos_token_id=2, bos_token_id=0, pad_token_id=0)
    if family == "smollm3":
        return SmolLM3Config(**{**common, "num_hidden_layers": 4}, tie_word_embeddings=True)
    if family == "phi3":
        return Phi3Config(**common, tie_word_embeddings=False, sliding_window=24)
    if family == "phi4":
        return Phi3Config(**common, tie_word_embeddings=True, original_max_position_embeddings=PHI4_ORIGINAL,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 0.75,
                                           "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                           "long_factor": [1.5, 2.0, 3.0, 5.0, 8.0, 13.0]})
    return GraniteConfig(**common, tie_word_embeddings=False, embedding_multiplier=12.0, attention_multiplier=0.05,
                         residual_multiplier=0.22, logits_scaling=8.0)


def _build(family: str, out: Path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32).eval()
    with torch.no_grad():  # HF leaves the norms at 1: vary them so a misplaced one shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
    save_tiny_checkpoint(model, out)
    if family.startswith("phi"):  # as Phi-4-mini's own: the converter reads it as a BPE vocabulary
        config = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    return model


@pytest.fixture(scope="session")
def families(llama_converter, tmp_path_factory) -> dict[str, tuple[Path, Path, object]]:
    """family -> (HF checkpoint dir, its f32 GGUF file, HF model); the Q8_0 files of
    ``Q8_FAMILIES`` as ``{family}-q8_0.gguf`` beside the f32 ones. One converter run for all."""
    root = tmp_path_factory.mktemp("families")
    models = {family: _build(family, root / family) for family in FAMILIES}
    jobs = [(["--outtype", "f32", "--outfile", str(root / f"{f}.gguf"), str(root / f)], []) for f in FAMILIES]
    jobs += [(["--outtype", "q8_0", "--outfile", str(root / f"{f}-q8_0.gguf"), str(root / f)], [])
             for f in Q8_FAMILIES]
    run_converter(llama_converter, jobs)
    return {f: (root / f, root / f"{f}.gguf", models[f]) for f in FAMILIES}


@pytest.fixture(scope="session")
def references(families) -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    """case -> (prompts, transformers' greedy tokens for each)."""
    out = {}
    for case, (family, _, lengths) in CASES.items():
        prompts = random_prompts(lengths, seed=5)
        out[case] = prompts, [hf_greedy(families[family][2], p, TOKENS) for p in prompts]
    return out


def _llm(path: Path, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", num_kv_blocks=64, log_stats_interval=0, **kwargs)


PARAMS = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(families, references, case, source):
    """The engine's greedy tokens equal transformers' ``generate`` on the HF model, from the HF
    checkpoint (batch-1 decode steps compiled, as by default) and from the converter's f32 GGUF
    file (decoding eagerly); prompts within one block, across blocks and across Phi-3's window; a
    repeated prompt hits the prefix cache and decodes the same."""
    family, kwargs, _ = CASES[case]
    hf_dir, gguf, _ = families[family]
    prompts, expected = references[case]
    llm = _llm(hf_dir, **kwargs) if source == "hf" else _llm(gguf, enforce_eager=True, **kwargs)
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    for prompt, out, want in zip(prompts, outs, expected, strict=True):
        assert out.outputs[0].token_ids == want, f"{case} ({source}), prompt length {len(prompt)}"
    again = llm.generate([prompts[-1]], PARAMS, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == expected[-1]
    llm.check_invariants()


@pytest.mark.parametrize("case", ["smollm3", "phi4_long", "granite"])
def test_without_prefix_caching_the_same_tokens(families, references, case):
    """With the prefix cache off the tokens are transformers' too (so the same as with hits)."""
    family, kwargs, _ = CASES[case]
    prompts, expected = references[case]
    llm = _llm(families[family][0], enable_prefix_caching=False, **kwargs)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)] == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_config_and_tensors_are_transformers(families, family):
    """The config rebuilt from the file's metadata is the checkpoint's where the model reads it,
    and every tensor the file gives is the HF model's own under its name (q/k rows put back in
    Llama's order for SmolLM3 and Granite; Phi-3's fused matrices as they are)."""
    _, gguf, hf = families[family]
    config, theirs = load_config(gguf), hf.config
    assert type(config) is type(theirs) and config.architectures == theirs.architectures
    keys = ["num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "tie_word_embeddings", "rms_norm_eps", "max_position_embeddings", "rope_parameters"]
    keys += {"smollm3": ["no_rope_layers"], "phi3": ["sliding_window"], "phi4": ["original_max_position_embeddings"],
             "granite": ["embedding_multiplier", "attention_multiplier", "residual_multiplier",
                         "logits_scaling"]}[family]
    for key in keys:
        assert _float32_lists(getattr(config, key)) == _float32_lists(getattr(theirs, key)), key
    tensors, state = dict(iter_gguf(gguf, config)), hf.state_dict()
    assert {name for name, _ in hf.named_parameters()} <= set(tensors) <= set(state)
    for name, tensor in tensors.items():
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0, msg=f"{family}: {name}")


def _float32_lists(value):
    """``value`` with the numbers of its lists (LongRoPE's factors) rounded to float32, as a GGUF keeps them."""
    if isinstance(value, dict):
        return {k: _float32_lists(v) for k, v in value.items()}
    return [float(torch.tensor(v, dtype=torch.float32)) for v in value] if isinstance(value, list) else value


@pytest.mark.parametrize("family", ["smollm3", "granite"])
def test_tokenizer_from_the_file(families, family):
    """transformers' GGUF reader knows neither architecture; the tokenizer still comes from the
    file's metadata (``load_tokenizer`` teaches transformers them first), splitting as the checkpoint's."""
    from transformers import PreTrainedTokenizerFast

    hf_dir, gguf, _ = families[family]
    ours = load_tokenizer(gguf)
    reference = PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"))
    text = "Hello world, <|im_start|>user\nhi there<|im_end|> 12345"
    assert ours.encode(text) == reference.encode(text) and ours.eos_token == "<|im_end|>"


def test_smollm3_nope_layers_follow_the_config():
    """Each layer rotates where ``no_rope_layers`` says (any pattern an HF config gives); a NoPE
    layer keeps the model off the one-call decode kernel, which rotates every layer."""
    from transformers import SmolLM3Config

    from hyprefix.models.smollm3 import SmolLM3ForCausalLM

    config = SmolLM3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, no_rope_layers=[0, 1, 1, 0])
    model = SmolLM3ForCausalLM(config, torch.float32, torch.device("meta"), 128)
    assert [layer.uses_rope for layer in model.layers] == [False, True, True, False]
    assert not any(layer.fits_decode_kernel() for layer in model.layers)


def _refusal(case: str) -> tuple[object, int]:
    """(a model class and config it refuses, the engine's context limit)."""
    from transformers import GraniteConfig, Phi3Config, SmolLM3Config

    from hyprefix.models.granite import GraniteForCausalLM
    from hyprefix.models.phi3 import Phi3ForCausalLM
    from hyprefix.models.smollm3 import SmolLM3ForCausalLM

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    longrope = {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
                "short_factor": [1.0] * 6, "long_factor": [2.0] * 6}
    extra = {"phi3_long_mscale": {"long_mscale": 1.2}, "phi3_attention_factor": {"attention_factor": 2.0},
             "phi3_factor": {"factor": 4.0}}
    if case in extra:
        return Phi3ForCausalLM, Phi3Config(**common, original_max_position_embeddings=64,
                                           rope_parameters={**longrope, **extra[case]})
    if case == "granite_gelu":
        return GraniteForCausalLM, GraniteConfig(**common, hidden_act="gelu")
    return SmolLM3ForCausalLM, SmolLM3Config(**common, sliding_window=16, use_sliding_window=False,
                                             layer_types=["sliding_attention", "full_attention"])


@pytest.mark.parametrize(("case", "match"), [
    ("phi3_long_mscale", "long_mscale"), ("phi3_attention_factor", "attention factor"),
    ("phi3_factor", "attention factor"), ("granite_gelu", "hidden_act"), ("smollm3_sliding", "use_sliding_window")])
def test_what_cannot_match_is_refused(case, match):
    """Settings whose numbers the engine cannot compute as the reference does raise ValueError
    naming the field. Phi-3's LongRoPE ones only where the long factors run: with a context limit
    up to the original length the numbers are transformers' (which reads none of them but the
    attention factor, and that as it does)."""
    cls, config = _refusal(case)
    with pytest.raises(ValueError, match=match):
        cls(config, torch.float32, torch.device("meta"), 1024)
    if case.startswith("phi3"):
        cls(config, torch.float32, torch.device("meta"), 64)


def test_gguf_builders_refuse_what_they_do_not_rebuild():
    from hyprefix.models.gguf_config import GGUFMetadata
    from hyprefix.models.granite import config_from_gguf

    keys = {"general.architecture": "granite", "granite.block_count": 2, "granite.context_length": 64,
            "granite.embedding_length": 64, "granite.feed_forward_length": 128, "granite.attention.head_count": 4,
            "granite.attention.head_count_kv": 2, "granite.attention.layer_norm_rms_epsilon": 1e-6,
            "granite.logit_scale": 8.0, "tokenizer.ggml.tokens": 256}
    assert config_from_gguf(GGUFMetadata("ok.gguf", keys, ())).attention_multiplier == 16 ** -0.5
    for extra, match in (({"granite.rope.scaling.type": "yarn"}, r"bad\.gguf.*granite\.rope\.scaling\.type"),
                         ({"granite.rope.dimension_count": 8}, "rope.dimension_count"),
                         ({"granite.attention.head_count_kv": [2, 1]}, "per-layer")):
        with pytest.raises(ValueError, match=match):
            config_from_gguf(GGUFMetadata("bad.gguf", {**keys, **extra}, ()))


@pytest.mark.skipif(not decode_layers.available(), reason="the decode_layers kernel does not run here")
@pytest.mark.parametrize("family", ["phi4", "smollm3", "granite"])
def test_int8_decode_kernel_runs_every_llama_layout_family(families, family):
    """int8 Phi-4-mini (fused q/k/v, partial rotary, LongRoPE tables, tied head), SmolLM3 (a NoPE
    layer) and Granite (embedding, attention, residual and logits multipliers far from 1) decode in
    the one-call kernel, each from its own layer description, equal to its layers op by op (hidden
    states, logits, K/V written, greedy tokens)."""
    from tests.kernels.test_decode_layers import _assert_close, _both_paths

    llm = LLM(str(families[family][0]), dtype="float32", num_kv_blocks=128, quantization="int8", enforce_eager=True)
    assert llm.engine.runner.model.decode_kernel
    kernel, ops = _both_paths(llm, random_prompts((5, 17, 70), seed=11))
    _assert_close(kernel, ops)


def _file_floats(model, path: Path) -> dict[str, torch.Tensor]:
    """Our parameters (matrices at their full shape) as the file's tensors, dequantized, fill them."""
    modules = dict(model.named_modules())
    staged = {}
    for name, param in model.named_parameters():
        forms = getattr(modules[name.rpartition(".")[0]], "forms", None)
        shape = (forms.rows, forms.cols) if forms is not None and name.endswith(".weight") else param.shape
        staged[name] = torch.empty(shape)
    model.load_weights(iter_gguf(path, load_config(path)), into=staged)
    return staged


@pytest.mark.skipif(not quant_linear.available(), reason="the quant kernels do not run on this CPU")
@pytest.mark.parametrize("family", Q8_FAMILIES)
def test_q8_0_files_keep_their_blocks(families, family):
    """A Q8_0 file's matrices stay in their blocks (q/k/v and gate/up joined, Phi-3's as fused in
    the file), each equal, dequantized, to what the float path reads from the file (SmolLM3's q/k
    rows in transformers' order); both then decode in the one-call kernel, and a repeated
    prompt hits the prefix cache and decodes the same."""
    q8 = families[family][1].with_name(f"{family}-q8_0.gguf")
    llm = _llm(q8, enforce_eager=True)
    model = llm.engine.runner.model
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear) and "layers." in n}
    assert linears and all(m.forms.quant is not None for m in linears.values()), sorted(linears)
    floats = _file_floats(model, q8)
    for name, linear in linears.items():
        torch.testing.assert_close(linear.forms.quant.dequantize(torch.float32), floats[f"{name}.weight"],
                                   rtol=0, atol=1e-6, msg=name)
    assert model.decode_kernel
    prompts = random_prompts((9, 70), seed=3)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    again = llm.generate([prompts[-1]], PARAMS, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first[-1]
