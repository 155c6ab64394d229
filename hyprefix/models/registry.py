"""HF architecture name -> model class."""

from __future__ import annotations

from hyprefix.models.gemma3 import Gemma3ForCausalLM
from hyprefix.models.hybrid import HybridForCausalLM
from hyprefix.models.llama import LlamaForCausalLM
from hyprefix.models.qwen3_next import Qwen3NextForCausalLM

MODEL_CLASSES: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,  # the language model; images are not supported
    "NemotronHForCausalLM": HybridForCausalLM,
    "BambaForCausalLM": HybridForCausalLM,
    "Mamba2ForCausalLM": HybridForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3NextForCausalLM,  # the language model; images are not supported
    "Qwen3_5MoeForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": Qwen3NextForCausalLM,  # likewise
}


def model_class(hf_config) -> type:
    """The class for the config's ``architectures``; a config without them (one read
    from a GGUF file) goes by its ``model_type``, as transformers' auto classes do."""
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(hf_config, "model_type", None) or "")
        archs = [name] if name else []
    for arch in archs:
        if arch in MODEL_CLASSES:
            return MODEL_CLASSES[arch]
    raise ValueError(
        f"unsupported architecture {archs or '(none given)'}; supported: {sorted(MODEL_CLASSES)}")
