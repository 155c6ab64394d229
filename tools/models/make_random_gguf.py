"""Write a random-weight model of a real model's shape as GGUF files, the way a llama.cpp user
gets them: an F16 GGUF in llama.cpp's layout whose tokenizer, chat template and special tokens
are SmolLM2's (copied from its GGUF file), then ``llama-quantize`` to each requested type. For
speed benchmarks (random weights decode at the speed of real ones).

    python tools/models/make_random_gguf.py --shape llama-3.2-1b --out /tmp/m \\
        --llama-cpp /tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp --types Q4_K_M Q8_0
    python tools/models/make_random_gguf.py --shape smollm3-3b --out /tmp/m --llama-cpp ... --types Q4_K_M
    python tools/models/make_random_gguf.py --shape qwen3-30b-a3b-16l --out /tmp/m --llama-cpp ... --types Q4_K_M
    python tools/models/make_random_gguf.py --shape gpt-oss-20b-12l --out /tmp/m
    python tools/models/make_random_gguf.py --shape deepseek-v2-lite-8l --out /tmp/m --llama-cpp ... --types Q4_K_M

``gpt-oss-20b-12l`` is written as llama.cpp's MXFP4 files of gpt-oss are laid out (``llama-quantize``'s
``MXFP4_MOE``: experts MXFP4, every other matrix Q8_0) directly, random blocks without an F16 file
(which would be four times the size), so it needs no ``--llama-cpp``.

``--llama-cpp`` is llama.cpp's source tree (from the llama-cpp-python sdist) with
``llama-quantize`` built in ``build/bin`` (``cmake --build build --target llama-quantize``).
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from hyprefix import catalog

# Real models' shapes with SmolLM2's vocabulary (tied embeddings: no output.weight, as the real
# ones, but for the MoE shape, whose model has its own head). ``arch``: the file's architecture
# (SmolLM3's has a NoPE layer every fourth, as llama.cpp runs it). ``qwen3-30b-a3b-16l``:
# Qwen3-30B-A3B's layer (hidden 2048, 32 / 4 heads of 128, QK-norm, top-8 experts of 768) with 64
# experts instead of 128 and 16 layers instead of 48, to fit 24 GiB and 2 cores (4.8B parameters,
# 1.0B active a token).
SHAPES = {
    "llama-3.2-1b": dict(arch="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                         max_position_embeddings=8192, rms_norm_eps=1e-5),
    "smollm3-3b": dict(arch="smollm3", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=128, rope_theta=5000000.0,
                       max_position_embeddings=65536, rms_norm_eps=1e-6),
    "qwen3-30b-a3b-16l": dict(arch="qwen3moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=16,
                              num_attention_heads=32, num_key_value_heads=4, head_dim=128, rope_theta=1000000.0,
                              max_position_embeddings=40960, rms_norm_eps=1e-6, num_experts=64,
                              num_experts_per_tok=8, moe_intermediate_size=768),
    # gpt-oss-20b's layer (hidden 2880, 64 / 8 heads of 64, 32 experts of 2880, top 4, a 128-token
    # window every other layer, sinks, YaRN) with 12 layers instead of 24 (10.8B parameters, 1.9B
    # active a token; the file 5.4 GB)
    "gpt-oss-20b-12l": dict(arch="gpt-oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=12,
                            num_attention_heads=64, num_key_value_heads=8, head_dim=64, rope_theta=150000.0,
                            max_position_embeddings=131072, rms_norm_eps=1e-5, num_experts=32,
                            num_experts_per_tok=4, moe_intermediate_size=2880, sliding_window=128),
    # DeepSeek-V2-Lite's layer (hidden 2048, 16 heads, MLA: a 512-wide latent plus 64 rotary dims,
    # keys 128 + 64 and values 128 a head; 64 experts of 1408, top 6, 2 shared; the first layer
    # dense, 10944 wide) with 8 layers instead of 27 (4.2B parameters, 0.9B active a token), and q
    # through a rank-1536 bottleneck as V2 and V3 have it: llama.cpp reads a deepseek2 file without
    # one only at V2-Lite's 26 or 27 layers
    "deepseek-v2-lite-8l": dict(arch="deepseek2", hidden_size=2048, intermediate_size=10944, num_hidden_layers=8,
                                q_lora_rank=1536,
                                num_attention_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                v_head_dim=128, rope_theta=10000.0, max_position_embeddings=163840, rms_norm_eps=1e-6,
                                num_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408, n_shared_experts=2,
                                first_k_dense_replace=1),
}


def _deepseek_metadata(w, cfg: dict) -> None:
    """The ``deepseek2`` keys llama.cpp's converter writes for V2-Lite (MLA widths as MQA)."""
    rank, rope, nope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"]
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    w.add_key_length(rank + rope)
    w.add_value_length(rank)
    w.add_key_length_mla(nope + rope)
    w.add_value_length_mla(cfg["v_head_dim"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_count(cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(1.0)
    w.add_rope_dimension_count(rope)


def _deepseek_tensors(cfg: dict, vocab: int) -> dict[str, tuple[int, ...]]:
    hidden, heads, rank = cfg["hidden_size"], cfg["num_attention_heads"], cfg["kv_lora_rank"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    moe = cfg["moe_intermediate_size"]
    experts, shared = cfg["num_experts"], cfg["n_shared_experts"] * moe
    tensors = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,), "output.weight": (vocab, hidden)}
    for i in range(cfg["num_hidden_layers"]):
        q_rank = cfg["q_lora_rank"]
        block = {"attn_norm": (hidden,), "ffn_norm": (hidden,), "attn_q_a": (q_rank, hidden),
                 "attn_q_a_norm": (q_rank,), "attn_q_b": (heads * (nope + rope), q_rank),
                 "attn_kv_a_mqa": (rank + rope, hidden), "attn_kv_a_norm": (rank,), "attn_k_b": (heads, rank, nope),
                 "attn_v_b": (heads, v, rank), "attn_output": (hidden, heads * v)}
        if i < cfg["first_k_dense_replace"]:
            inter = cfg["intermediate_size"]
            block.update(ffn_gate=(inter, hidden), ffn_up=(inter, hidden), ffn_down=(hidden, inter))
        else:
            block.update(ffn_gate_inp=(experts, hidden), ffn_gate_exps=(experts, moe, hidden),
                         ffn_up_exps=(experts, moe, hidden), ffn_down_exps=(experts, hidden, moe),
                         ffn_gate_shexp=(shared, hidden), ffn_up_shexp=(shared, hidden),
                         ffn_down_shexp=(hidden, shared))
        tensors.update({f"blk.{i}.{name}.weight": dims for name, dims in block.items()})
    return tensors


def _writer(shape: str, tokenizer_gguf: Path, path: Path):
    """(a GGUF writer of ``path`` for the shape's architecture, named, holding the tokenizer's
    ``tokenizer.*`` fields; the vocabulary's size)."""
    import gguf

    source = gguf.GGUFReader(str(tokenizer_gguf))
    w = gguf.GGUFWriter(str(path), SHAPES[shape]["arch"])
    w.add_name(f"random {shape}")
    for field in source.fields.values():
        if field.name.startswith("tokenizer."):
            value_type = field.types[0]
            sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    return w, len(source.get_field("tokenizer.ggml.tokens").contents())


def write_f16(shape: str, tokenizer_gguf: Path, out: Path) -> Path:
    """The F16 file: llama.* metadata of the shape, SmolLM2's tokenizer.* fields, random tensors
    (normal, std 0.02; norms 1)."""
    import gguf
    import numpy as np

    cfg = SHAPES[shape]
    path = out / f"{shape}-F16.gguf"
    w, vocab = _writer(shape, tokenizer_gguf, path)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg.get("num_key_value_heads", 1))
    if cfg["arch"] == "deepseek2":
        _deepseek_metadata(w, cfg)
    else:
        w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    experts = cfg.get("num_experts", 0)
    if experts and cfg["arch"] == "qwen3moe":
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    rng = np.random.default_rng(0)
    tensors = _deepseek_tensors(cfg, vocab) if cfg["arch"] == "deepseek2" else _llama_tensors(cfg, vocab)
    for name, shape_ in tensors.items():
        if len(shape_) == 1:
            w.add_tensor(name, np.ones(shape_, dtype=np.float32))
        else:
            w.add_tensor(name, (rng.standard_normal(shape_, dtype=np.float32) * 0.02).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _llama_tensors(cfg: dict, vocab: int) -> dict[str, tuple[int, ...]]:
    """Llama's and Qwen3-MoE's tensors and their shapes."""
    hidden, inter, heads, kv, dim = (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"],
                                     cfg["num_key_value_heads"], cfg["head_dim"])
    experts = cfg.get("num_experts", 0)
    tensors = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if experts:
        tensors["output.weight"] = (vocab, hidden)
    for i in range(cfg["num_hidden_layers"]):
        block = {"attn_norm": (hidden,), "ffn_norm": (hidden,), "attn_q": (heads * dim, hidden),
                 "attn_k": (kv * dim, hidden), "attn_v": (kv * dim, hidden), "attn_output": (hidden, heads * dim)}
        if experts:
            moe = cfg["moe_intermediate_size"]
            block.update(attn_q_norm=(dim,), attn_k_norm=(dim,), ffn_gate_inp=(experts, hidden),
                         ffn_gate_exps=(experts, moe, hidden), ffn_up_exps=(experts, moe, hidden),
                         ffn_down_exps=(experts, hidden, moe))
        else:
            block.update(ffn_gate=(inter, hidden), ffn_up=(inter, hidden), ffn_down=(hidden, inter))
        tensors.update({f"blk.{i}.{name}.weight": dims for name, dims in block.items()})
    return tensors


def _random_blocks(rng, kind: str, shape: tuple[int, ...]):
    """Random blocks of ``kind`` for a matrix of ``shape`` (uint8 [..., rows, bytes a row]) whose
    values have a standard deviation near 0.02: Q8_0 a float16 scale of 2.7e-4 for uniform int8
    codes, MXFP4 the E8M0 scale 2^-7 for uniform E2M1 codes (rms 2.9 units of 2^-7)."""
    import numpy as np

    *lead, cols = shape
    size = {"Q8_0": 34, "MXFP4": 17}[kind]
    raw = rng.integers(0, 256, size=(*lead, cols // 32, size), dtype=np.uint8)
    if kind == "Q8_0":
        raw[..., :2] = np.array([2.7e-4], dtype=np.float16).view(np.uint8)
    else:
        raw[..., 0] = 120
    return raw.reshape(*lead, cols // 32 * size)


def write_gpt_oss(shape: str, tokenizer_gguf: Path, out: Path) -> Path:
    """A gpt-oss file as ``MXFP4_MOE`` quantizes one (module docstring), with the converter's
    gpt-oss metadata and SmolLM2's tokenizer fields."""
    import gguf
    import numpy as np

    cfg = SHAPES[shape]
    path = out / f"{shape}-MXFP4.gguf"
    w, vocab = _writer(shape, tokenizer_gguf, path)
    hidden, heads, kv, dim = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    experts, inter = cfg["num_experts"], cfg["moe_intermediate_size"]
    for add, value in ((w.add_block_count, cfg["num_hidden_layers"]), (w.add_context_length, 131072),
                       (w.add_embedding_length, hidden), (w.add_feed_forward_length, inter),
                       (w.add_head_count, heads), (w.add_head_count_kv, kv), (w.add_rope_freq_base, cfg["rope_theta"]),
                       (w.add_layer_norm_rms_eps, cfg["rms_norm_eps"]), (w.add_expert_count, experts),
                       (w.add_expert_used_count, cfg["num_experts_per_tok"]), (w.add_key_length, dim),
                       (w.add_value_length, dim), (w.add_sliding_window, cfg["sliding_window"]),
                       (w.add_expert_feed_forward_length, inter), (w.add_rope_scaling_factor, 32.0),
                       (w.add_rope_scaling_orig_ctx_len, 4096), (w.add_rope_scaling_yarn_beta_fast, 32.0),
                       (w.add_rope_scaling_yarn_beta_slow, 1.0)):
        add(value)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    rng = np.random.default_rng(0)
    q8, mx = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.MXFP4
    w.add_tensor("token_embd.weight", _random_blocks(rng, "Q8_0", (vocab, hidden)), raw_dtype=q8)
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    w.add_tensor("output.weight", _random_blocks(rng, "Q8_0", (vocab, hidden)), raw_dtype=q8)
    for i in range(cfg["num_hidden_layers"]):
        b = f"blk.{i}."
        for name, rows, cols in (("attn_q", heads * dim, hidden), ("attn_k", kv * dim, hidden),
                                 ("attn_v", kv * dim, hidden), ("attn_output", hidden, heads * dim)):
            w.add_tensor(f"{b}{name}.weight", _random_blocks(rng, "Q8_0", (rows, cols)), raw_dtype=q8)
            w.add_tensor(f"{b}{name}.bias", (rng.standard_normal(rows, dtype=np.float32) * 0.02))
        for name, rows, cols in (("ffn_gate_exps", inter, hidden), ("ffn_up_exps", inter, hidden),
                                 ("ffn_down_exps", hidden, inter)):
            w.add_tensor(f"{b}{name}.weight", _random_blocks(rng, "MXFP4", (experts, rows, cols)), raw_dtype=mx)
            w.add_tensor(f"{b}{name}.bias", rng.standard_normal((experts, rows), dtype=np.float32) * 0.02)
        w.add_tensor(f"{b}ffn_gate_inp.weight", rng.standard_normal((experts, hidden), dtype=np.float32) * 0.02)
        w.add_tensor(f"{b}ffn_gate_inp.bias", rng.standard_normal(experts, dtype=np.float32) * 0.02)
        w.add_tensor(f"{b}attn_sinks.weight", rng.standard_normal(heads, dtype=np.float32))
        w.add_tensor(f"{b}attn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(f"{b}post_attention_norm.weight", np.ones(hidden, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="llama-3.2-1b")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--llama-cpp", type=Path, help="llama.cpp source tree with build/bin (llama-quantize)")
    parser.add_argument("--tokenizer-gguf", type=Path,
                        default=catalog.cached_path(catalog.SMOLLM2))
    parser.add_argument("--types", nargs="+", default=["Q4_K_M", "Q8_0"])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if SHAPES[args.shape]["arch"] == "gpt-oss":
        print(write_gpt_oss(args.shape, args.tokenizer_gguf, args.out))
        return
    if args.llama_cpp is None:
        parser.error(f"--llama-cpp is needed to quantize {args.shape}")
    f16 = write_f16(args.shape, args.tokenizer_gguf, args.out)
    for kind in args.types:
        subprocess.run([str(args.llama_cpp / "build" / "bin" / "llama-quantize"), str(f16),
                        str(args.out / f"{args.shape}-{kind}.gguf"), kind], check=True)


if __name__ == "__main__":
    main()
