"""Tiny random-weight HF checkpoints for tests (built with transformers), and the engine
arguments that make tiny prompts take the cascade path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

ASSETS = Path(__file__).resolve().parents[2] / "hyprefix" / "assets"
ARCHS = ("llama", "qwen2", "qwen3", "mistral")
HYBRID_ARCHS = ("nemotron_h", "bamba", "mamba2", "qwen3_5", "qwen3_next")
DELTANET_ARCHS = ("qwen3_5", "qwen3_next")  # Gated DeltaNet hybrids
GEMMA3_WINDOW = 20  # the tiny Gemma 3's sliding window


def _tiny_config(arch: str):
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        initializer_range=0.2, eos_token_id=2, bos_token_id=0, pad_token_id=0,
    )
    if arch == "llama":
        # llama3 RoPE scaling, untied head
        return LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, tie_word_embeddings=False)
    if arch == "qwen2":
        # q/k/v bias, tied embeddings, linear RoPE scaling
        return Qwen2Config(**common, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    if arch == "qwen3":
        # QK-norm, explicit head_dim different from hidden/heads
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    if arch == "mistral":
        # a sliding window short enough that test prompts cross it
        return MistralConfig(**common, sliding_window=24, tie_word_embeddings=False)
    if arch == "gemma3":
        # sliding and full layers, one KV head, heads * head_dim != hidden, attention scale
        # unlike head_dim ** -0.5, linear RoPE scaling on the full layers only
        return Gemma3TextConfig(
            **{**common, "num_hidden_layers": 5, "num_attention_heads": 2, "num_key_value_heads": 1},
            head_dim=16, query_pre_attn_scalar=24, sliding_window=GEMMA3_WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                         "full_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    raise ValueError(arch)


def _tiny_hybrid_config(arch: str):
    from transformers import BambaConfig, Mamba2Config, NemotronHConfig, Qwen3_5TextConfig, Qwen3NextConfig

    common = dict(vocab_size=4096, hidden_size=64, eos_token_id=2, bos_token_id=0, pad_token_id=0,
                  initializer_range=0.2, tie_word_embeddings=False)
    # initializer_range 0.1: at 0.2 the tiny model amplifies float32 rounding so much that
    # transformers' own chunked and recurrent delta rules disagree by up to 4e-4 on a
    # 130-token prompt; at 0.1 they agree within 6e-6 (logits up to ~4).
    deltanet = dict(initializer_range=0.1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                    linear_conv_kernel_dim=4, intermediate_size=128, max_position_embeddings=1024,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    if arch == "qwen3_5":
        # Gated DeltaNet (2 key heads, each serving 2 value heads) and gated attention with
        # partial rotary; tied embeddings as in the small Qwen3.5 models
        return Qwen3_5TextConfig(**{**common, "tie_word_embeddings": True, **deltanet}, num_hidden_layers=4,
                                 layer_types=["linear_attention", "linear_attention", "full_attention",
                                              "linear_attention"])
    if arch == "qwen3_next":
        # MoE on every layer but layer 2 (dense MLP), a shared expert with its gate,
        # unnormalised top-k weights
        return Qwen3NextConfig(**{**common, **deltanet}, num_hidden_layers=4,
                               layer_types=["linear_attention", "full_attention", "linear_attention",
                                            "full_attention"],
                               num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                               shared_expert_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[2],
                               norm_topk_prob=False)
    if arch == "nemotron_h":
        # mamba / attention (no rope) / mamba / relu^2 MLP / attention / mamba
        return NemotronHConfig(**common, hybrid_override_pattern="M*M-*M", num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, mamba_num_heads=8, mamba_head_dim=16,
                               ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16, intermediate_size=128,
                               max_position_embeddings=1024)
    if arch == "bamba":
        # partial rotary attention at layer 1, gated MLP after every mixer
        return BambaConfig(**common, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                           attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
                           mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=16, intermediate_size=128,
                           max_position_embeddings=1024)
    if arch == "mamba2":
        return Mamba2Config(**common, num_hidden_layers=3, num_heads=8, head_dim=16, state_size=16, n_groups=2,
                            conv_kernel=4, chunk_size=16, expand=2)
    raise ValueError(arch)


def tiny_moe_config(arch: str):
    """Tiny mixture-of-experts configs (``tests/models/test_moe_families.py``): 8 experts, top 2,
    expert rows whole 16-row tiles so a GGUF's stacks stay in their blocks."""
    from transformers import GptOssConfig, GraniteMoeHybridConfig, NemotronHConfig, Qwen3MoeConfig

    common = dict(vocab_size=4096, hidden_size=64, eos_token_id=2, bos_token_id=0, pad_token_id=0,
                  initializer_range=0.2, max_position_embeddings=1024, num_attention_heads=4, num_key_value_heads=2,
                  tie_word_embeddings=False)
    if arch == "qwen3_moe":
        # QK-norm, head_dim unlike hidden / heads, experts on every layer, renormalised top-k
        return Qwen3MoeConfig(**common, head_dim=32, num_hidden_layers=3, intermediate_size=96,
                              moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    if arch in ("granite_moe_hybrid", "granite_hybrid_dense"):
        # Granite 4.0-H: Mamba2 and NoPE attention layers, experts plus a shared MLP (or the shared
        # MLP alone), Granite's four multipliers away from 1, tied embeddings (as the real ones)
        return GraniteMoeHybridConfig(
            **{**common, "tie_word_embeddings": True}, num_hidden_layers=4, intermediate_size=32,
            shared_intermediate_size=48, num_local_experts=8 if arch == "granite_moe_hybrid" else 0,
            num_experts_per_tok=2, layer_types=["mamba", "attention", "mamba", "attention"], mamba_n_heads=8,
            mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
            position_embedding_type="nope", embedding_multiplier=2.0, residual_multiplier=0.7,
            attention_multiplier=0.2, logits_scaling=2.0)
    if arch == "nemotron_h_moe":
        # Nemotron 3: Mamba2, NoPE attention and MoE layers (sigmoid routing with a correction bias,
        # ungated ReLU^2 experts in a latent width, a shared expert), top-k weights scaled
        return NemotronHConfig(
            **common, num_hidden_layers=4, layers_block_type=["mamba", "moe", "attention", "moe"], head_dim=16,
            mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=16,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=48, moe_latent_size=32, n_group=1, topk_group=1,
            norm_topk_prob=True, routed_scaling_factor=2.5, intermediate_size=64)
    if arch == "gpt_oss":
        # sliding (a window of 16, which test prompts cross) and full layers alternating, attention
        # sinks, biases on q/k/v/o, the router and the experts, YaRN RoPE, clamped SwiGLU
        return GptOssConfig(**common, num_hidden_layers=4, head_dim=16, intermediate_size=32, num_local_experts=8,
                            num_experts_per_tok=2, sliding_window=16, swiglu_limit=3.0,
                            layer_types=["sliding_attention", "full_attention"] * 2)
    if arch.startswith("deepseek"):
        return tiny_deepseek_config(arch, common)
    raise ValueError(arch)


def tiny_deepseek_config(arch: str, common: dict):
    """DeepSeek's MLA (a 32-wide latent plus 16 rotary dims; value heads of another width than
    the keys' nope part, both whole Q8_0 blocks and 16-row tiles, so a file's W_UK and W_UV stay
    blocks) and MoE with a shared expert after one dense layer. ``deepseek_v2_lite``:
    q from one projection, greedy top-k, YaRN with both mscales (V2-Lite's); ``deepseek_v2``: q
    through its low-rank bottleneck, group-limited routing; ``deepseek_v3``: sigmoid group routing
    with a correction bias, renormalised and scaled."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    mla = dict(kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=48, num_hidden_layers=3,
               first_k_dense_replace=1, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
               num_experts_per_tok=2, n_shared_experts=1)
    common = {**common, "num_key_value_heads": common["num_attention_heads"]}
    if arch == "deepseek_v2_lite":
        yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "mscale": 0.707,
                "mscale_all_dim": 0.707, "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 10000.0}
        return DeepseekV2Config(**common, **mla, q_lora_rank=None, topk_method="greedy", rope_parameters=yarn)
    if arch == "deepseek_v2":
        return DeepseekV2Config(**common, **mla, q_lora_rank=48, topk_method="group_limited_greedy", n_group=4,
                                topk_group=2, routed_scaling_factor=2.0)
    return DeepseekV3Config(**common, **mla, q_lora_rank=48, n_group=4, topk_group=2, norm_topk_prob=True,
                            routed_scaling_factor=2.5)


def hub_layer_types(checkpoint: Path) -> None:
    """A Granite 4.0-H checkpoint's ``layer_types`` as the hub's configs write them ("mamba",
    "attention"; transformers 5 saves its own names), which llama.cpp's converter reads from
    config.json to find the attention layers."""
    path = checkpoint / "config.json"
    config = json.loads(path.read_text())
    names = {"linear_attention": "mamba", "full_attention": "attention"}
    config["layer_types"] = [names.get(kind, kind) for kind in config["layer_types"]]
    path.write_text(json.dumps(config, indent=2))


def build_tiny_model(arch: str, out: Path, seed: int = 0):
    """Write a tiny HF checkpoint (float32) with the project's tokenizer; returns the HF model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = _tiny_hybrid_config(arch) if arch in HYBRID_ARCHS else _tiny_config(arch)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if arch in DELTANET_ARCHS:
        vary_deltanet_weights(model)
    elif arch in HYBRID_ARCHS:
        with torch.no_grad():  # HF leaves these at 1; vary them so a wrong index shows
            for name, p in model.named_parameters():
                if name.endswith(("dt_bias", ".D")) or "mixer.norm" in name or "mamba.norm" in name:
                    p.uniform_(0.5, 1.5)
    if arch == "gemma3":
        with torch.no_grad():  # HF leaves Gemma norms at 0 (a scale of 1); vary them
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0, 0.3)
    if getattr(model.config, "attention_bias", False) or arch == "qwen2":
        with torch.no_grad():  # make biases non-zero so they matter
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.2)
    save_tiny_checkpoint(model, out)
    return model


def vary_deltanet_weights(model) -> None:
    """HF leaves dt_bias and the DeltaNet's gated norm at 1, its 1+w norms and the
    attention biases at 0: vary them so a wrong index shows (a vision tower is left alone)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                continue
            if name.endswith("dt_bias") or "linear_attn.norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("norm.weight"):
                p.normal_(0, 0.3)
            elif name.endswith("bias"):
                p.normal_(0, 0.2)


def save_tiny_checkpoint(model, out: Path) -> None:
    """The HF model's checkpoint with the project's tokenizer and a chat template."""
    model.save_pretrained(out)
    shutil.copy(ASSETS / "tokenizer.json", out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None,
        "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    }))


def save_mxfp4_checkpoint(model, out: Path) -> None:
    """A gpt-oss model's checkpoint as the hub has it: every expert stack MXFP4 (``<name>_blocks``
    [E, rows, cols / 32, 16], ``<name>_scales`` [E, rows, cols / 32], rows-first, quantized by
    gguf-py's own MXFP4 quantizer) and ``quantization_config`` saying so. The model's float
    stacks become the MXFP4 values, so transformers' model is the reference for the file."""
    import gguf
    from safetensors.torch import load_file, save_file

    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    hub: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                continue
            rows_first = param.detach().transpose(1, 2).contiguous()  # [E, rows, cols]
            experts, rows, cols = rows_first.shape
            blocks = gguf.quants.quantize(rows_first.reshape(-1, cols).numpy(), mxfp4)
            values = torch.from_numpy(gguf.quants.dequantize(blocks, mxfp4)).reshape(rows_first.shape)
            param.copy_(values.transpose(1, 2))
            ggml = torch.from_numpy(blocks).view(experts, rows, cols // 32, 17)
            codes = torch.cat([ggml[..., 1:] & 0xF, ggml[..., 1:] >> 4], dim=-1)  # elements 0-31 in order
            hub[name + "_blocks"] = codes[..., 0::2] | (codes[..., 1::2] << 4)  # the hub's: 2j low, 2j + 1 high
            hub[name + "_scales"] = ggml[..., 0].contiguous()
    save_tiny_checkpoint(model, out)
    weights = load_file(out / "model.safetensors")
    weights = {k: v for k, v in weights.items() if k + "_blocks" not in hub} | hub
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config, indent=2))


# Tiny test prompts share only a few blocks. With these engine arguments decodes take
# the cascade path whenever they share any block, and read private runs of two or more
# blocks in place. Engines run the production thresholds unless a test passes these;
# ``tests/engine/test_cascade.py`` checks the path against the plain gathered one, and takes it with
# the production thresholds on long prompts.
TINY_CASCADE = {"cascade_min_saved_tokens": 0, "cascade_min_solo_run_tokens": 2, "cascade_min_traffic_ratio": 0.0}


def random_varied_model(config):
    """A float32 transformers model of ``config`` (seed 0) whose norms are varied off 1, so a
    misplaced or missing norm changes the tokens."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model
