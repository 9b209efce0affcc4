"""One decoder covering Llama, Mistral, Qwen2 and Qwen3 (flags: qkv bias, per-head q/k norm, sliding window)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from asyncspec.layers.activation import select_silu_and_mul
from asyncspec.layers.attention import Attention
from asyncspec.layers.attention_metadata import AttentionMetadata
from asyncspec.layers.norm import RMSNorm
from asyncspec.layers.rotary import RotaryEmbedding, RotaryInputs, apply_rotary, select_fused_rotary
from asyncspec.models.model_config import ModelConfig


class LlamaAttention(nn.Module):
    """Fused q/k/v projection, optional per-head q/k RMSNorm, RoPE, paged attention, output projection."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.head_dim**-0.5,
            config.sliding_window_for_layer(layer_idx),
        )

    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryInputs,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # Strided views of the fused output: the fused kernel reads them as they are.
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope.cos is None or rope.sin is None:
            # Triton: RoPE and the K/V write in one kernel (q rotated in place), the same numbers as below.
            o = self.attn.forward_rotary(
                q, k, v, rope.positions, rope.cos_cache, rope.sin_cache, kv_cache, attn_metadata
            )
        else:
            q, k = apply_rotary(q, rope.cos, rope.sin), apply_rotary(k, rope.cos, rope.sin)
            o = self.attn(q, k, v, kv_cache, attn_metadata)
        return self.o_proj(o.reshape(T, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU MLP with the gate and up projections fused into one matmul."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

        self._silu_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._silu_and_mul is None:
            self._silu_and_mul = select_silu_and_mul(x.device)
        return self.down_proj(self._silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm MLP block, each with a residual add."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RotaryInputs,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this block's MLP output, the residual stream before it): the next norm adds them, fused."""
        x, residual = self.input_layernorm.forward_residual(h, residual)
        x = self.self_attn(x, rope, kv_cache, attn_metadata)
        x, residual = self.post_attention_layernorm.forward_residual(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    """Embedding, decoder stack and final norm (the `model.` prefix of HF checkpoints)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self._fused_rotary: bool | None = None

    @property
    def decoder_layers(self) -> Iterable[LlamaDecoderLayer]:
        """`layers` with its element type (nn.ModuleList is not generic, so iterating it yields nn.Module)."""
        return cast("Iterable[LlamaDecoderLayer]", self.layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if self._fused_rotary is None:
            self._fused_rotary = select_fused_rotary(h.device)
        rope = self.rotary_emb.step_inputs(positions, h.dtype, fused=self._fused_rotary)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, rope, kv_cache, attn_metadata)
        return self.norm.forward_residual(h, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Decoder-only causal LM; the model runner calls `forward` then `compute_logits` on the rows it samples."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        # Tied models have no lm_head module: the logits reuse the embedding matrix directly.
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in float32."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden_states, weight).float()

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """HF checkpoint tensor name -> the parameter (or slice of a fused parameter) it fills."""
        out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": self.model.embed_tokens.weight}
        for i, layer in enumerate(self.model.decoder_layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            for kind in ("weight", "bias"):
                fused = getattr(attn.qkv_proj, kind)
                if fused is not None:
                    q, k, v = fused.split([attn.q_size, attn.kv_size, attn.kv_size], dim=0)
                    out.update(
                        {
                            f"{p}self_attn.q_proj.{kind}": q,
                            f"{p}self_attn.k_proj.{kind}": k,
                            f"{p}self_attn.v_proj.{kind}": v,
                        }
                    )
                if getattr(attn.o_proj, kind) is not None:
                    out[f"{p}self_attn.o_proj.{kind}"] = getattr(attn.o_proj, kind)
                fused = getattr(mlp.gate_up_proj, kind)
                if fused is not None:
                    gate, up = fused.split(mlp.intermediate_size, dim=0)
                    out.update({f"{p}mlp.gate_proj.{kind}": gate, f"{p}mlp.up_proj.{kind}": up})
                if getattr(mlp.down_proj, kind) is not None:
                    out[f"{p}mlp.down_proj.{kind}"] = getattr(mlp.down_proj, kind)
            if attn.qk_norm:
                out[f"{p}self_attn.q_norm.weight"] = attn.q_norm.weight
                out[f"{p}self_attn.k_norm.weight"] = attn.k_norm.weight
            out[f"{p}input_layernorm.weight"] = layer.input_layernorm.weight
            out[f"{p}post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        out["model.norm.weight"] = self.model.norm.weight
        if self.lm_head is not None:
            out["lm_head.weight"] = self.lm_head.weight
        return out


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with a sliding attention window (from config.sliding_window)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with q/k/v biases (config.attention_bias is always True for Qwen2)."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama with per-head q/k RMSNorm (config.qk_norm)."""
