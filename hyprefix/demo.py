"""Deterministic random-weight demo models in the Hugging Face layout.

They are for tests and benchmarks: the weights are random (their answers are nonsense)
but bit-for-bit reproducible, and they load with plain ``transformers``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers  # a lazy module: the model classes are imported when a demo model is made

# Bump whenever the recipe (configs, init, tokenizer, files written) changes: the cache
# directory name includes it, so old cached models are not reused.
DEMO_VERSION = "2"

ARCHS = ("dense", "hybrid", "deltanet", "lfm2")
SIZES = ("tiny", "bench")
# Names ``--model`` accepts for the demo models: (arch, size) of ``demo_model_path``.
DEMO_ALIASES = {
    "demo-dense-0.6b": ("dense", "bench"),
    "demo-hybrid-0.5b": ("hybrid", "bench"),
    "demo-dense-tiny": ("dense", "tiny"),
    "demo-hybrid-tiny": ("hybrid", "tiny"),
    "demo-qwen3.5-0.8b": ("deltanet", "bench"),
    "demo-qwen3.5-tiny": ("deltanet", "tiny"),
    "demo-lfm2-350m": ("lfm2", "bench"),
    "demo-lfm2-tiny": ("lfm2", "tiny"),
}

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
TOKENIZER_JSON = ASSETS_DIR / "tokenizer.json"

TOKENIZER_VOCAB_SIZE = 4096
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

_DENSE_SHAPES: dict[str, dict[str, Any]] = {
    # Answers in milliseconds on CPU; stored in float32.
    "tiny": {
        "vocab_size": TOKENIZER_VOCAB_SIZE,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "intermediate_size": 768,
        "max_position_embeddings": 4096,
        # Large init so greedy decoding has a peaked, non-flat distribution.
        "initializer_range": 0.1,
    },
    # Qwen3-0.6B shapes; stored in bfloat16.
    "bench": {
        "vocab_size": 151936,
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 3072,
        "max_position_embeddings": 40960,
        "initializer_range": 0.02,
    },
}
_DTYPES = {"tiny": torch.float32, "bench": torch.bfloat16}
_SEED = 0


def _demo_fields(arch: str, size: str, note: str = "random weights, deterministic (seed 0)") -> dict[str, Any]:
    """Config fields every demo model has: the tokenizer's special ids and the recipe."""
    return {
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": IM_END_ID,
        "pad_token_id": ENDOFTEXT_ID,
        "hyprefix_demo": {"recipe_version": DEMO_VERSION, "arch": arch, "size": size, "seed": _SEED,
                          "tokenizer_vocab_size": TOKENIZER_VOCAB_SIZE, "note": note},
    }


def _check(arch: str, size: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown demo arch {arch!r}; valid: {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"unknown demo size {size!r}; valid: {', '.join(SIZES)}")


def _dense_config(size: str) -> transformers.Qwen3Config:
    shape = _DENSE_SHAPES[size]
    note = "random weights, deterministic (seed 0)"
    if shape["vocab_size"] != TOKENIZER_VOCAB_SIZE:
        note += (
            f"; vocab_size {shape['vocab_size']} > tokenizer vocab {TOKENIZER_VOCAB_SIZE}: "
            f"ids >= {TOKENIZER_VOCAB_SIZE} have embeddings but no tokens"
        )
    return transformers.Qwen3Config(
        **shape,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        attention_bias=False,
        attention_dropout=0.0,
        use_sliding_window=False,
        max_window_layers=shape["num_hidden_layers"],
        use_cache=True,
        **_demo_fields("dense", size, note=note),
    )


_HYBRID_SHAPES: dict[str, dict[str, Any]] = {
    # NemotronH-style: Mamba2 (M), attention without RoPE (*), ReLU^2 MLP (-).
    "tiny": {
        "vocab_size": TOKENIZER_VOCAB_SIZE,
        "hidden_size": 256,
        "hybrid_override_pattern": "M-M*M-",
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "mamba_num_heads": 8,
        "mamba_head_dim": 32,
        "ssm_state_size": 32,
        "n_groups": 2,
        "chunk_size": 64,
        "intermediate_size": 768,
        "max_position_embeddings": 4096,
        "initializer_range": 0.1,
    },
    # "demo-hybrid-0.5b": about the size of Qwen3-0.6B (12 Mamba2, 4 attention, 12 MLP layers).
    "bench": {
        "vocab_size": 151936,
        "hidden_size": 1024,
        "hybrid_override_pattern": "M-M-M*-" * 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "mamba_num_heads": 48,
        "mamba_head_dim": 64,
        "ssm_state_size": 128,
        "n_groups": 8,
        "chunk_size": 128,
        "intermediate_size": 4096,
        "max_position_embeddings": 40960,
        "initializer_range": 0.02,
    },
}


def _hybrid_config(size: str) -> transformers.NemotronHConfig:
    shape = dict(_HYBRID_SHAPES[size])
    return transformers.NemotronHConfig(
        **shape,
        conv_kernel=4,
        mlp_hidden_act="relu2",
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=False,  # transformers' NemotronH never ties its LM head
        use_bias=False,
        use_conv_bias=True,
        attention_bias=False,
        mlp_bias=False,
        **_demo_fields("hybrid", size),
    )


_DELTANET_SHAPES: dict[str, dict[str, Any]] = {
    # Qwen3.5-style: Gated DeltaNet layers with a gated-attention layer every fourth.
    "tiny": {
        "vocab_size": TOKENIZER_VOCAB_SIZE,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "intermediate_size": 768,
        "max_position_embeddings": 4096,
        "initializer_range": 0.1,
    },
    # "demo-qwen3.5-0.8b": Qwen3.5-0.8B shapes (18 DeltaNet + 6 attention layers, 248k vocabulary).
    "bench": {
        "vocab_size": 248320,
        "hidden_size": 1024,
        "num_hidden_layers": 24,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "intermediate_size": 3584,
        "max_position_embeddings": 40960,
        "initializer_range": 0.02,
    },
}


def _deltanet_config(size: str) -> transformers.Qwen3_5TextConfig:
    shape = dict(_DELTANET_SHAPES[size])
    layers = shape["num_hidden_layers"]
    return transformers.Qwen3_5TextConfig(
        **shape,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        linear_conv_kernel_dim=4,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        attention_bias=False,
        **_demo_fields("deltanet", size),
    )


_LFM2_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"hidden_size": 256, "intermediate_size": 1152, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2, "initializer_range": 0.1},
    # "demo-lfm2-350m": LFM2-350M shapes (10 short-convolution + 6 attention layers; our 4,096-token
    # vocabulary in place of its 65,536).
    "bench": {"hidden_size": 1024, "intermediate_size": 6656, "num_hidden_layers": 16, "num_attention_heads": 16,
              "num_key_value_heads": 8, "initializer_range": 0.02},
}
_LFM2_ATTENTION = {"tiny": (1,), "bench": (2, 5, 8, 10, 12, 14)}  # LFM2-350M's attention layers


def _lfm2_config(size: str) -> transformers.Lfm2Config:
    shape = _LFM2_SHAPES[size]
    layers = shape["num_hidden_layers"]
    return transformers.Lfm2Config(
        **shape, vocab_size=TOKENIZER_VOCAB_SIZE, max_position_embeddings=128_000, conv_L_cache=3, conv_bias=False,
        norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        layer_types=["full_attention" if i in _LFM2_ATTENTION[size] else "conv" for i in range(layers)],
        block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0, block_multiple_of=256, tie_word_embeddings=True,
        **_demo_fields("lfm2", size),
    )


_BUILDERS = {"dense": (_dense_config, "Qwen3ForCausalLM"), "hybrid": (_hybrid_config, "NemotronHForCausalLM"),
             "deltanet": (_deltanet_config, "Qwen3_5ForCausalLM"), "lfm2": (_lfm2_config, "Lfm2ForCausalLM")}


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_tokenizer(out: Path, model_max_length: int) -> None:
    shutil.copyfile(TOKENIZER_JSON, out / "tokenizer.json")
    added = {
        str(i): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, tok in enumerate((ENDOFTEXT, IM_START, IM_END))
    }
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": added,
            "bos_token": None,
            "eos_token": IM_END,
            "pad_token": ENDOFTEXT,
            "unk_token": None,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "model_max_length": model_max_length,
            "split_special_tokens": False,
        },
    )
    _write_json(out / "special_tokens_map.json", {"eos_token": IM_END, "pad_token": ENDOFTEXT})


def make_demo_model(arch: str, out_dir: str | Path, *, size: str = "tiny") -> Path:
    """Write a deterministic random-weight demo model to ``out_dir`` and return its path.

    Files: config.json, model.safetensors, generation_config.json, tokenizer.json,
    tokenizer_config.json, special_tokens_map.json. The same (arch, size) always gives
    byte-identical files for a given torch/transformers install.
    """
    _check(arch, size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    make_config, class_name = _BUILDERS[arch]
    config = make_config(size)
    model_class = getattr(transformers, class_name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        # _from_config builds directly in the target dtype (no float32 copy of the bench model).
        model = model_class._from_config(config, dtype=_DTYPES[size])
    model.eval()
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=IM_END_ID,
        pad_token_id=ENDOFTEXT_ID,
        do_sample=False,
    )
    # transformers 5 always writes safetensors; one shard keeps the name model.safetensors.
    model.save_pretrained(out, max_shard_size="100GB")
    del model
    _write_tokenizer(out, config.max_position_embeddings)
    return out


def cache_dir() -> Path:
    env = os.environ.get("HYPREFIX_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hyprefix"


def demo_model_path(arch: str = "dense", size: str = "tiny") -> Path:
    """Return the cached demo model directory, building it on first use.

    The model is built in a temporary sibling directory and renamed into place, so a
    directory with the final name is always complete, even with concurrent callers.
    """
    _check(arch, size)
    root = cache_dir()
    final = root / f"demo-{arch}-{size}-v{DEMO_VERSION}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(root, final.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=root))
    try:
        make_demo_model(arch, tmp, size=size)
        tmp.chmod(0o755)  # mkdtemp (and transformers' file writes) use owner-only modes
        for f in tmp.iterdir():
            f.chmod(0o644)
        try:
            tmp.rename(final)
        except OSError:
            if not final.is_dir():  # not a lost race with another builder
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def resolve_demo_alias(name: str) -> str | None:
    """The cached directory of the demo model ``name`` names (built on first use), or
    None when ``name`` is not one of ``DEMO_ALIASES``."""
    if name not in DEMO_ALIASES:
        return None
    arch, size = DEMO_ALIASES[name]
    return str(demo_model_path(arch, size))


def _remove_stale_tmp(root: Path, name: str, max_age_s: float = 24 * 3600) -> None:
    # Leftovers of killed builds; young ones may belong to a build still in progress.
    now = time.time()
    for p in root.glob(f".{name}.*.tmp"):
        try:
            if now - p.stat().st_mtime > max_age_s:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass
