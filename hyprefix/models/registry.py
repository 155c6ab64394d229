"""HF architecture name -> model class."""

from __future__ import annotations

from hyprefix.models.hybrid import HybridForCausalLM
from hyprefix.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "NemotronHForCausalLM": HybridForCausalLM,
    "BambaForCausalLM": HybridForCausalLM,
    "Mamba2ForCausalLM": HybridForCausalLM,
}


def model_class(hf_config) -> type:
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_CLASSES:
            return MODEL_CLASSES[arch]
    raise ValueError(
        f"unsupported architecture {archs or '(none given)'}; supported: {sorted(MODEL_CLASSES)}")
