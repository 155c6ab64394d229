"""HF architecture name -> model class."""

from __future__ import annotations

from hyprefix.models import gguf_config, granite, phi3, smollm3
from hyprefix.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from hyprefix.models.gemma3 import Gemma3ForCausalLM
from hyprefix.models.gpt_oss import GptOssForCausalLM
from hyprefix.models.hybrid import HybridForCausalLM
from hyprefix.models.kimi_linear import KimiLinearForCausalLM
from hyprefix.models.lfm2 import Lfm2ForCausalLM
from hyprefix.models.llama import LlamaForCausalLM
from hyprefix.models.qwen3_moe import Qwen3MoeForCausalLM
from hyprefix.models.qwen3_next import Qwen3NextForCausalLM

MODEL_CLASSES: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,  # the language model; images are not supported
    "NemotronHForCausalLM": HybridForCausalLM,
    "BambaForCausalLM": HybridForCausalLM,
    "GraniteMoeHybridForCausalLM": HybridForCausalLM,
    "Mamba2ForCausalLM": HybridForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3NextForCausalLM,  # the language model; images are not supported
    "Qwen3_5MoeForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": Qwen3NextForCausalLM,  # likewise
    "SmolLM3ForCausalLM": smollm3.SmolLM3ForCausalLM,
    "Phi3ForCausalLM": phi3.Phi3ForCausalLM,
    "GraniteForCausalLM": granite.GraniteForCausalLM,
    "Lfm2ForCausalLM": Lfm2ForCausalLM,
    "KimiLinearForCausalLM": KimiLinearForCausalLM,
}

# GGUF architectures (``general.architecture``) whose transformers config hyprefix builds from
# the file's metadata (``gguf_config.load_config``): transformers' reader knows neither smollm3
# nor granite, and reads phi3 without its partial rotary width, LongRoPE factors and sliding window.
GGUF_CONFIGS: dict[str, gguf_config.Builder] = {
    "smollm3": smollm3.config_from_gguf,
    "phi3": phi3.config_from_gguf,
    "granite": granite.config_from_gguf,
}
# Those written by llama.cpp's LlamaModel subclasses, with Llama's q/k row order (``gguf_config.teach_transformers``).
GGUF_LLAMA_ROWS = ("smollm3", "granite")


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
