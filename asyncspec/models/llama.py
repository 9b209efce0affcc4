"""One decoder covering Llama, Mistral, Qwen2 and Qwen3 (flags: qkv bias, per-head q/k norm, sliding window)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from asyncspec.kernels.skinny_linear import FoldedNorm
from asyncspec.layers.activation import select_silu_and_mul
from asyncspec.layers.attention import Attention
from asyncspec.layers.attention_metadata import AttentionMetadata
from asyncspec.layers.linear import DecodeLinear, SkinnyLinear, linear, linear_rotary_kv_write, linear_silu_and_mul
from asyncspec.layers.norm import RMSNorm
from asyncspec.layers.rotary import RotaryEmbedding, RotaryInputs, apply_rotary, select_fused_rotary
from asyncspec.layers.tensor_parallel import TensorParallel
from asyncspec.models.checkpoint import WeightTarget, sliced, whole
from asyncspec.models.model_config import ModelConfig

if TYPE_CHECKING:
    from asyncspec.kernels.streamed_attn_in_gluon import StreamedAttnIn
    from asyncspec.kernels.streamed_mlp_gluon import StreamedMLP


class LlamaAttention(nn.Module):
    """Fused q/k/v projection, optional per-head q/k RMSNorm, RoPE, paged attention, output projection.
    Under tensor parallelism this rank holds its query and KV heads (column-parallel q/k/v) and its
    columns of o_proj (row-parallel, summed across ranks)."""

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp = tp if tp is not None else TensorParallel()
        self.q_head_start, self.num_heads = tp.split(config.num_attention_heads, "num_attention_heads")
        self.kv_head_start, self.num_kv_heads = tp.kv_heads(config.num_key_value_heads)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = DecodeLinear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = DecodeLinear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
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
        if self.fused_rotary(rope):
            # Triton, bf16, a decode-sized x: the projection, RoPE and the K/V write in one kernel.
            q_rot = self.project_rotated(x, rope, kv_cache, attn_metadata)
            if q_rot is not None:
                return self.attend_rotated(q_rot, kv_cache, attn_metadata)
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
        return self.tp.all_reduce(self.o_proj(o.reshape(T, self.q_size)))

    def fused_rotary(self, rope: RotaryInputs) -> bool:
        """Whether the q|k|v projection may take RoPE and the K/V write in its epilogue (`project_rotated`): RoPE
        from the caches (the Triton path) and no q/k norm."""
        return (rope.cos is None or rope.sin is None) and not self.qk_norm

    def scales_folded_norm(self, rope: RotaryInputs) -> bool:
        """Whether `project_rotated` may take a folded norm's x with its row factors (`row_scale=`): the rotary
        epilogue, and the skinny kernel it runs in (it may still refuse a call, e.g. too many rows)."""
        return self.fused_rotary(rope) and self.qkv_proj.skinny_linear is not None

    def project_rotated(
        self,
        x: torch.Tensor,
        rope: RotaryInputs,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
        row_scale: FoldedNorm | None = None,
    ) -> torch.Tensor | None:
        """q rotated [T, H, D] from the q|k|v projection with RoPE and the K/V write in its epilogue (x scaled by a
        folded norm's row factors with `row_scale`), or None where that kernel does not serve x."""
        qkv = self.qkv_proj
        return linear_rotary_kv_write(
            x,
            qkv.weight,
            qkv.bias,
            qkv.skinny_linear,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            positions=rope.positions,
            cos_cache=rope.cos_cache,
            sin_cache=rope.sin_cache,
            kv_cache=kv_cache,
            slot_mapping=attn_metadata.slot_mapping,
            row_scale=row_scale,
        )

    def attend_rotated(
        self, q_rot: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """The block's output from q already rotated [T, H, D], the step's K/V already in the cache."""
        o = self.attn.attend(q_rot, kv_cache, attn_metadata)
        return self.tp.all_reduce(self.o_proj(o.reshape(q_rot.shape[0], self.q_size)))

    def streamable_input(self, rope: RotaryInputs) -> bool:
        """Whether the streamed attention input may stand in for this block's q|k|v projection and RoPE: no q/k
        norm, no bias, no tensor parallelism, and RoPE from the caches (the Triton path)."""
        return (
            rope.cos is None
            and rope.sin is None
            and not self.qk_norm
            and self.qkv_proj.bias is None
            and not self.tp.enabled
        )


class LlamaMLP(nn.Module):
    """SwiGLU MLP with the gate and up projections fused into one matmul; under tensor parallelism
    this rank holds a slice of the intermediate width (column-parallel gate/up, row-parallel down)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp = tp if tp is not None else TensorParallel()
        self.intermediate_start, self.intermediate_size = tp.split(config.intermediate_size, "intermediate_size")
        self.full_intermediate_size = config.intermediate_size
        self.gate_up_proj = DecodeLinear(config.hidden_size, 2 * self.intermediate_size, bias=config.mlp_bias)
        self.down_proj = DecodeLinear(self.intermediate_size, config.hidden_size, bias=config.mlp_bias)

        self._silu_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._silu_and_mul is None:
            self._silu_and_mul = select_silu_and_mul(x.device)
        gate_up = self.gate_up_proj
        act = linear_silu_and_mul(x, gate_up.weight, gate_up.bias, gate_up.skinny_linear, self._silu_and_mul)
        return self.tp.all_reduce(self.down_proj(act))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm MLP block, each with a residual add."""

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, tp)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.streamed_mlp: StreamedMLP | None = None
        """The post-attention norm and MLP as one kernel for the calls it serves (layers/streamed_mlp.py)."""
        self.streamed_attn_in: StreamedAttnIn | None = None
        """The input norm, q|k|v projection, RoPE and KV write as one kernel for the calls it serves
        (layers/streamed_attn_in.py)."""

    def forward(
        self,
        h: torch.Tensor | FoldedNorm,
        residual: torch.Tensor | None,
        rope: RotaryInputs,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
        next_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor | FoldedNorm, torch.Tensor]:
        """(this block's MLP output, the residual stream before it): the next norm adds them, fused.

        Where the norms fold into the projections (`SkinnyLinear.folds`) and `next_norm` (the next layer's input
        norm) is given, the down projection has added them already and weighted the sum for that norm: then a
        `FoldedNorm` and the residual stream after this block. `h` may be such a `FoldedNorm` from the layer before.
        """
        fold = self._fold(h, rope)
        if fold is not None:
            return self._forward_folded(fold, h, residual, rope, kv_cache, attn_metadata, next_norm)
        if isinstance(h, FoldedNorm):
            if residual is None:
                raise ValueError("a FoldedNorm input comes with the residual stream it was added to")
            # The streamed MLP of the layer before folded this norm (a batch-1 step): q|k|v scales its sums.
            q_rot = None
            if self.self_attn.scales_folded_norm(rope):
                q_rot = self.self_attn.project_rotated(h.x_weighted, rope, kv_cache, attn_metadata, row_scale=h)
            if q_rot is not None:
                x = self.self_attn.attend_rotated(q_rot, kv_cache, attn_metadata)
                return self._forward_mlp(x, residual, rope, next_norm)
            # The layer before folded, this call cannot scale: the input norm's output from the fold's, to a
            # rounding; the residual stream already holds the sum.
            x = (h.x_weighted.float() * h.row_factors()[:, None]).to(h.x_weighted.dtype)
            x = self.self_attn(x, rope, kv_cache, attn_metadata)
            return self._forward_mlp(x, residual, rope, next_norm)
        streamed_input = self._streamed_input(h, residual, rope, kv_cache, attn_metadata)
        if streamed_input is not None:
            q_rot, residual = streamed_input
            x = self.self_attn.attend_rotated(q_rot, kv_cache, attn_metadata)
        else:
            x, residual = self.input_layernorm.forward_residual(h, residual)
            x = self.self_attn(x, rope, kv_cache, attn_metadata)
        return self._forward_mlp(x, residual, rope, next_norm)

    def _forward_mlp(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        rope: RotaryInputs | None = None,
        next_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor | FoldedNorm, torch.Tensor]:
        """The post-attention norm (adding the attention's output x to the residual stream) and the MLP. The
        streamed MLP may fold `next_norm` into its down projection (`StreamedMLP.fold_next_norm`) where the next
        layer's q|k|v can scale by it: then a `FoldedNorm` and the residual stream after this block."""
        streamed, norm, mlp = self.streamed_mlp, self.post_attention_layernorm, self.mlp
        gate_up, down = mlp.gate_up_proj.weight, mlp.down_proj.weight
        if streamed is not None and streamed.applies(x, residual, norm.weight, gate_up, down):
            if next_norm is not None and rope is not None and streamed.fold_next_norm and self._next_scales(rope):
                fold_norm = (next_norm.weight, next_norm.eps)
                return streamed(x, residual, norm.weight, norm.eps, gate_up, down, next_norm=fold_norm)
            return streamed(x, residual, norm.weight, norm.eps, gate_up, down)
        x, residual = norm.forward_residual(x, residual)
        return self.mlp(x), residual

    def _next_scales(self, rope: RotaryInputs) -> bool:
        """Whether the next layer (set up as this one: a model's layers are uniform) scales its q|k|v by a folded
        norm: it could not with a q/k norm or without the rotary epilogue's kernel (it would unfold it in torch,
        several kernels for the one saved), and the streamed attention input, where on, takes the norm itself."""
        return not self.self_attn.qk_norm and self.self_attn.scales_folded_norm(rope) and self.streamed_attn_in is None

    def _fold(self, h: torch.Tensor | FoldedNorm, rope: RotaryInputs) -> SkinnyLinear | None:
        """The skinny kernels where this call folds its norms into the projections (`SkinnyLinear.folds`): RoPE
        and the KV write in the q|k|v epilogue (no q/k norm), no tensor parallelism (o and down would add before
        their all-reduce); else None."""
        fold = self.mlp.down_proj.skinny_linear
        x = h.x_weighted if isinstance(h, FoldedNorm) else h
        attn = self.self_attn
        if fold is None or not fold.folds(x) or attn.qk_norm or attn.tp.enabled:
            return None
        if rope.cos is not None or rope.sin is not None or x.dim() != 2 or not fold.takes(x, attn.qkv_proj.weight):
            return None
        others = (attn.o_proj.weight, self.mlp.gate_up_proj.weight, self.mlp.down_proj.weight)
        if not all(fold.weight_fits(x.shape[0], w) for w in others):
            return None
        return fold

    def _forward_folded(
        self,
        fold: SkinnyLinear,
        h: torch.Tensor | FoldedNorm,
        residual: torch.Tensor | None,
        rope: RotaryInputs,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
        next_norm: RMSNorm | None,
    ) -> tuple[torch.Tensor | FoldedNorm, torch.Tensor]:
        """The block with its norms folded into the projections: q|k|v scales its sums by the input norm's row
        factors (or, for the first layer, the norm kernel runs), o adds the residual and weights the sum for the
        post-attention norm, gate|up scales, and down adds and weights for `next_norm` (none: its plain output)."""
        assert fold.add_norm_kernel is not None and fold.gated_kernel is not None  # noqa: S101 - fold.folds said so
        scale: FoldedNorm | None = None
        if isinstance(h, FoldedNorm):
            x, scale = h.x_weighted, h
        else:
            x, residual = self.input_layernorm.forward_residual(h, residual)
        assert residual is not None  # noqa: S101 - a FoldedNorm always comes with its residual stream
        attn, counters = self.self_attn, fold.counters
        q_rot = attn.project_rotated(x, rope, kv_cache, attn_metadata, row_scale=scale)
        if q_rot is None:  # fold.folds and fold.supported said the rotary kernel takes x
            raise RuntimeError("the q|k|v projection's rotary epilogue refused a folded call")
        o = attn.attn.attend(q_rot, kv_cache, attn_metadata).reshape(x.shape[0], attn.q_size)
        norm, mlp = self.post_attention_layernorm, self.mlp
        folded = fold.add_norm_kernel(
            o,
            attn.o_proj.weight,
            attn.o_proj.bias,
            residual=residual,
            norm_weight=norm.weight,
            eps=norm.eps,
            counters=counters,
        )
        gate_up, down = mlp.gate_up_proj, mlp.down_proj
        act = fold.gated_kernel(folded.x_weighted, gate_up.weight, gate_up.bias, counters=counters, row_scale=folded)
        if next_norm is None:
            return fold.kernel(act, down.weight, down.bias, counters=counters), residual
        after = fold.add_norm_kernel(
            act,
            down.weight,
            down.bias,
            residual=residual,
            norm_weight=next_norm.weight,
            eps=next_norm.eps,
            counters=counters,
        )
        return after, residual

    def _streamed_input(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RotaryInputs,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(q rotated, the residual stream) from the streamed attention input where it serves this call, else
        None (the norm, then the attention block's own projection)."""
        streamed, attn, norm = self.streamed_attn_in, self.self_attn, self.input_layernorm
        if streamed is None or not attn.streamable_input(rope):
            return None
        args = (
            attn.qkv_proj.weight,
            attn.num_heads,
            attn.num_kv_heads,
            rope.positions,
            rope.cos_cache,
            rope.sin_cache,
            kv_cache[0],
            kv_cache[1],
            attn_metadata.slot_mapping,
        )
        if not streamed.applies(h, residual, norm.weight, *args):
            return None
        return streamed(h, residual, norm.weight, norm.eps, *args)


class VocabParallelEmbedding(nn.Module):
    """The token embedding; under tensor parallelism each rank holds a range of vocabulary rows,
    looks up the ids that fall in it (zeros for the others) and the ranks sum the results."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.vocab_start, rows = tp.vocab_shard(vocab_size)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.weight.shape[0])
        h = F.embedding(torch.where(inside, local, 0), self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(h)


class LlamaModel(nn.Module):
    """Embedding, decoder stack and final norm (the `model.` prefix of HF checkpoints)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        tp = tp if tp is not None else TensorParallel()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
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
        x: torch.Tensor | FoldedNorm = h
        layers = list(self.decoder_layers)
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else None
            x, residual = layer(x, residual, rope, kv_cache, attn_metadata, next_norm)
        if isinstance(x, FoldedNorm):  # the last layer is given no next norm: never folded
            raise RuntimeError("the last decoder layer returned a folded norm")
        return self.norm.forward_residual(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Decoder-only causal LM; the model runner calls `forward` then `compute_logits` on the rows it
    samples. `tp` shards it across the ranks of a tensor-parallel group (every rank builds its own)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp if tp is not None else TensorParallel()
        self.model = LlamaModel(config, self.tp)
        # Tied models have no lm_head module: the logits reuse the embedding matrix directly. The head
        # is split by vocabulary rows like the embedding.
        rows = self.model.embed_tokens.weight.shape[0]
        self.lm_head = None if config.tie_word_embeddings else DecodeLinear(config.hidden_size, rows, bias=False)
        self.skinny_linear: SkinnyLinear | None = None
        """The decode-shaped kernel for the logits of few rows (see layers/linear.py); None: F.linear."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Logits [N, vocab] (gathered from every rank's vocabulary shard) in float32, or in the weights' dtype with
        float32=False: an argmax needs no more (the conversion is exact), and it saves a kernel and a pass."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = self.tp.all_gather_rows(
            linear(hidden_states, weight, None, self.skinny_linear), self.config.vocab_size
        )
        return logits.float() if float32 else logits

    def checkpoint_tensors(self) -> dict[str, WeightTarget]:
        """HF checkpoint tensor name -> where it goes on this rank (the parameter, or a slice of a fused
        parameter, and which slice of the checkpoint tensor under tensor parallelism)."""
        cfg, tp = self.config, self.tp
        vocab = self.model.embed_tokens
        out: dict[str, WeightTarget] = {
            "model.embed_tokens.weight": sliced(vocab.weight, 0, vocab.vocab_start, cfg.vocab_size)
        }
        for i, layer in enumerate(self.model.decoder_layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            hd = attn.head_dim
            for kind in ("weight", "bias"):
                fused = getattr(attn.qkv_proj, kind)
                if fused is not None:
                    q, k, v = fused.split([attn.q_size, attn.kv_size, attn.kv_size], dim=0)
                    q_full, kv_full = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
                    out[f"{p}self_attn.q_proj.{kind}"] = sliced(q, 0, attn.q_head_start * hd, q_full)
                    out[f"{p}self_attn.k_proj.{kind}"] = sliced(k, 0, attn.kv_head_start * hd, kv_full)
                    out[f"{p}self_attn.v_proj.{kind}"] = sliced(v, 0, attn.kv_head_start * hd, kv_full)
                fused = getattr(mlp.gate_up_proj, kind)
                if fused is not None:
                    gate, up = fused.split(mlp.intermediate_size, dim=0)
                    start, full = mlp.intermediate_start, mlp.full_intermediate_size
                    out[f"{p}mlp.gate_proj.{kind}"] = sliced(gate, 0, start, full)
                    out[f"{p}mlp.up_proj.{kind}"] = sliced(up, 0, start, full)
            q_full = cfg.num_attention_heads * hd
            out[f"{p}self_attn.o_proj.weight"] = sliced(attn.o_proj.weight, 1, attn.q_head_start * hd, q_full)
            out[f"{p}mlp.down_proj.weight"] = sliced(
                mlp.down_proj.weight, 1, mlp.intermediate_start, mlp.full_intermediate_size
            )
            for name, proj in (("self_attn.o_proj", attn.o_proj), ("mlp.down_proj", mlp.down_proj)):
                if proj.bias is not None:
                    out[f"{p}{name}.bias"] = WeightTarget(proj.bias, zero=tp.rank > 0)
            if attn.qk_norm:
                out[f"{p}self_attn.q_norm.weight"] = whole(attn.q_norm.weight)
                out[f"{p}self_attn.k_norm.weight"] = whole(attn.k_norm.weight)
            out[f"{p}input_layernorm.weight"] = whole(layer.input_layernorm.weight)
            out[f"{p}post_attention_layernorm.weight"] = whole(layer.post_attention_layernorm.weight)
        out["model.norm.weight"] = whole(self.model.norm.weight)
        if self.lm_head is not None:
            out["lm_head.weight"] = sliced(self.lm_head.weight, 0, vocab.vocab_start, cfg.vocab_size)
        return out


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with a sliding attention window (from config.sliding_window)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with q/k/v biases (config.attention_bias is always True for Qwen2)."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama with per-head q/k RMSNorm (config.qk_norm)."""
