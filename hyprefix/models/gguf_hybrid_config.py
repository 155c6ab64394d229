"""The transformers config of a hybrid GGUF file (``gguf_hybrid``): the model type, shapes and
layer kinds from the file's metadata and, where the metadata says nothing, from which tensors
the file has.

What a file does not state, and how it is filled: Qwen3-Next's ``norm_topk_prob`` is True
(llama.cpp normalises the top-k weights of ``qwen3next`` unconditionally) unless the file
states ``expert_weights_norm``; dense layers of a Qwen3-Next (``mlp_only_layers``) and biases
are read off the tensors present; NemotronH's layer kinds come from the per-layer KV head
counts and the tensors present; Mamba time-step limits keep transformers' defaults (llama.cpp
clamps nothing either).

``nemotron_h_moe`` (Nemotron 3) holds MoE layers (``moe``: router, correction bias, ungated
expert stacks, a shared expert, optional latent projections); the converter also picks that
architecture for any NemotronH config that mentions ``num_experts_per_tok``, and transformers 5
writes that default into every NemotronH config it saves, so a dense NemotronH re-saved by
transformers 5 converts to ``nemotron_h_moe`` without expert layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

ARCHITECTURES = ("qwen35", "qwen35moe", "qwen3next", "nemotron_h", "nemotron_h_moe", "mamba2", "qwen3moe",
                 "granitehybrid", "gpt-oss", "deepseek2", "kimi-linear")
QWEN_ARCHS = ("qwen35", "qwen35moe", "qwen3next")
LINEAR, FULL, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
_EXPERT_TENSORS = ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight",
                   "ffn_gate_up_exps.weight")
_REQUIRED: Any = object()


class HybridFile:
    """A GGUF file's metadata and tensor table (the reader maps the file; tensor data is only
    read by ``read``). Metadata getters raise ValueError naming the file and the key."""

    def __init__(self, path: Path) -> None:
        import gguf

        self.path, self.arch = path, ""
        try:
            self.reader = gguf.GGUFReader(str(path))  # the module attribute: ``gguf_parsed_once`` caches it
        except (ValueError, OSError) as exc:
            raise ValueError(f"{path.name} is not a readable GGUF file: {exc}") from exc
        self.arch = str(self.value("general.architecture"))
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"GGUF file {path.name}: architecture {self.arch!r} is not one of {ARCHITECTURES}")
        self.tensors = {t.name: t for t in self.reader.tensors}
        # ggml lists dimensions fastest-moving first; torch the other way round
        self.shapes = {name: tuple(int(n) for n in reversed(t.shape.tolist())) for name, t in self.tensors.items()}

    def error(self, problem: str) -> ValueError:
        return ValueError(f"GGUF file {self.path.name}{f' ({self.arch})' if self.arch else ''}: {problem}")

    def value(self, key: str, default: Any = _REQUIRED) -> Any:
        field = self.reader.get_field(key)
        if field is None:
            if default is _REQUIRED:
                raise self.error(f"no {key!r} in its metadata")
            return default
        return field.contents()

    def arch_value(self, key: str, default: Any = _REQUIRED) -> Any:
        """``{arch}.{key}``."""
        return self.value(f"{self.arch}.{key}", default)

    def int_value(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self.arch_value(key, default)
        return value if value is default else int(value)

    def float_value(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self.arch_value(key, default)
        return value if value is default else float(value)

    def per_layer(self, key: str, layers: int) -> list[int]:
        """A count llama.cpp writes either once or once per layer."""
        value = self.arch_value(key)
        values = [int(v) for v in value] if isinstance(value, list) else [int(value)] * layers
        if len(values) < layers:
            raise self.error(f"{self.arch}.{key} has {len(values)} entries for {layers} layers")
        return values[:layers]

    def has(self, name: str) -> bool:
        return name in self.tensors

    def rows(self, name: str) -> int:
        if name not in self.shapes:
            raise self.error(f"no tensor {name!r}")
        return self.shapes[name][0]

    def read(self, name: str) -> torch.Tensor:
        """The tensor's values in float32 (dequantized where quantized), in torch's shape."""
        import gguf

        tensor = self.tensors[name]
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise self.error(f"tensor {name} is stored as {tensor.tensor_type.name}, which the gguf package "
                             f"cannot dequantize ({exc})") from exc
        array = np.asarray(values, dtype=np.float32).reshape(self.shapes[name])
        if not array.flags.writeable:  # the file's own (mapped, read-only) bytes: copy
            array = array.copy()
        return torch.from_numpy(array)


def load_config(path: str | Path):
    """The transformers config of the HF model the file was converted from: the class of that
    model type (Qwen3_5TextConfig, Qwen3_5MoeTextConfig, Qwen3NextConfig, NemotronHConfig,
    Mamba2Config) with ``architectures`` set, so the engine picks its model class as for an HF
    checkpoint. Raises ValueError for a file this module does not load or whose metadata lacks
    what the model needs."""
    file = HybridFile(Path(path))
    if file.arch in QWEN_ARCHS:
        return _qwen_config(file)
    if file.arch == "mamba2":
        return _mamba2_config(file)
    if file.arch == "qwen3moe":
        return _qwen3moe_config(file)
    if file.arch == "granitehybrid":
        return _granite_config(file)
    if file.arch == "gpt-oss":
        return _gpt_oss_config(file)
    if file.arch == "deepseek2":
        return _deepseek_config(file)
    if file.arch == "kimi-linear":
        from hyprefix.models.gguf_kimi import kimi_config  # gguf_kimi imports this module: imported late

        return kimi_config(file, _common(file), _layers(file))
    return _nemotron_config(file)


def _common(file: HybridFile) -> dict[str, Any]:
    """Fields every architecture's config takes the same way."""
    embed = "token_embd.weight"
    if not file.has(embed):
        raise file.error(f"no tensor {embed!r}")
    ids = {name: file.value(f"tokenizer.ggml.{key}", None)
           for name, key in (("eos_token_id", "eos_token_id"), ("bos_token_id", "bos_token_id"),
                             ("pad_token_id", "padding_token_id"))}
    return {
        "vocab_size": file.rows("output.weight") if file.has("output.weight") else file.rows(embed),
        "hidden_size": file.int_value("embedding_length"),
        # llama.cpp's training context; the converter writes 2**20 for models without positions
        "max_position_embeddings": file.int_value("context_length"),
        **{name: int(value) if value is not None else None for name, value in ids.items()},
    }


def _layers(file: HybridFile) -> int:
    """Decoder layers: the file counts a multi-token-prediction block as one more."""
    return file.int_value("block_count") - file.int_value("nextn_predict_layers", 0)


def has_experts(file: HybridFile, layer: int) -> bool:
    return any(file.has(f"blk.{layer}.{name}") for name in _EXPERT_TENSORS)


def _rope_parameters(file: HybridFile, head_dim: int) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": file.float_value("rope.freq_base", 10000.0)}
    rotary = file.int_value("rope.dimension_count", head_dim)
    if rotary != head_dim:  # a width in dimensions, where transformers takes a fraction of the head
        params["partial_rotary_factor"] = rotary / head_dim
    scaling = str(file.arch_value("rope.scaling.type", "none"))
    if scaling == "linear":
        params.update(rope_type="linear", factor=file.float_value("rope.scaling.factor"))
    elif scaling == "yarn":
        params.update(rope_type="yarn", factor=file.float_value("rope.scaling.factor"),
                      original_max_position_embeddings=file.int_value("rope.scaling.original_context_length"))
        for key, name in (("rope.scaling.yarn_attn_factor", "attention_factor"),
                          ("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
            if (value := file.float_value(key, None)) is not None:
                params[name] = value
    elif scaling != "none":
        raise file.error(f"RoPE scaling {scaling!r} is not supported")
    sections = [int(s) for s in file.arch_value("rope.dimension_sections", []) if int(s)]
    if sections:  # Qwen3.5's interleaved multimodal RoPE; with text positions it is plain RoPE
        params.update(mrope_section=sections, mrope_interleaved=True)
    return params


def _qwen_config(file: HybridFile):
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    layers = _layers(file)
    recurrent = file.arch_value("attention.recurrent_layers", None)
    if recurrent is not None:
        if len(recurrent) < layers:
            raise file.error(f"attention.recurrent_layers has {len(recurrent)} entries for {layers} layers")
        layer_types = [LINEAR if r else FULL for r in recurrent[:layers]]
    else:
        interval = file.int_value("full_attention_interval", 4)
        layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]
    if FULL not in layer_types:
        raise file.error("no full-attention layer")
    first_full = layer_types.index(FULL)
    head_dim = file.int_value("attention.key_length")
    value_heads = file.int_value("ssm.time_step_rank")
    fields = _common(file) | {
        "num_hidden_layers": layers,
        "layer_types": layer_types,
        "num_attention_heads": max(file.per_layer("attention.head_count", layers)),
        "num_key_value_heads": max(file.per_layer("attention.head_count_kv", layers)),
        "head_dim": head_dim,
        "rms_norm_eps": file.float_value("attention.layer_norm_rms_epsilon"),
        "rope_parameters": _rope_parameters(file, head_dim),
        "attention_bias": file.has(f"blk.{first_full}.attn_q.bias"),
        "linear_conv_kernel_dim": file.int_value("ssm.conv_kernel"),
        "linear_key_head_dim": file.int_value("ssm.state_size"),
        "linear_num_key_heads": file.int_value("ssm.group_count"),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": file.int_value("ssm.inner_size") // value_heads,
        # llama.cpp writes the output projection only when it is not the embedding
        "tie_word_embeddings": not file.has("output.weight"),
    }
    moe = [i for i in range(layers) if has_experts(file, i)]
    dense = [i for i in range(layers) if i not in moe]
    if file.arch == "qwen35":
        if moe:
            raise file.error(f"layers {moe} have experts, which a dense Qwen3.5 (qwen35) has not")
        return Qwen3_5TextConfig(architectures=["Qwen3_5ForCausalLM"],
                                 intermediate_size=file.int_value("feed_forward_length"), **fields)
    experts = _experts(file) | {
        "shared_expert_intermediate_size": file.int_value("expert_shared_feed_forward_length", 0)}
    if file.arch == "qwen35moe":
        if dense:
            raise file.error(f"layers {dense} have no experts, which every Qwen3.5 MoE (qwen35moe) layer has")
        return Qwen3_5MoeTextConfig(architectures=["Qwen3_5MoeForCausalLM"], **experts, **fields)
    intermediate = file.rows(f"blk.{dense[0]}.ffn_up.weight") if dense else file.int_value("feed_forward_length", None)
    return Qwen3NextConfig(architectures=["Qwen3NextForCausalLM"], **experts, **fields,
                           **({"intermediate_size": intermediate} if intermediate else {}),
                           norm_topk_prob=bool(file.arch_value("expert_weights_norm", True)),
                           decoder_sparse_step=1, mlp_only_layers=dense)


def _experts(file: HybridFile) -> dict[str, Any]:
    """The expert counts and width as Qwen's configs name them."""
    return {
        "num_experts": file.int_value("expert_count"),
        "num_experts_per_tok": file.int_value("expert_used_count"),
        "moe_intermediate_size": file.int_value("expert_feed_forward_length"),
    }


def _qwen3moe_config(file: HybridFile):
    """Qwen3-MoE: every layer attention; the layers without experts are dense (``mlp_only_layers``).
    llama.cpp renormalises the top-k weights of ``qwen3moe`` unconditionally, so a file that does
    not state ``expert_weights_norm`` has ``norm_topk_prob`` True."""
    from transformers import Qwen3MoeConfig

    layers = _layers(file)
    head_dim = file.int_value("attention.key_length")
    dense = [i for i in range(layers) if not has_experts(file, i)]
    intermediate = file.rows(f"blk.{dense[0]}.ffn_up.weight") if dense else file.int_value("feed_forward_length", None)
    return Qwen3MoeConfig(
        architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=layers, head_dim=head_dim,
        num_attention_heads=file.int_value("attention.head_count"),
        num_key_value_heads=file.int_value("attention.head_count_kv"),
        rms_norm_eps=file.float_value("attention.layer_norm_rms_epsilon"),
        rope_parameters=_rope_parameters(file, head_dim), attention_bias=file.has("blk.0.attn_q.bias"),
        tie_word_embeddings=not file.has("output.weight"),
        norm_topk_prob=bool(file.arch_value("expert_weights_norm", True)),
        decoder_sparse_step=1, mlp_only_layers=dense, **({"intermediate_size": intermediate} if intermediate else {}),
        **_experts(file), **_common(file))


def _norm_eps(file: HybridFile) -> float:
    eps = file.float_value("attention.layer_norm_rms_epsilon", None)
    return eps if eps is not None else file.float_value("attention.layer_norm_epsilon")


def _mamba_fields(file: HybridFile, first_mamba: int | None) -> dict[str, Any]:
    """The Mamba2 mixer's shape, named as NemotronHConfig names it."""
    heads = file.int_value("ssm.time_step_rank")
    b = f"blk.{first_mamba}."
    return {
        "mamba_num_heads": heads,
        "mamba_head_dim": file.int_value("ssm.inner_size") // heads,
        "ssm_state_size": file.int_value("ssm.state_size"),
        "n_groups": file.int_value("ssm.group_count"),
        "conv_kernel": file.int_value("ssm.conv_kernel"),
        "use_bias": first_mamba is not None and file.has(b + "ssm_in.bias"),
        "use_conv_bias": first_mamba is not None and file.has(b + "ssm_conv1d.bias"),
        "layer_norm_epsilon": _norm_eps(file),
    }


def _mamba2_config(file: HybridFile):
    from transformers import Mamba2Config

    layers, fields = _layers(file), _common(file)
    mamba = _mamba_fields(file, 0)
    return Mamba2Config(
        architectures=["Mamba2ForCausalLM"], num_hidden_layers=layers, num_heads=mamba["mamba_num_heads"],
        head_dim=mamba["mamba_head_dim"], state_size=mamba["ssm_state_size"], n_groups=mamba["n_groups"],
        conv_kernel=mamba["conv_kernel"], expand=file.int_value("ssm.inner_size") // fields["hidden_size"],
        use_bias=mamba["use_bias"], use_conv_bias=mamba["use_conv_bias"],
        layer_norm_epsilon=mamba["layer_norm_epsilon"], tie_word_embeddings=not file.has("output.weight"), **fields)


def _nemotron_kind(file: HybridFile, layer: int, kv_heads: int) -> str:
    b = f"blk.{layer}."
    if has_experts(file, layer):
        return MOE
    if kv_heads > 0 or file.has(b + "attn_q.weight"):
        return FULL
    if file.has(b + "ssm_in.weight"):
        return LINEAR
    if file.has(b + "ffn_up.weight"):
        return MLP
    raise file.error(f"layer {layer} is none of Mamba2 (ssm_in), attention (attn_q) or MLP (ffn_up)")


def _nemotron_experts(file: HybridFile, layer: int) -> dict[str, Any]:
    """A Nemotron 3 file's MoE fields. The converter writes the expert group count but not how many
    groups are kept: a file that does not say keeps every group (the real models have one)."""
    b = f"blk.{layer}."
    groups = file.int_value("expert_group_count", 1)
    latent = file.rows(b + "ffn_latent_down.weight") if file.has(b + "ffn_latent_down.weight") else None
    return {"n_routed_experts": file.int_value("expert_count"),
            "num_experts_per_tok": file.int_value("expert_used_count"),
            "moe_intermediate_size": file.shapes[b + "ffn_up_exps.weight"][1],
            "moe_shared_expert_intermediate_size": file.rows(b + "ffn_up_shexp.weight"),
            "n_shared_experts": file.int_value("expert_shared_count", 1), "n_group": groups,
            "topk_group": file.int_value("expert_group_used_count", groups),
            "norm_topk_prob": bool(file.arch_value("expert_weights_norm", True)),
            "routed_scaling_factor": file.float_value("expert_weights_scale", 1.0), "moe_latent_size": latent,
            "mlp_bias": file.has(b + "ffn_up_shexp.bias")}


def _nemotron_config(file: HybridFile):
    from transformers import NemotronHConfig

    layers = _layers(file)
    kinds = [_nemotron_kind(file, i, kv) for i, kv in enumerate(file.per_layer("attention.head_count_kv", layers))]
    fields = _common(file)
    first = {kind: kinds.index(kind) if kind in kinds else None for kind in (LINEAR, FULL, MLP, MOE)}
    heads = max(file.per_layer("attention.head_count", layers))
    extra: dict[str, Any] = {}
    if first[MLP] is not None:
        extra.update(intermediate_size=file.rows(f"blk.{first[MLP]}.ffn_up.weight"),
                     mlp_bias=file.has(f"blk.{first[MLP]}.ffn_up.bias"))
    if first[MOE] is not None:
        extra.update(_nemotron_experts(file, first[MOE]))
    mamba = _mamba_fields(file, first[LINEAR])
    return NemotronHConfig(
        architectures=["NemotronHForCausalLM"], layers_block_type=kinds, num_attention_heads=heads,
        num_key_value_heads=max(file.per_layer("attention.head_count_kv", layers)) or heads,
        head_dim=file.int_value("attention.key_length", fields["hidden_size"] // max(heads, 1)),
        attention_bias=first[FULL] is not None and file.has(f"blk.{first[FULL]}.attn_q.bias"),
        mamba_proj_bias=mamba["use_bias"], tie_word_embeddings=False, **mamba, **extra, **fields)


def _granite_config(file: HybridFile):
    """Granite 4.0-H (``GraniteMoeHybridConfig``): layer kinds from the per-layer KV head counts,
    expert and shared-MLP widths from the tensors, Granite's four scales from the metadata (a
    missing one: no scaling, the attention scale ``head_dim ** -0.5``). llama.cpp runs a
    ``granitehybrid`` file with Mamba2 layers without RoPE (``rope.scaling.finetuned`` false); one
    with RoPE is a Bamba, which this loader refuses."""
    from transformers import GraniteMoeHybridConfig

    layers = _layers(file)
    kv = file.per_layer("attention.head_count_kv", layers)
    kinds = [FULL if n > 0 else LINEAR for n in kv]
    if LINEAR in kinds and file.arch_value("rope.scaling.finetuned", False):
        raise file.error("a granitehybrid file with RoPE and Mamba2 layers is a Bamba model: not supported")
    first_mamba = kinds.index(LINEAR) if LINEAR in kinds else None
    mamba = _mamba_fields(file, first_mamba)
    heads = max(file.per_layer("attention.head_count", layers))
    experts = file.int_value("expert_count", 0)
    suffix = "_shexp" if experts else ""
    fields = _common(file)
    head_dim = fields["hidden_size"] // heads
    return GraniteMoeHybridConfig(
        architectures=["GraniteMoeHybridForCausalLM"], num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=max(kv), layer_types=["mamba" if k == LINEAR else "attention" for k in kinds],
        attention_bias=FULL in kinds and file.has(f"blk.{kinds.index(FULL)}.attn_q.bias"),
        position_embedding_type="rope" if LINEAR not in kinds else "nope",
        rope_parameters=_rope_parameters(file, head_dim), rms_norm_eps=mamba["layer_norm_epsilon"],
        num_local_experts=experts, num_experts_per_tok=file.int_value("expert_used_count", 0) or 1,
        # without experts the converter still states the (unused) expert width as feed_forward_length
        intermediate_size=file.shapes["blk.0.ffn_gate_exps.weight"][1] if experts else
        file.int_value("feed_forward_length", 0),
        shared_intermediate_size=file.rows(f"blk.0.ffn_gate{suffix}.weight"),
        mamba_n_heads=mamba["mamba_num_heads"], mamba_d_head=mamba["mamba_head_dim"],
        mamba_n_groups=mamba["n_groups"], mamba_d_state=mamba["ssm_state_size"], mamba_d_conv=mamba["conv_kernel"],
        mamba_expand=file.int_value("ssm.inner_size") // fields["hidden_size"], mamba_proj_bias=mamba["use_bias"],
        mamba_conv_bias=mamba["use_conv_bias"], tie_word_embeddings=not file.has("output.weight"),
        embedding_multiplier=file.float_value("embedding_scale", 0.0) or 1.0,
        residual_multiplier=file.float_value("residual_scale", 0.0) or 1.0,
        attention_multiplier=file.float_value("attention.scale", 0.0) or head_dim ** -0.5,
        logits_scaling=file.float_value("logit_scale", 0.0) or 1.0, **fields)


def _gpt_oss_config(file: HybridFile):
    """gpt-oss: sliding-window layers first and every other one after (llama.cpp's pattern, and
    transformers' default ``layer_types``), the expert width ``expert_feed_forward_length``. The
    converter writes neither the clamped SwiGLU's alpha and limit (llama.cpp fixes them at
    gpt-oss's 1.702 and 7.0, GptOssConfig's defaults; a ``swiglu_clamp_exp`` key, where a file
    has one, gives the limit) nor YaRN's ``truncate``, which is False in every gpt-oss checkpoint."""
    from transformers import GptOssConfig

    layers = _layers(file)
    head_dim = file.int_value("attention.key_length")
    rope = _rope_parameters(file, head_dim)
    if rope["rope_type"] == "yarn":
        rope["truncate"] = False
    limits = {float(v) for v in file.arch_value("swiglu_clamp_exp", [7.0])}
    if len(limits) != 1:
        raise file.error(f"swiglu_clamp_exp differs between layers ({sorted(limits)}), which gpt-oss does not")
    return GptOssConfig(
        swiglu_limit=limits.pop(),
        architectures=["GptOssForCausalLM"], num_hidden_layers=layers, head_dim=head_dim,
        num_attention_heads=file.int_value("attention.head_count"),
        num_key_value_heads=file.int_value("attention.head_count_kv"),
        rms_norm_eps=file.float_value("attention.layer_norm_rms_epsilon"), rope_parameters=rope,
        sliding_window=file.int_value("attention.sliding_window"),
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        attention_bias=file.has("blk.0.attn_q.bias"), tie_word_embeddings=not file.has("output.weight"),
        num_local_experts=file.int_value("expert_count"), num_experts_per_tok=file.int_value("expert_used_count"),
        intermediate_size=file.int_value("expert_feed_forward_length"), **_common(file))


SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (1: softmax, the default)


def _deepseek_config(file: HybridFile):
    """DeepSeek-V2 / V3 (``deepseek2``): the MLA widths from ``kv_lora_rank``, ``key_length_mla``
    (nope + rope), ``value_length_mla`` and ``rope.dimension_count``; sigmoid gating
    (``expert_gating_func``, as the converter writes from V3's ``scoring_func``) makes a V3, else
    a V2 (llama.cpp's default, softmax), group-limited where the file has expert groups. YaRN's
    ``mscale_all_dim`` is ``yarn_log_multiplier`` / 0.1 (the converter's), and ``mscale`` taken
    equal to it, as in DeepSeek's checkpoints (the rotary tables then unscaled)."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    layers = _layers(file)
    rope_dim = file.int_value("rope.dimension_count")
    params = _rope_parameters(file, rope_dim)
    if params["rope_type"] == "yarn" and (log_mul := file.float_value("rope.scaling.yarn_log_multiplier", None)):
        params["mscale_all_dim"] = params["mscale"] = log_mul / 0.1
    sigmoid = file.int_value("expert_gating_func", 1) == SIGMOID_GATING
    groups, kept = file.int_value("expert_group_count", 1), file.int_value("expert_group_used_count", 1)
    biased = [i for i in range(layers) if file.has(f"blk.{i}.exp_probs_b.bias")]
    if biased and not sigmoid:
        raise file.error(f"layers {biased} have a routing correction bias (exp_probs_b) but the gating is softmax")
    heads = file.int_value("attention.head_count")
    fields = _common(file) | dict(
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        rms_norm_eps=file.float_value("attention.layer_norm_rms_epsilon"), rope_parameters=params,
        q_lora_rank=file.int_value("attention.q_lora_rank", None),
        kv_lora_rank=file.int_value("attention.kv_lora_rank"), qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=file.int_value("attention.key_length_mla") - rope_dim,
        v_head_dim=file.int_value("attention.value_length_mla"),
        intermediate_size=file.int_value("feed_forward_length"),
        moe_intermediate_size=file.int_value("expert_feed_forward_length"),
        n_routed_experts=file.int_value("expert_count"), num_experts_per_tok=file.int_value("expert_used_count"),
        n_shared_experts=file.int_value("expert_shared_count", 0),
        first_k_dense_replace=file.int_value("leading_dense_block_count", 0),
        routed_scaling_factor=file.float_value("expert_weights_scale", 1.0),
        norm_topk_prob=bool(file.arch_value("expert_weights_norm", False)), n_group=groups, topk_group=kept,
        tie_word_embeddings=not file.has("output.weight"), attention_bias=False)
    if sigmoid:
        return DeepseekV3Config(architectures=["DeepseekV3ForCausalLM"], **fields)
    return DeepseekV2Config(architectures=["DeepseekV2ForCausalLM"], **fields,
                            topk_method="group_limited_greedy" if groups > 1 else "greedy")
