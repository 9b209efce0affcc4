"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

from asyncspec.errors import ModelLoadError
from asyncspec.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from asyncspec.models.model_config import SUPPORTED_ARCHITECTURES

# Every supported family is the one Llama-style decoder (flags in ModelConfig), so the registry's value type
# is that class: callers get `compute_logits` / `checkpoint_tensors` typed rather than nn.Module's __getattr__.
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
assert set(MODEL_REGISTRY) == set(SUPPORTED_ARCHITECTURES), "registry and ModelConfig disagree"


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The class implementing `architecture`; ModelLoadError naming the supported list otherwise."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ModelLoadError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(MODEL_REGISTRY)}"
        ) from None
