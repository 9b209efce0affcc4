"""RoPE against transformers' own rotary embedding (default, linear, llama3), bit for bit."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from asyncspec.errors import ModelLoadError
from asyncspec.layers.norm import RMSNorm
from asyncspec.layers.rotary import RotaryEmbedding, apply_rotary, compute_inv_freq
from asyncspec.models.model_config import ModelConfig

SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
]


def _hf_config(scaling, theta: float, head_dim: int) -> LlamaConfig:
    kw = dict(hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=4096, rope_theta=theta)
    if scaling is not None:
        kw["rope_scaling"] = dict(scaling)
    return LlamaConfig(**kw)


@pytest.mark.parametrize("scaling", SCALINGS, ids=["default", "linear", "llama3"])
@pytest.mark.parametrize("theta,head_dim", [(10000.0, 64), (500000.0, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_hf(scaling, theta, head_dim, dtype) -> None:
    hf_cfg = _hf_config(scaling, theta, head_dim)
    # Go through ModelConfig so the config.json parsing of rope keys is covered too.
    cfg = ModelConfig.from_dict({**hf_cfg.to_dict(), "architectures": ["LlamaForCausalLM"]})
    hf_rope = LlamaRotaryEmbedding(hf_cfg)
    ours = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
    torch.testing.assert_close(
        compute_inv_freq(head_dim, cfg.rope_theta, cfg.rope_scaling), hf_rope.inv_freq, rtol=0, atol=0
    )

    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 7, 63, 64, 65, 500, 1000, 4095, 3])
    q = torch.randn(len(positions), 4, head_dim, generator=gen).to(dtype)
    k = torch.randn(len(positions), 2, head_dim, generator=gen).to(dtype)
    cos_full, sin_full = hf_rope(q, positions[None, :])
    # HF layout: [batch, heads, seq, dim].
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_full, sin_full)
    cos, sin = ours(positions, dtype)
    torch.testing.assert_close(apply_rotary(q, cos, sin), hf_q[0].transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(apply_rotary(k, cos, sin), hf_k[0].transpose(0, 1), rtol=0, atol=0)


def test_unknown_rope_type_is_rejected() -> None:
    with pytest.raises(ModelLoadError, match="yarn"):
        compute_inv_freq(64, 10000.0, {"rope_type": "yarn", "factor": 2.0})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_hf(dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 3, 32, generator=gen) * 3).to(dtype)
    w = torch.randn(32, generator=gen).to(dtype)
    hf, ours = LlamaRMSNorm(32, eps=1e-5).to(dtype), RMSNorm(32, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(w)
        ours.weight.copy_(w)
        torch.testing.assert_close(ours(x), hf(x), rtol=0, atol=0)
