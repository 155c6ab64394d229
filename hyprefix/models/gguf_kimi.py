"""Kimi-Linear GGUF files (``kimi-linear``) as llama.cpp's converter writes them: the
transformers config from the metadata and tensors (``kimi_config``) and the tensors under the hub
checkpoint's names (``kimi_tensors``), for ``gguf_hybrid``'s reader.

The converter's transforms, each undone here: names (``blk.N.*``); KDA layers' q/k/v conv
kernels stored [1, channels, 1, kernel] (``ssm_conv1d_{q,k,v}``), ``A_log`` as ``ssm_a =
-exp(A_log)``, ``dt_bias`` as ``ssm_dt.bias``, the gated output norm as ``ssm_norm``; MLA's
``kv_b_proj`` split into ``attn_k_b`` (transposed) and ``attn_v_b``; experts stacked into
``ffn_{gate,up,down}_exps``.

What a file does not state, and how it is filled: the layer kinds come from the per-layer KV
head counts (0: a KDA layer) and dense or MoE feed-forward parts from the tensors present; the
KDA head count from ``attn_q``'s rows over ``kda.head_dim`` (llama.cpp takes it equal to the
MLA head count); top-k weights are renormalised (llama.cpp does so for this architecture
unconditionally); expert groups come from ``expert_group_count`` / ``expert_group_used_count``,
and a file without a group count routes without groups (llama.cpp applies none here; the hub's
config names the count ``num_expert_group``, which the converter does not read). Only sigmoid
gating is read: a file stating another ``expert_gating_func`` is refused.
"""

from __future__ import annotations

from hyprefix.models.gguf_hybrid_config import SIGMOID_GATING, HybridFile
from hyprefix.models.gguf_transforms import FileTensor, a_log, dense_mlp, embed_and_head, mla_tensors, shared_moe

LINEAR, FULL = "linear_attention", "full_attention"
_EXPERTS = "ffn_gate_inp.weight"


def kimi_config(file: HybridFile, common: dict, layers: int):
    """A ``KimiLinearConfig`` (``architectures`` set) for the file; ``common``: the fields every
    hybrid file gives alike (``gguf_hybrid_config._common``)."""
    from transformers import KimiLinearConfig

    gating = file.int_value("expert_gating_func", SIGMOID_GATING)
    if gating != SIGMOID_GATING:
        raise file.error(f"expert_gating_func {gating}: only sigmoid gating ({SIGMOID_GATING}) is supported")
    kinds = [FULL if n else LINEAR for n in file.per_layer("attention.head_count_kv", layers)]
    if FULL not in kinds:
        raise file.error("no MLA layer (every attention.head_count_kv is 0)")
    head_dim = file.int_value("kda.head_dim")
    kda = [i for i, kind in enumerate(kinds) if kind == LINEAR]
    rope_dim = file.int_value("rope.dimension_count")
    sparse = [file.has(f"blk.{i}.{_EXPERTS}") for i in range(layers)]
    experts = {}
    if any(sparse):
        groups = file.int_value("expert_group_count", 1)
        experts = dict(num_local_experts=file.int_value("expert_count"),
                       num_experts_per_tok=file.int_value("expert_used_count"),
                       moe_intermediate_size=file.int_value("expert_feed_forward_length"),
                       n_shared_experts=file.int_value("expert_shared_count", 0),
                       routed_scaling_factor=file.float_value("expert_weights_scale", 1.0),
                       n_group=groups, topk_group=file.int_value("expert_group_used_count", 1) if groups > 1 else 1)
    return KimiLinearConfig(
        architectures=["KimiLinearForCausalLM"], **common, **experts, num_hidden_layers=layers, layer_types=kinds,
        mlp_layer_types=["sparse" if s else "dense" for s in sparse], norm_topk_prob=True,
        num_attention_heads=file.int_value("attention.head_count"),
        num_key_value_heads=file.int_value("attention.head_count"),
        rms_norm_eps=file.float_value("attention.layer_norm_rms_epsilon"),
        intermediate_size=file.int_value("feed_forward_length"),
        q_lora_rank=file.int_value("attention.q_lora_rank", None),
        kv_lora_rank=file.int_value("attention.kv_lora_rank"),
        qk_rope_head_dim=rope_dim, qk_nope_head_dim=file.int_value("attention.key_length_mla") - rope_dim,
        v_head_dim=file.int_value("attention.value_length_mla"), linear_head_dim=head_dim,
        linear_num_heads=file.rows(f"blk.{kda[0]}.attn_q.weight") // head_dim if kda else 1,
        linear_conv_kernel_dim=file.int_value("ssm.conv_kernel"),
        tie_word_embeddings=not file.has("output.weight"), attention_bias=False, hidden_act="silu")


def _conv(t):
    """``ssm_conv1d_*`` [1, channels, 1, kernel] back to the hub's [channels, 1, kernel]."""
    return t.reshape(t.shape[1], 1, t.shape[-1])


def _kda(p: str, b: str) -> list[FileTensor]:
    """A KDA layer's tensors (``p``: its hub prefix ``model.layers.N.self_attn.``)."""
    plain = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "f_a_proj": "ssm_f_a",
             "f_b_proj": "ssm_f_b", "b_proj": "ssm_beta", "g_a_proj": "ssm_g_a", "g_b_proj": "ssm_g_b",
             "o_norm": "ssm_norm", "o_proj": "attn_output"}
    out = [FileTensor(f"{p}{ours}.weight", (f"{b}{theirs}.weight",)) for ours, theirs in plain.items()]
    out += [FileTensor(f"{p}{x}_conv1d.weight", (f"{b}ssm_conv1d_{x}.weight",), _conv) for x in "qkv"]
    return [*out, FileTensor(p + "A_log", (b + "ssm_a",), a_log), FileTensor(p + "dt_bias", (b + "ssm_dt.bias",))]


def kimi_tensors(file: HybridFile, cfg) -> list[FileTensor]:
    """Every tensor of a ``kimi-linear`` file under the names ``KimiLinearForCausalLM.converted``
    reads (module docstring)."""
    out = embed_and_head(cfg)
    for i, kind in enumerate(cfg.layer_types):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out += [FileTensor(p + "input_layernorm.weight", (b + "attn_norm.weight",)),
                FileTensor(p + "post_attention_layernorm.weight", (b + "ffn_norm.weight",))]
        out += _kda(p + "self_attn.", b) if kind == LINEAR else mla_tensors(file, p + "self_attn.", b)
        out += (shared_moe(p + "mlp.", b, file.has(f"{b}ffn_gate_shexp.weight"), correction_bias=True)
                if file.has(b + _EXPERTS) else dense_mlp(p + "mlp.", b))
    return out
