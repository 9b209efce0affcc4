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
