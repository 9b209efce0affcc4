"""A tiny random Llama beside the bundled tokenizer, for host-overhead measurements on a CPU: its forward pass
costs little, so what a run spends is the engine's and the server's own work (not a benchmark itself)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "models" / "stdlib-coder-target"


def write_tiny_model(directory: Path, hidden_size: int = 32, seed: int = 0) -> Path:
    """One layer of width `hidden_size` with the bundled model's vocabulary and tokenizer, random weights."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = json.loads((BUNDLED / "config.json").read_text())
    head_dim = 16
    config |= {
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": 1,
        "num_attention_heads": hidden_size // head_dim,
        "num_key_value_heads": 1,
        "head_dim": head_dim,
        "dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(BUNDLED / name, directory / name)
    generator = torch.Generator().manual_seed(seed)
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config["num_key_value_heads"] * head_dim
    shapes = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden_size),
        "model.norm.weight": (hidden_size,),
        "model.layers.0.input_layernorm.weight": (hidden_size,),
        "model.layers.0.post_attention_layernorm.weight": (hidden_size,),
        "model.layers.0.self_attn.q_proj.weight": (q_size, hidden_size),
        "model.layers.0.self_attn.k_proj.weight": (kv_size, hidden_size),
        "model.layers.0.self_attn.v_proj.weight": (kv_size, hidden_size),
        "model.layers.0.self_attn.o_proj.weight": (hidden_size, q_size),
        "model.layers.0.mlp.gate_proj.weight": (2 * hidden_size, hidden_size),
        "model.layers.0.mlp.up_proj.weight": (2 * hidden_size, hidden_size),
        "model.layers.0.mlp.down_proj.weight": (hidden_size, 2 * hidden_size),
    }
    tensors = {
        name: (torch.ones(shape) if name.endswith("norm.weight") else 0.5 * torch.randn(shape, generator=generator))
        for name, shape in shapes.items()
    }
    save_file(tensors, str(directory / "model.safetensors"))
    return directory
