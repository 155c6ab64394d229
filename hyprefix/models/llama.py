"""Llama-family decoder (Llama, Qwen2, Qwen3, Mistral) over a paged KV cache."""

from __future__ import annotations

import torch
from torch import nn

from hyprefix.forward import ForwardBatch
from hyprefix.kernels import decode_layers
from hyprefix.models.attention import paged_attention
from hyprefix.models.base import CausalLM, KVLayout, Target, last_layer_rows
from hyprefix.models.fused import Kernels
from hyprefix.models.layers import ACTIVATIONS, GatedMLP, Linear, RMSNorm, RopeTables
from hyprefix.models.moe import SparseMoE
from hyprefix.models.quant import Int8Tiles, QuantTiles
from hyprefix.models.weights import MatrixForms


class Attention(nn.Module):
    """``output_gate`` (Qwen3.5, Qwen3-Next): the output is multiplied by sigmoid of a
    per-channel gate that ``qkv`` computes after v ([q | k | v | gate]). ``sinks`` (gpt-oss): a
    learned logit per head in every softmax's denominator (``paged_attention``)."""

    def __init__(self, cfg, layer_idx: int, dtype: torch.dtype, device: torch.device,
                 qk_norm: bool, qkv_bias: bool, o_bias: bool, output_gate: bool = False, sinks: bool = False) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.window = _layer_window(cfg, layer_idx)
        self.output_gate = output_gate
        self.qkv = Linear(cfg.hidden_size, self.q_size * (2 if output_gate else 1) + 2 * self.kv_size,
                          bias=qkv_bias, dtype=dtype, device=device)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=o_bias, dtype=dtype, device=device)
        # QK-norm (Qwen3): one weight row per q head then per k head, filled at load.
        self.qk_norm_eps = getattr(cfg, "rms_norm_eps", 1e-6)
        self.qk_norm_weight = nn.Parameter(torch.ones(
            self.num_heads + self.num_kv_heads, self.head_dim, dtype=dtype, device=device)) if qk_norm else None
        self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32, device=device)) if sinks else None

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: RopeTables | None,
                kv_cache: tuple[torch.Tensor, torch.Tensor], kernels: Kernels,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """``rope`` None: no positional encoding (NemotronH attention layers). ``rows``: the output
        of those rows only (every row's K/V is written)."""
        t = x.shape[0]
        qkv = self.qkv(x)
        # q and k are adjacent columns of qkv: normalise and rotate them in one pass.
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        kv_end = self.q_size + 2 * self.kv_size
        v = qkv[:, self.q_size + self.kv_size: kv_end].view(t, self.num_kv_heads, self.head_dim)
        if rope is not None:
            qk = kernels.qk_norm_rope(qk, self.qk_norm_weight, rope.cos, rope.sin, self.qk_norm_eps, rope.rotary_dim)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], batch, self.scale, self.window,
                              self.sinks).reshape(t, -1)
        if rows is not None:
            out, qkv = out[rows], qkv[rows]
        if self.output_gate:
            out = out * torch.sigmoid(qkv[:, kv_end:])
        return self.o_proj(out)


def _layer_window(cfg, layer_idx: int) -> int | None:
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    if getattr(cfg, "use_sliding_window", True) is False:
        return None
    return window


class DecoderLayer(nn.Module):
    """Pre-norm attention, then a gated MLP. A family that varies it (``layer_class``) says how
    through the two attributes below, which ``DecodeModel`` reads too."""

    uses_rope = True  # False: a NoPE layer (SmolLM3), attention without rotary embeddings
    residual_multiplier = 1.0  # each block's output times this before the residual add (Granite)

    def __init__(self, cfg, layer_idx: int, dtype: torch.dtype, device: torch.device, **attn_kw) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.attn = Attention(cfg, layer_idx, dtype, device, **attn_kw)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = self.build_mlp(cfg, layer_idx, dtype, device)

    def build_mlp(self, cfg, layer_idx: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
        """The layer's MLP: a gated MLP here; a family with sparse layers (Qwen3-MoE) builds its own."""
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "mlp_bias", False), dtype, device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, rope: RopeTables,
                kv_cache: tuple[torch.Tensor, torch.Tensor], kernels: Kernels,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, residual stream); their sum is the hidden state. ``rows``:
        only those rows past attention (``last_layer_rows``)."""
        h, residual = self.input_norm.add_forward(x, residual, kernels)
        h = self.attn(h, batch, rope if self.uses_rope else None, kv_cache, kernels, rows)
        residual = residual if rows is None else residual[rows]
        if self.residual_multiplier != 1.0:
            h = h * self.residual_multiplier
        h, residual = self.post_norm.add_forward(h, residual, kernels)
        out = self.mlp(h)
        return (out * self.residual_multiplier if self.residual_multiplier != 1.0 else out), residual

    def fits_decode_kernel(self) -> bool:
        """Whether ``hyprefix::DecodeModel`` can run this layer: float32, int8 or low-bit tiles for
        every matmul, no output gate, a head dim of a multiple of 16, and a SiLU gated MLP or a
        sparse MoE block it runs (``SparseMoE.fits_decode_kernel``)."""
        attn, mlp = self.attn, self.mlp
        matrices = [attn.qkv, attn.o_proj]
        if isinstance(mlp, SparseMoE):
            mlp_fits = mlp.fits_decode_kernel()
        else:
            mlp_fits = isinstance(mlp, GatedMLP) and mlp.act is ACTIVATIONS["silu"][0]
            matrices += [mlp.gate_up, mlp.down] if mlp_fits else []
        return (mlp_fits and self.input_norm.weight.dtype == torch.float32 and not attn.output_gate
                and attn.sinks is None and attn.head_dim % 16 == 0
                and all(isinstance(linear.forms.quantized, Int8Tiles | QuantTiles) for linear in matrices))


class LlamaForCausalLM(CausalLM):
    """Covers LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM.

    Differences are read from the config: QK-norm (Qwen3), q/k/v bias (Qwen2,
    ``attention_bias``), sliding windows (Mistral, ``layer_types``), RoPE scaling,
    tied embeddings.
    """

    # (its caches, hyprefix::DecodeModel, whether it has the LM head): ``_decode_model_for``
    _decode_model: tuple[list, torch.ScriptObject, bool] | None = None
    # The layer each index builds: families with Llama's layout and names but a different
    # layer (SmolLM3's NoPE layers, Granite's residual multiplier) subclass with their own.
    layer_class: type[DecoderLayer] = DecoderLayer
    # The embeddings' scale before the first layer (Granite's ``embedding_multiplier``); 1 where
    # the family has none. (``CausalLM.logits_scaling`` divides the logits.)
    embedding_multiplier = 1.0
    selects_output_rows = True

    def __init__(self, hf_config, dtype: torch.dtype, device: torch.device, max_positions: int) -> None:
        super().__init__()
        cfg = hf_config
        arch = (getattr(cfg, "architectures", None) or [""])[0]
        model_type = getattr(cfg, "model_type", "")
        activation = getattr(cfg, "hidden_act", "silu")
        if activation != "silu":  # every MLP of Llama's layout is gated SiLU (``DecoderLayer.build_mlp``)
            raise ValueError(f"{arch or model_type} config sets hidden_act={activation!r}: only silu is supported")
        qk_norm = model_type.startswith("qwen3") or arch.startswith("Qwen3")
        qwen2 = model_type == "qwen2" or arch.startswith("Qwen2")
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        attn_kw = {"qk_norm": qk_norm, "qkv_bias": qwen2 or attention_bias, "o_bias": attention_bias}
        self.layers = nn.ModuleList(
            self.layer_class(cfg, i, dtype, device, **attn_kw) for i in range(cfg.num_hidden_layers))
        attn = self.layers[0].attn
        self.kv_layout = KVLayout(cfg.num_hidden_layers, attn.num_kv_heads, attn.head_dim,
                                  tuple(layer.attn.window for layer in self.layers))
        self._init_head(cfg, dtype, device, max_positions, cfg.rms_norm_eps, attn.head_dim)

    def use_decode_kernel(self) -> bool:
        norms = [self.norm, *(n for layer in self.layers for n in (layer.input_norm, layer.post_norm))]
        self._decode_model = None  # built again, from the weights as they are now, on the next step
        if (self.layers and all(layer.fits_decode_kernel() for layer in self.layers)
                and len({norm.eps for norm in norms}) == 1 and len({layer.attn.scale for layer in self.layers}) == 1
                and decode_layers.available()):
            self.decode_kernel = True
        return self.decode_kernel

    def takes_decode_kernel(self, batch: ForwardBatch) -> bool:
        return self.decode_kernel and batch.reads_tables_whole()

    def weights_changed(self) -> None:
        super().weights_changed()
        self._decode_model = None  # it may hold copies of the old weights: built again on the next step

    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                states=None) -> torch.Tensor:
        if self.takes_decode_kernel(batch) and not torch.compiler.is_compiling():
            return torch.ops.hyprefix.decode_model_hidden(self._decode_model_for(kv_caches)[0], *_step_inputs(batch))
        x, residual = self.embed(batch.input_ids), None
        if self.embedding_multiplier != 1.0:
            x = x * self.embedding_multiplier
        rope = self.rotary.tables(batch.positions)
        for layer, kv, rows in zip(self.layers, kv_caches, last_layer_rows(batch, len(self.layers)), strict=True):
            x, residual = layer(x, residual, batch, rope, kv, self.kernels, rows)
        return x + residual

    def decode_logits(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.takes_decode_kernel(batch):
            return None
        model, with_head = self._decode_model_for(kv_caches)
        return torch.ops.hyprefix.decode_model_logits(model, *_step_inputs(batch)) if with_head else None

    def _decode_model_for(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                          ) -> tuple[torch.ScriptObject, bool]:
        """The kernel's model over these caches and whether it has the LM head: built on the first
        step that reads them (a different list of caches builds it again), after ``use_decode_kernel``."""
        if self._decode_model is None or self._decode_model[0] is not kv_caches:
            self._decode_model = (kv_caches, *_build_decode_model(self, kv_caches))
        return self._decode_model[1:]

    def map_layer(self, idx: int, rest: str) -> Target:
        return map_attention_or_mlp(f"layers.{idx}", rest, self.layers[0].attn, self.config.intermediate_size)


def _step_inputs(batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
    return (batch.input_ids, batch.positions, batch.slot_mapping, batch.decode_block_tables,
            batch.decode_context_lens)


def map_attention_or_mlp(prefix: str, rest: str, attn: Attention | None, intermediate: int,
                         attn_module: str = "attn", mlp_module: str = "mlp") -> Target:
    """HF names of a Llama-style layer (self_attn.*, mlp.*, norms) -> our fused parameters."""
    module, leaf = rest.rsplit(".", 1)
    qkv_sizes = [attn.q_size, attn.kv_size, attn.kv_size] if attn is not None else []
    fused = {
        "self_attn.q_proj": (f"{attn_module}.qkv", 0, qkv_sizes),
        "self_attn.k_proj": (f"{attn_module}.qkv", 1, qkv_sizes),
        "self_attn.v_proj": (f"{attn_module}.qkv", 2, qkv_sizes),
        "mlp.gate_proj": (f"{mlp_module}.gate_up", 0, [intermediate] * 2),
        "mlp.up_proj": (f"{mlp_module}.gate_up", 1, [intermediate] * 2),
    }
    if module in fused:
        target, shard, sizes = fused[module]
        return f"{prefix}.{target}.{leaf}", shard, sizes
    if module in ("self_attn.q_norm", "self_attn.k_norm") and attn is not None:
        return (f"{prefix}.{attn_module}.qk_norm_weight", int(module == "self_attn.k_norm"),
                [attn.num_heads, attn.num_kv_heads])
    renamed = {
        "self_attn.o_proj": f"{attn_module}.o_proj",
        "mlp.down_proj": f"{mlp_module}.down",
        "input_layernorm": "input_norm",
        "post_attention_layernorm": "post_norm",
    }
    return f"{prefix}.{renamed.get(module, module)}.{leaf}", None, None


def _build_decode_model(model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                        ) -> tuple[torch.ScriptObject, bool]:
    """The ``DecodeModel`` (``kernels/decode_layers``) of a model whose layers fit it
    (``use_decode_kernel``) over these caches, one (K, V) a layer, and whether it has the
    LM head (int8 or low-bit tiles), so ``decode_model_logits`` runs. It holds the weights as they are now."""
    head = _tensors(model.head_forms)
    embed = model.embed
    table = [embed.weight] if embed.weight.numel() else _tensors(embed.forms)  # a GGUF's quantized table
    first = model.layers[0].attn
    out = torch.classes.hyprefix.DecodeModel(
        table, embed.num_embeddings, embed.embedding_dim, model.norm.weight, head, model.rotary.cos, model.rotary.sin,
        first.num_heads, model.norm.eps, first.qk_norm_eps, first.scale, model.embedding_multiplier,
        model.logits_scaling)
    for layer, (k, v) in zip(model.layers, kv_caches, strict=True):
        attn, mlp = layer.attn, layer.mlp
        moe = isinstance(mlp, SparseMoE)  # its block follows the layer (``set_moe``)
        out.add_layer(layer.input_norm.weight, _tensors(attn.qkv.forms), attn.qkv.bias, attn.qk_norm_weight,
                      _tensors(attn.o_proj.forms), attn.o_proj.bias, layer.post_norm.weight,
                      [] if moe else _tensors(mlp.gate_up.forms), None if moe else mlp.gate_up.bias,
                      [] if moe else _tensors(mlp.down.forms), None if moe else mlp.down.bias, k, v,
                      attn.window or 0, layer.uses_rope, layer.residual_multiplier)
        if moe:
            gate_up, down = mlp.experts_gate_up, mlp.experts_down
            out.set_moe(mlp.router.weight, mlp.routing.top_k, mlp.routing.renormalize, gate_up.forms.quant.tensors,
                        gate_up.rows, down.forms.quant.tensors)
    return out, bool(head)


def _tensors(forms: MatrixForms) -> list[torch.Tensor]:
    """A matrix as ``DecodeModel`` takes it: [tiles, scales] (int8 tiles), [data, scales, extra]
    per part (low-bit tiles), or [] (neither: a float head, no logits from the kernel)."""
    quantized = forms.quantized
    if isinstance(quantized, Int8Tiles):
        return [quantized.tiles, quantized.scales]
    return list(quantized.tensors) if isinstance(quantized, QuantTiles) else []
