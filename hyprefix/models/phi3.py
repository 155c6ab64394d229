"""Phi-3 and Phi-4-mini (``Phi3ForCausalLM``): a Llama layer whose checkpoint fuses q/k/v
(``self_attn.qkv_proj``) and gate/up (``mlp.gate_up_proj``), loaded as they are into our fused
matrices; partial rotary (``partial_rotary_factor``: Phi-4-mini rotates 3/4 of each head);
sliding windows (``sliding_window``, Phi-3-mini); tied embeddings (Phi-4-mini); LongRoPE.

**LongRoPE** (``rope_type: longrope``, per-channel ``short_factor`` and ``long_factor``).
transformers picks the factors by the length of what it computes: the short ones while a
sequence is at most ``original_max_position_embeddings`` long; once it is longer, the long ones
at every position (Phi-3's ``generate`` drops its cache at that point and recomputes the whole
sequence). A paged KV cache keeps K computed earlier, so one set must serve every position.
As vLLM does (``Phi3LongRoPEScaledRotaryEmbedding``), the engine's context limit picks it:

* ``max_model_len`` at most ``original_max_position_embeddings``: the short factors, which is
  what transformers computes for every sequence the engine can hold (exact);
* longer: the long factors at every position, which is what transformers computes for every
  sequence longer than ``original_max_position_embeddings``; shorter sequences then differ from
  transformers (a warning says so at load; pass ``max_model_len`` at most the original length
  to get its short-context numbers).

Both scale cos/sin by transformers' attention factor. Configs on which transformers and vLLM
compute different numbers for long contexts (``long_mscale``, which only vLLM reads, or a
``factor``/``attention_factor`` giving an attention factor other than vLLM's) are refused when
the long factors would run, with a ValueError naming the field. (With the short factors the
numbers are transformers', which reads neither ``short_mscale`` nor ``long_mscale``.)

A GGUF file (llama.cpp's ``phi3``) keeps the factors as the tensors ``rope_factors_long`` and
``rope_factors_short``, the rotary width as ``rope.dimension_count``, and writes
``attention.sliding_window`` 0 for none (Phi-4); ``config_from_gguf`` reads all of them, which
transformers' own GGUF reader does not.
"""

from __future__ import annotations

import logging
import math

import torch

from hyprefix.models.base import Target, rope_tables
from hyprefix.models.gguf_config import GGUFMetadata, llama_like
from hyprefix.models.layers import Rotary
from hyprefix.models.llama import LlamaForCausalLM, map_attention_or_mlp

log = logging.getLogger("hyprefix.models")

# the checkpoint's fused matrices -> ours, whole
_FUSED = {"self_attn.qkv_proj": "attn.qkv", "mlp.gate_up_proj": "mlp.gate_up"}


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-4-mini. Refuses an activation other than SiLU, RoPE types other than default
    and longrope, and LongRoPE settings whose numbers transformers and vLLM disagree on (above)."""

    def __init__(self, hf_config, dtype: torch.dtype, device: torch.device, max_positions: int) -> None:
        if hf_config.hidden_act != "silu":
            raise ValueError(f"Phi-3 config sets hidden_act={hf_config.hidden_act!r}: only silu is supported")
        super().__init__(hf_config, dtype, device, max_positions)
        if _uses_long_factors(hf_config, max_positions):
            original = _original_max(hf_config)
            log.warning("Phi-3 LongRoPE: max_model_len %d is longer than original_max_position_embeddings %d, so "
                        "every position uses the long factors (as vLLM does); transformers uses the short ones for "
                        "sequences up to %d tokens, which therefore differ from it. Pass max_model_len <= %d for the "
                        "short factors.", max_positions, original, original, original)

    def _init_head(self, cfg, dtype: torch.dtype, device: torch.device, max_positions: int, norm_eps: float,
                   rotary_head_dim: int | None, can_tie: bool = True) -> None:
        """The shared head without its rotary tables, then Phi-3's (``phi3_rotary``); ``materialize``
        computes them again on the real device."""
        super()._init_head(cfg, dtype, device, max_positions, norm_eps, None, can_tie)
        self.rotary = phi3_rotary(cfg, max_positions, dtype, device, rotary_head_dim)

    def materialize(self, device: torch.device) -> None:
        super().materialize(device)
        self.rotary = phi3_rotary(self.config, self.max_positions, self.dtype, device, self.layers[0].attn.head_dim)

    def map_layer(self, idx: int, rest: str) -> Target:
        module, leaf = rest.rsplit(".", 1)
        if module in _FUSED:
            return f"layers.{idx}.{_FUSED[module]}.{leaf}", None, None
        return map_attention_or_mlp(f"layers.{idx}", rest, self.layers[0].attn, self.config.intermediate_size)


def _original_max(cfg) -> int:
    original = cfg.rope_parameters.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("Phi-3 config with rope_type longrope lacks original_max_position_embeddings")
    return int(original)


def _uses_long_factors(cfg, max_positions: int) -> bool:
    params = cfg.rope_parameters
    return params.get("rope_type") == "longrope" and max_positions > _original_max(cfg) \
        and list(params["long_factor"]) != list(params["short_factor"])


def phi3_rotary(cfg, max_positions: int, dtype: torch.dtype, device: torch.device, head_dim: int) -> Rotary:
    """Rotary tables for ``max_positions`` positions: transformers' for default RoPE, and for
    LongRoPE those of the factor set the engine's context limit picks (module docstring)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = cfg.rope_parameters
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        return rope_tables(cfg, max_positions, dtype, device, head_dim)
    if rope_type != "longrope":
        raise ValueError(f"Phi-3 config sets rope_parameters.rope_type={rope_type!r}: only default and longrope "
                         "are supported")
    for key in ("short_factor", "long_factor"):
        if not params.get(key):
            raise ValueError(f"Phi-3 config with rope_type longrope lacks rope_parameters.{key}")
    original = _original_max(cfg)
    long = _uses_long_factors(cfg, max_positions)
    # transformers' own computation: seq_len past the original length selects the long factors
    inv_freq, scaling = ROPE_INIT_FUNCTIONS["longrope"](cfg, device=torch.device("cpu"),
                                                        seq_len=original + 1 if long else None)
    if long:
        _check_long_matches_vllm(cfg, scaling)
    return Rotary(inv_freq, scaling, max_positions, dtype, device)


def _check_long_matches_vllm(cfg, attention_factor: float) -> None:
    """Long contexts follow vLLM: refuse settings on which its numbers differ from transformers'."""
    if cfg.rope_parameters.get("long_mscale") is not None:
        raise ValueError("Phi-3 config sets rope_parameters.long_mscale: vLLM scales the long factors' cos/sin by it "
                         "and transformers ignores it, so long contexts cannot match both; not supported")
    scale = cfg.max_position_embeddings / _original_max(cfg)
    vllm = math.sqrt(1 + math.log(scale) / math.log(_original_max(cfg))) if scale > 1 else 1.0
    if not math.isclose(attention_factor, vllm, rel_tol=1e-6):
        raise ValueError(f"Phi-3 config's rope_parameters (factor / attention_factor) give the attention factor "
                         f"{attention_factor}, where vLLM uses {vllm} (from max_position_embeddings / "
                         "original_max_position_embeddings): long contexts cannot match both; not supported")


def config_from_gguf(meta: GGUFMetadata):
    """The ``Phi3Config`` of a ``phi3`` GGUF file: the Llama-style keys, the rotary width as a
    fraction of the head (``rope.dimension_count``), the original context length, the sliding
    window (0: none) and, where the file has ``rope_factors_long``/``rope_factors_short``,
    LongRoPE with those factors (the attention factor transformers derives from the lengths, as
    the converter's ``rope.scaling.attn_factor`` was)."""
    from transformers import Phi3Config

    config = llama_like(meta, partial_rotary=True)
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rope = config["rope_parameters"]
    if rope["rope_type"] != "default":
        raise meta.error(f"phi3.rope.scaling.type {meta.get('rope.scaling.type')!r} is not supported")
    original = meta.get("rope.scaling.original_context_length", config["max_position_embeddings"])
    rope["partial_rotary_factor"] = meta.get("rope.dimension_count", head_dim) / head_dim
    factors = ("rope_factors_long.weight", "rope_factors_short.weight")
    if any(name in meta.tensor_names for name in factors):
        rope.update(rope_type="longrope", original_max_position_embeddings=original,
                    long_factor=meta.tensor(factors[0]), short_factor=meta.tensor(factors[1]))
    return Phi3Config(**config, architectures=["Phi3ForCausalLM"], original_max_position_embeddings=original,
                      sliding_window=meta.get("attention.sliding_window", 0) or None)
