"""HF ``architectures`` name -> our model class."""
from __future__ import annotations

from torch import nn

from common.models.arch import ModelLoadError
from common.models.lfm2 import Lfm2ForCausalLM
from common.models.llama import LlamaFamilyForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaFamilyForCausalLM,
    "Qwen2ForCausalLM": LlamaFamilyForCausalLM,
    "Qwen3ForCausalLM": LlamaFamilyForCausalLM,
    "Lfm2ForCausalLM": Lfm2ForCausalLM,
}


def model_class(architecture: str) -> type[nn.Module]:
    cls = MODEL_REGISTRY.get(architecture)
    if cls is None:
        raise ModelLoadError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    return cls
