"""Model FLOPs from a Hugging Face ``config.json`` (dense decoder-only transformers).

Prefill of ``L`` prompt tokens, counting multiply-adds as 2 FLOPs:

* ``2 · P · L`` for the linear layers, ``P`` = the non-embedding matmul parameters
  (q/k/v/o projections and the gated MLP of every layer; norm weights are elementwise
  and left out, they are < 0.1 % of ``P``);
* ``2 · V · H`` for the lm_head, applied to the last token only;
* ``4 · layers · L²/2 · heads · head_dim`` for causal attention (QKᵀ and PV, each
  ``2 · L · L · head_dim`` per head, halved by the causal mask).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, model_dir: str | Path) -> ModelShape:
        local = Path(model_dir) / "config.json"
        if local.is_file():
            cfg = json.loads(local.read_text())
        else:  # a hub id
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(str(model_dir)).to_dict()
        cfg = cfg.get("text_config", cfg)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            hidden=hidden,
            layers=int(cfg["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate=int(cfg["intermediate_size"]),
            vocab=int(cfg["vocab_size"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )

    @property
    def layer_matmul_params(self) -> int:
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate  # gate, up, down
        return q + kv + o + mlp

    @property
    def non_embedding_params(self) -> int:
        return self.layers * self.layer_matmul_params

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    def to_dict(self) -> dict:
        return {**asdict(self), "non_embedding_matmul_params": self.non_embedding_params,
                "lm_head_params": self.lm_head_params}


def prefill_flops(shape: ModelShape, prompt_len: int) -> dict[str, float]:
    """FLOPs of one prefill of ``prompt_len`` tokens that samples one token."""
    linear = 2.0 * shape.non_embedding_params * prompt_len
    lm_head = 2.0 * shape.lm_head_params
    attention = 4.0 * shape.layers * (prompt_len**2 / 2) * shape.heads * shape.head_dim
    return {"linear": linear, "lm_head": lm_head, "attention": attention, "total": linear + lm_head + attention}
