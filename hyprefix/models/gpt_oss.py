"""gpt-oss (``GptOssForCausalLM``: gpt-oss-20b, gpt-oss-120b): Llama's layout with

- attention: q/k/v/o biases, a learned sink logit per head (``Attention.sinks``, applied once to
  each row's whole softmax by ``paged_attention``), sliding-window (128) and full layers
  alternating by ``layer_types`` (the window layers in the window pool), YaRN RoPE;
- every MLP a sparse MoE block (``moe.SparseMoE``): a router with a bias, top-k of the logits and
  a softmax over them, experts with a bias on each projection and the clamped SwiGLU
  (``fused_moe.ExpertActivation("swiglu_oai")``).

transformers keeps the experts as [E, hidden, 2I] with gate and up columns interleaved and
[E, I, hidden]; ``converted`` turns them into the experts op's stacks (gate rows, then up rows, per
expert). The hub's MXFP4 checkpoints (``mxfp4_checkpoint``) and GGUF files (``gguf_hybrid``) give
them rows-first (``experts.gate_up_proj.weight`` [E, 2I, hidden], rows interleaved;
``experts.down_proj.weight`` [E, hidden, I]), so MXFP4 blocks stay MX4 tiles
(``quant_moe``). Other quantization methods are refused at load.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from hyprefix.models.base import Target
from hyprefix.models.fused_moe import ExpertActivation
from hyprefix.models.llama import DecoderLayer, LlamaForCausalLM
from hyprefix.models.moe import Routing, SparseMoE
from hyprefix.models.mxfp4_checkpoint import is_mxfp4


def _gate_then_up(t: torch.Tensor) -> torch.Tensor:
    """Interleaved gate / up entries along dim 1 ([E, 2I, ...]: gate, up, gate, ...) as every gate
    entry, then every up one (the experts op's order)."""
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)


class GptOssDecoderLayer(DecoderLayer):
    def __init__(self, cfg, layer_idx: int, dtype: torch.dtype, device: torch.device, **attn_kw) -> None:
        super().__init__(cfg, layer_idx, dtype, device, **{**attn_kw, "sinks": True})

    def build_mlp(self, cfg, layer_idx: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
        routing = Routing(cfg.num_experts_per_tok, softmax_after_topk=True)
        activation = ExpertActivation("swiglu_oai", float(cfg.swiglu_alpha), float(cfg.swiglu_limit))
        return SparseMoE(cfg.hidden_size, cfg.num_local_experts, cfg.intermediate_size, routing, None, False, dtype,
                         device, activation=activation, biases=True)


class GptOssForCausalLM(LlamaForCausalLM):
    """GptOssForCausalLM from float or MXFP4 checkpoints and GGUF files (module docstring)."""

    layer_class = GptOssDecoderLayer

    def __init__(self, hf_config, dtype: torch.dtype, device: torch.device, max_positions: int) -> None:
        quant = getattr(hf_config, "quantization_config", None)
        if quant and not is_mxfp4(hf_config):
            method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
            raise ValueError(f"gpt-oss checkpoint quantized with {method!r}: only MXFP4 experts (the hub's) or "
                             "float checkpoints load")
        super().__init__(hf_config, dtype, device, max_positions)

    def converted(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in weights:
            if name.endswith("mlp.experts.gate_up_proj"):  # [E, H, 2I], gate / up columns interleaved
                yield name, _gate_then_up(t.transpose(1, 2)).reshape(-1, t.shape[1])
            elif name.endswith("mlp.experts.gate_up_proj.weight"):  # rows-first: [E, 2I, H], rows interleaved
                yield name, _gate_then_up(t).reshape(-1, t.shape[2])
            elif name.endswith("mlp.experts.gate_up_proj_bias"):  # [E, 2I], interleaved
                yield name, _gate_then_up(t)
            elif name.endswith("mlp.experts.down_proj"):  # [E, I, H]
                yield name, t.transpose(1, 2).reshape(-1, t.shape[1])
            elif name.endswith("mlp.experts.down_proj.weight"):  # rows-first: [E, H, I]
                yield name, t.reshape(-1, t.shape[2])
            else:
                yield name, t

    def map_layer(self, idx: int, rest: str) -> Target:
        prefix = f"layers.{idx}"
        if rest == "self_attn.sinks":
            return f"{prefix}.attn.sinks", None, None
        if rest.startswith("mlp.router."):
            return f"{prefix}.mlp.router.{rest.rsplit('.', 1)[1]}", None, None
        if rest.startswith("mlp.experts."):
            leaf = rest.split(".", 2)[2]
            stack = "gate_up" if leaf.startswith("gate_up_proj") else "down"
            return f"{prefix}.mlp.experts_{stack}.{'bias' if leaf.endswith('_bias') else 'weight'}", None, None
        return super().map_layer(idx, rest)
