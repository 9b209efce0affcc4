"""Draft-model proposer: a small model of the same vocabulary proposes k tokens per request.

The draft's KV tensors are addressed by the target's block tables (same block ids, same slots):
no second allocator, and preemption, prefix caching and freeing apply to both. Each step the draft
first catches up over the target's step layout, in which a sampling request's positions after its
last known token hold the tokens it just emitted (accepted drafts, then the new token), plus one
position for the new token; then it proposes k tokens autoregressively from the new token. All of
it runs on the device with shapes known on the host: the accepted counts are never read back.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from asyncspec.errors import ConfigError
from asyncspec.layers.attention import allocate_paged_kv_cache, select_backend
from asyncspec.layers.attention_metadata import AttentionMetadata
from asyncspec.layers.sampler import SamplingMetadata, host_list_to_device, process_logits, random_sample
from asyncspec.models.loader import load_model
from asyncspec.models.model_config import ModelConfig
from asyncspec.spec.verification import expand_rows


@dataclass
class DraftStep:
    """The target step the draft catches up on (one entry per scheduled request, batch order)."""

    num_computed: list[int]
    """Tokens in the KV cache before the step."""
    num_scheduled: list[int]
    """Target positions computed this step."""
    sampling_index: list[int]
    """Batch indices of the requests that sampled this step."""
    num_draft_positions: list[int]
    """Per sampling request: planned draft positions (its last num_draft_positions inputs)."""
    input_ids: Tensor
    """[total] int64 device: the target's input ids."""
    block_tables: Tensor
    """[num_reqs, max_blocks_per_req] int32 device: every column of each request's block table."""
    num_slots: list[int]
    """Per request, the KV slots its blocks hold: the draft never writes past them (a column past a
    request's blocks may name another request's block)."""
    output_token_ids: Tensor
    """[S, P] int64 device: the emitted runs (-1 after each run)."""
    num_accepted: Tensor
    """[S] int64 device."""
    metadata: SamplingMetadata
    """Per sampling request (temperature, top-k/p, min-p, generators)."""
    default_generator: torch.Generator | None
    num_proposals: int
    """Drafts to propose per sampling request (at most k; 0: catch up only)."""


def check_draft_compatible(target: ModelConfig, draft: ModelConfig, target_path: str, draft_path: str) -> None:
    """Refuses a draft whose vocabulary, special ids or tokenizer differ from the target's."""
    for name in ("vocab_size", "bos_token_id", "eos_token_ids"):
        if getattr(target, name) != getattr(draft, name):
            raise ConfigError(
                f"draft_model {draft_path!r} does not match the target: {name} is {getattr(draft, name)!r} "
                f"in the draft and {getattr(target, name)!r} in the target"
            )
    target_tok, draft_tok = (os.path.join(p, "tokenizer.json") for p in (target_path, draft_path))
    if os.path.isfile(target_tok) and os.path.isfile(draft_tok):
        with open(target_tok, "rb") as a, open(draft_tok, "rb") as b:
            if a.read() != b.read():
                raise ConfigError(
                    f"draft_model {draft_path!r} does not match the target: its tokenizer.json differs from "
                    f"the target's ({target_path!r})"
                )


class DraftModelProposer:
    """Holds the draft model and its paged KV tensors."""

    def __init__(
        self,
        draft_path: str,
        target_config: ModelConfig,
        target_path: str,
        num_speculative_tokens: int,
        max_model_len: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        load_format: str,
        seed: int,
    ) -> None:
        self.model_config = ModelConfig.from_pretrained(draft_path)
        check_draft_compatible(target_config, self.model_config, target_path, draft_path)
        if self.model_config.max_position_embeddings < max_model_len:
            raise ConfigError(
                f"draft_model {draft_path!r} supports {self.model_config.max_position_embeddings} positions, "
                f"fewer than max_model_len={max_model_len}; lower max_model_len"
            )
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.model = load_model(draft_path, self.model_config, dtype, device, load_format, seed)
        self.compute_slot_mapping = select_backend(device).slot_mapping
        self.kv_caches: list[tuple[Tensor, Tensor]] = []
        self.forward: Callable[[Tensor, Tensor, AttentionMetadata, int | None], Tensor] = self._eager_forward
        """forward(input_ids, positions, metadata, uniform query length or None) -> hidden states; the
        worker swaps in its CUDA-graph replay once the graphs are captured."""

    def _eager_forward(
        self, input_ids: Tensor, positions: Tensor, metadata: AttentionMetadata, query_len: int | None
    ) -> Tensor:
        return self.model(input_ids, positions, self.kv_caches, metadata)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model_config.kv_bytes_per_token(self.dtype)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        mc = self.model_config
        self.kv_caches = allocate_paged_kv_cache(
            mc.num_hidden_layers,
            num_blocks,
            self.block_size,
            mc.num_key_value_heads,
            mc.head_dim,
            self.dtype,
            self.device,
        )

    def propose(self, step: DraftStep) -> tuple[Tensor, Tensor | None]:
        """Catches up on the step, then proposes k tokens per sampling request.
        Returns (draft_token_ids [S, n], draft_probs [S, n, V] or None when every row is greedy),
        n = step.num_proposals."""
        dev = self.device
        hidden, last_index = self._catch_up(step)
        num_proposals = min(step.num_proposals, self.k)
        if not step.sampling_index or num_proposals == 0:
            return torch.empty((len(step.sampling_index), 0), dtype=torch.int64, device=dev), None
        num_sampling = len(step.sampling_index)
        logits = self.model.compute_logits(hidden.index_select(0, last_index))
        expanded = expand_rows(step.metadata, 1)
        tokens: list[Tensor] = []
        probs: list[Tensor] = []
        # Position of the new token of each sampling request: num_tokens before the step + accepted.
        num_tokens = [
            step.num_computed[i] + step.num_scheduled[i] - step.num_draft_positions[n]
            for n, i in enumerate(step.sampling_index)
        ]
        position = host_list_to_device(num_tokens, dev) + step.num_accepted
        block_tables = step.block_tables.index_select(0, host_list_to_device(step.sampling_index, dev))
        capacity = host_list_to_device([step.num_slots[i] for i in step.sampling_index], dev)
        query_start_loc = torch.arange(num_sampling + 1, dtype=torch.int32, device=dev)
        for j in range(num_proposals):
            token, q = self._sample(logits, expanded, step)
            tokens.append(token)
            if q is not None:
                probs.append(q)
            if j == num_proposals - 1:
                break
            position = position + 1
            safe = position.clamp_max(self.max_model_len - 1)
            slots = self.compute_slot_mapping(block_tables, query_start_loc, safe, self.block_size)
            # Past the request's reserved slots (at most max_model_len): compute a useless draft,
            # write nothing.
            slots = torch.where(position < capacity, slots, torch.full_like(slots, -1))
            metadata = AttentionMetadata(
                slot_mapping=slots,
                query_start_loc=query_start_loc,
                seq_lens=(safe + 1).to(torch.int32),
                block_tables=block_tables,
                max_query_len=1,
                max_seq_len=self.max_model_len,
                block_size=self.block_size,
            )
            hidden = self.forward(token, safe, metadata, 1)
            logits = self.model.compute_logits(hidden)
        draft_probs = torch.stack(probs, dim=1) if probs else None
        return torch.stack(tokens, dim=1), draft_probs

    def _catch_up(self, step: DraftStep) -> tuple[Tensor, Tensor]:
        """Runs the draft over the step's layout; returns its hidden states and, per sampling
        request, the index of the new token's row."""
        dev = self.device
        sampling = dict(zip(step.sampling_index, range(len(step.sampling_index)), strict=True))
        num_positions = step.output_token_ids.shape[1] if step.sampling_index else 0
        offset = step.input_ids.shape[0]  # emitted tokens follow the target inputs in `source`
        source_index: list[int] = []
        positions: list[int] = []
        lengths: list[int] = []
        new_token_base: list[int] = []
        start = 0
        for i, (computed, n) in enumerate(zip(step.num_computed, step.num_scheduled, strict=True)):
            n_sampling = sampling.get(i)
            if n_sampling is None:
                source_index.extend(range(start, start + n))
                length = n
            else:
                d = step.num_draft_positions[n_sampling]
                committed = n - d
                source_index.extend(range(start, start + committed))
                emitted = offset + n_sampling * num_positions
                source_index.extend(range(emitted, emitted + d + 1))
                length = n + 1
                new_token_base.append(sum(lengths) + committed)
            positions.extend(range(computed, computed + length))
            lengths.append(length)
            start += n
        source = torch.cat([step.input_ids, step.output_token_ids.reshape(-1).clamp_min(0)])
        input_ids = source.index_select(0, host_list_to_device(source_index, dev))
        position_tensor = host_list_to_device(positions, dev)
        cumulative = [0]
        for length in lengths:
            cumulative.append(cumulative[-1] + length)
        query_start_loc = host_list_to_device(cumulative, dev, torch.int32)
        seq_lens = [c + length for c, length in zip(step.num_computed, lengths, strict=True)]
        slots = self.compute_slot_mapping(step.block_tables, query_start_loc, position_tensor, self.block_size)
        capacity = [c for c, length in zip(step.num_slots, lengths, strict=True) for _ in range(length)]
        slots = torch.where(position_tensor < host_list_to_device(capacity, dev), slots, torch.full_like(slots, -1))
        metadata = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=query_start_loc,
            seq_lens=host_list_to_device(seq_lens, dev, torch.int32),
            block_tables=step.block_tables,
            max_query_len=max(lengths),
            max_seq_len=max(seq_lens),
            block_size=self.block_size,
        )
        uniform = lengths[0] if lengths and min(lengths) == max(lengths) else None
        hidden = self.forward(input_ids, position_tensor, metadata, uniform)
        last_index = host_list_to_device(new_token_base, dev) + step.num_accepted if new_token_base else None
        return hidden, last_index if last_index is not None else torch.empty(0, dtype=torch.int64, device=dev)

    @staticmethod
    def _sample(logits: Tensor, expanded: SamplingMetadata, step: DraftStep) -> tuple[Tensor, Tensor | None]:
        """The draft's own sampling distribution q (temperature, top-k/p, min-p; no penalties) and a
        token drawn from it; greedy rows take the argmax."""
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        if step.metadata.all_greedy:
            return greedy, None
        q = process_logits(logits, expanded).softmax(dim=-1)
        sampled = random_sample(q, step.metadata.generators, step.default_generator)
        is_greedy = step.metadata.temperature < 1e-5
        return torch.where(is_greedy, greedy, sampled), q
