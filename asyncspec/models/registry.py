"""Architecture name (config.json `architectures[0]`) -> model class."""
from __future__ import annotations

from torch import nn

from asyncspec.errors import ModelLoadError
from asyncspec.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from asyncspec.models.model_config import SUPPORTED_ARCHITECTURES

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
assert set(MODEL_REGISTRY) == set(SUPPORTED_ARCHITECTURES), "registry and ModelConfig disagree"


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class implementing `architecture`; ModelLoadError naming the supported list otherwise."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ModelLoadError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(MODEL_REGISTRY)}"
        ) from None
