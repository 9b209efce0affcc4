"""Randomly initialised tiny Hugging Face models of each supported family, saved as checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def save_random_hf_model(cfg_cls: Any, model_cls: Any, config: dict, path: str | Path) -> torch.nn.Module:
    """Builds `model_cls(cfg_cls(**config))` with seed 0, saves it (safetensors) to `path`, returns it.

    HF initialises biases to 0 and norms to 1; they are perturbed so that loading them is tested.
    """
    torch.manual_seed(0)
    hf = model_cls(cfg_cls(**config, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "norm" in name:
                p.normal_(1.0, 0.1)
    hf.save_pretrained(path)
    return hf


def save_tiny_family_model(family: str, path: str | Path, dtype: torch.dtype, **overrides: Any) -> torch.nn.Module:
    """A 2-layer model of `family` (llama, mistral, qwen2, qwen3) with HF's own random init (seed 0),
    vocabulary 512, GQA 4/2, saved to `path` in `dtype`; returns it (on the CPU)."""
    import transformers

    config_cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[family]
    config: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    if family in ("llama", "qwen3"):
        config["head_dim"] = 32
    config.update(overrides)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config_cls(**config)).to(dtype)
    hf.save_pretrained(path)
    return hf
