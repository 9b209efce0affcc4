"""Draft-model proposer: a small model of the same vocabulary proposes k tokens per request.

The draft's KV tensors are addressed by the target's block tables (same block ids, same slots):
no second allocator, and preemption, prefix caching and freeing apply to both. Each step the draft
first catches up over the target's step layout, in which a sampling request's positions after its
last known token hold the tokens it just emitted (accepted drafts, then the new token), plus one
position for the new token; then it proposes k tokens autoregressively from the new token. All of
it runs on the device with shapes known on the host: the accepted counts are never read back.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from asyncspec.errors import ConfigError
from asyncspec.layers.attention import select_backend
from asyncspec.layers.attention_metadata import AttentionMetadata, StaticInputs
from asyncspec.layers.sampler import (
    SamplingMetadata,
    check_token_ids,
    process_logits,
    random_sample,
)
from asyncspec.models.loader import load_model
from asyncspec.models.model_config import ModelConfig
from asyncspec.spec.step_glue import select_step_glue
from asyncspec.spec.verification import expand_rows


class GraphReplayer(Protocol):
    """The CUDA graphs of a model over fixed input buffers (the worker's CudaGraphForward)."""

    def bucket(self, num_reqs: int, query_len: int | None) -> int | None: ...

    def select(self, num_reqs: int, max_query_len: int, num_tokens: int) -> tuple[int, int] | None: ...

    def replay(self, bucket: int, query_len: int, num_tokens: int) -> Tensor: ...

    def select_mixed(self, num_reqs: int, num_tokens: int) -> tuple[int, int] | None: ...

    def replay_mixed(self, key: tuple[int, int], num_tokens: int) -> Tensor: ...

    def capture_function(self, fn: Callable[[], Any]) -> CapturedFunction: ...

    num_eager: int


class CapturedFunction(Protocol):
    """A function captured as a graph over fixed buffers: `replay` runs it, `out` holds its results."""

    out: Any

    def replay(self) -> None: ...


@dataclass
class DraftStep:
    """The target step the draft catches up on (one entry per scheduled request, batch order)."""

    num_computed: list[int]
    """Tokens in the draft's KV cache before the step, relative to `computed_base` where given."""
    computed_base: Tensor | None
    """[num_reqs] int64 device: the target's computed counts before the step, which the device alone
    may know (a step in flight may have rejected drafts); None: `num_computed` is absolute."""
    num_scheduled: list[int]
    """Positions the draft computes: the target's of this step plus those it fell behind by."""
    rows: list[int]
    """Row of each request in `token_ids`."""
    token_ids: Tensor
    """[R, L] int64 device: the target's token buffer, which already holds the emitted runs."""
    sampling_index: list[int]
    """Batch indices of the requests that sampled this step."""
    num_draft_positions: list[int]
    """Per sampling request: planned draft positions (its last num_draft_positions inputs)."""
    block_tables: Tensor
    """[num_reqs, max_blocks_per_req] int32 device: every column of each request's block table."""
    num_slots: list[int]
    """Per request, the KV slots its blocks hold: the draft never writes past them (a column past a
    request's blocks may name another request's block)."""
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
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_lag: int,
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
        self.model = load_model(
            draft_path, self.model_config, dtype, device, load_format, seed, max_position=max_model_len
        )
        self._prepare = select_backend(device).prepare_inputs
        self._glue = select_step_glue(device)
        self.kv_caches: list[tuple[Tensor, Tensor]] = []
        max_blocks_per_req = -(-max_model_len // block_size)
        self.max_lag = max_lag
        """Most tokens a request's draft KV may fall behind the target's (EngineConfig.max_draft_lag; see
        RowState.draft_lag)."""
        # The catch-up feeds every target token, each request's lag and one new token per request.
        self.inputs = StaticInputs.allocate(
            max_num_seqs, max_num_batched_tokens + max_num_seqs * (self.max_lag + 1), max_blocks_per_req, device
        )
        """The draft's step inputs, built in place by one kernel; its CUDA graphs read them."""
        self._pass_meta = torch.zeros((3, max_num_seqs), dtype=torch.int64, device=device)
        # A pass's host facts go through one of four pinned buffers (a non-blocking copy reads its
        # buffer whenever the GPU gets to it: a buffer is refilled only after its last copy's event)
        # into one device buffer (the copies and the passes' kernels are ordered on the stream). Four: a
        # step with catch-up passes of the draft's own makes several passes, and a buffer reused within
        # one step would wait for the GPU to reach that step.
        pin = device.type == "cuda"
        meta_size = 9 * max_num_seqs  # catch-up meta [4, bucket <= max_num_seqs], 5 per sampling request
        self._host_meta = [torch.zeros(meta_size, dtype=torch.int64, pin_memory=pin) for _ in range(4)]
        self._copy_done = [torch.cuda.Event() for _ in range(4)] if pin else None
        self._host_index = 0
        self._meta_dev = torch.zeros(meta_size, dtype=torch.int64, device=device)
        # The greedy proposal loop's fixed inputs and results (its graphs read and write them).
        hidden_size = self.model_config.hidden_size
        self._loop_hidden = torch.zeros((max_num_seqs, hidden_size), dtype=dtype, device=device)
        self._loop_position = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self._loop_capacity = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self._loop_tokens = torch.zeros(
            (max_num_seqs, max(num_speculative_tokens, 1)), dtype=torch.int64, device=device
        )
        self._loops: dict[tuple[int, int], CapturedFunction] = {}
        """(pass bucket, proposals) -> the captured greedy proposal loop."""
        self._step_meta = torch.zeros((4, max_num_seqs), dtype=torch.int64, device=device)
        """The catch-up meta of `greedy_step`, built on the device."""
        self.num_loop_replays = 0
        """Proposal steps served by a captured greedy loop (tests and benchmarks read it)."""
        self.graphs: GraphReplayer | None = None
        """The draft's CUDA graphs over `inputs`, set by the worker once captured."""
        self.debug_invariants = False
        """Check that no placeholder or out-of-vocabulary id reaches the draft (set by the worker)."""

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model_config.kv_bytes_per_token(self.dtype)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = self.model_config.allocate_kv_cache(num_blocks, self.block_size, self.dtype, self.device)

    def _next_host_meta(self) -> Tensor:
        """The pinned host buffer for this step's facts, once its previous copy has landed."""
        self._host_index = (self._host_index + 1) % len(self._host_meta)
        if self._copy_done is not None:
            self._copy_done[self._host_index].synchronize()
        return self._host_meta[self._host_index]

    def capture_proposal_loops(self, batch_sizes: list[int], proposal_counts: list[int]) -> int:
        """Captures the greedy proposal loop for each pass bucket and each count of proposals above 1
        (one proposal needs no pass). Needs the draft's graphs; returns the number of graphs."""
        assert self.graphs is not None
        for bucket in batch_sizes:
            for n in proposal_counts:
                if 1 < n <= self.k:
                    loop = functools.partial(self._greedy_proposal_loop, bucket, n)
                    self._loops[(bucket, n)] = self.graphs.capture_function(loop)
        return len(self._loops)

    def greedy_step(
        self,
        step_meta: Tensor,
        block_tables: Tensor,
        token_ids: Tensor,
        num_accepted: Tensor,
        bucket: int,
        query_len: int,
        num_proposals: int | None = None,
    ) -> Tensor:
        """The draft's whole step after a greedy verification in which every request of the batch
        sampled and no request's draft lags: the catch-up over the target's step plus each emitted
        token, then `num_proposals` greedy proposals (default query_len - 1, the k verified; another count
        where the next step changes k). Everything comes from device buffers, with shapes fixed by
        (bucket, query_len, num_proposals), so it can be captured as one graph. `step_meta` is the target
        step's meta: rows 0 (token-buffer row), 1 (computed tokens before the step), 2 (scheduled;
        0 for padding), 5 (planned draft positions), 6 (writable KV slots). Returns the drafts [B, n]."""
        b = bucket
        meta, inputs = self._step_meta, self.inputs
        # Each request also feeds its newest token.
        self._glue.draft_step_meta(step_meta, block_tables, meta, inputs.block_tables, b)
        catch_up_len = query_len + 1
        num_tokens = b * catch_up_len
        inputs.fill(self._prepare, meta, b, num_tokens, token_ids, self.block_size, meta[3])
        metadata = inputs.metadata(b, num_tokens, catch_up_len, self.block_size)
        hidden = self.model(inputs.input_ids[:num_tokens], inputs.positions[:num_tokens], self.kv_caches, metadata)
        # The newest token's row in the catch-up and its position: after the committed tokens and
        # the accepted drafts.
        self._glue.draft_loop_start(
            step_meta,
            num_accepted,
            hidden,
            self.max_model_len,
            self._loop_hidden,
            self._loop_position,
            self._loop_capacity,
            self._pass_meta,
            b,
        )
        n = query_len - 1 if num_proposals is None else num_proposals
        if not 0 < n <= self.k:
            raise ValueError(f"a greedy draft step proposes 1 to {self.k} drafts, not {n}")
        return self._greedy_proposal_loop(b, n)

    def _greedy_proposal_loop(self, bucket: int, num_proposals: int) -> Tensor:
        """n greedy proposals for `bucket` requests, from the hidden state of each one's newest token
        (`_loop_hidden`) at `_loop_position`: argmax, then n - 1 passes of one token per request over
        the static inputs (`_pass_meta` row 2 holds the token counts: 1, or 0 for padding).
        Every shape is fixed by (bucket, n): the body of a CUDA graph."""
        inputs = self.inputs
        token = self.model.compute_logits(self._loop_hidden[:bucket], float32=False).argmax(dim=-1)
        for j in range(1, num_proposals):
            # Pass j's inputs; the previous pass's proposals go into column j - 1 of the results.
            self._glue.draft_pass_inputs(
                token,
                j,
                self._loop_position,
                self._pass_meta,
                self._loop_capacity,
                inputs.block_tables,
                self.block_size,
                self.max_model_len,
                inputs.input_ids,
                inputs.positions,
                inputs.slot_mapping,
                inputs.query_start_loc,
                inputs.seq_lens,
                self._loop_tokens,
            )
            metadata = inputs.metadata(bucket, bucket, 1, self.block_size)
            hidden = self.model(inputs.input_ids[:bucket], inputs.positions[:bucket], self.kv_caches, metadata)
            token = self.model.compute_logits(hidden, float32=False).argmax(dim=-1)
        self._loop_tokens[:bucket, num_proposals - 1] = token
        return self._loop_tokens[:bucket, :num_proposals]

    def forward_on(self, input_ids: Tensor, positions: Tensor, metadata: AttentionMetadata) -> None:
        """The draft's forward pass over a step's inputs built for the target (same block tables): its KV at
        the step's slots, and nothing proposed."""
        if self.debug_invariants:
            check_token_ids(input_ids, self.model_config.vocab_size, "the draft's embedding")
        self.model(input_ids, positions, self.kv_caches, metadata)

    def propose(self, step: DraftStep) -> tuple[Tensor, Tensor | None]:
        """Catches up on the step, then proposes step.num_proposals tokens per sampling request.
        Returns (draft_token_ids [S, n], draft_probs [S, n, V] or None when every row is greedy)."""
        dev = self.device
        num_reqs, num_sampling = len(step.num_scheduled), len(step.sampling_index)
        num_proposals = min(step.num_proposals, self.k) if num_sampling else 0
        # Every host fact of the step in one array, one host-to-device copy: catch-up meta [4, B]
        # (padded to its graph bucket), then per sampling request the new token's row in the
        # catch-up, its position, its batch index, and its writable slots for the proposal passes.
        sampling = np.asarray(step.sampling_index, dtype=np.int64)
        is_sampling = np.zeros(num_reqs, dtype=np.int64)
        is_sampling[sampling] = 1
        scheduled = np.asarray(step.num_scheduled, dtype=np.int64)
        computed = np.asarray(step.num_computed, dtype=np.int64)
        lengths = scheduled + is_sampling  # a sampling request also feeds its new token
        num_tokens = int(lengths.sum())
        graphs = self.graphs
        graph = graphs.select(num_reqs, int(lengths.max()), num_tokens) if graphs is not None else None
        mixed = graphs.select_mixed(num_reqs, num_tokens) if graphs is not None and graph is None else None
        bucket, query_len = graph if graph is not None else (None, int(lengths.max()))
        if bucket is not None:
            padded, padded_tokens = bucket, bucket * query_len
        else:
            padded, padded_tokens = mixed if mixed is not None else (num_reqs, num_tokens)
        size = 4 * padded + 5 * num_sampling
        host_tensor = self._next_host_meta()
        host = host_tensor.numpy()[:size]
        host[:] = 0
        meta = host[: 4 * padded].reshape(4, padded)
        meta[0, :num_reqs] = step.rows
        meta[1, :num_reqs] = computed
        meta[2, :num_reqs] = lengths
        meta[3, :num_reqs] = step.num_slots
        drafts = np.asarray(step.num_draft_positions, dtype=np.int64)
        per_sampling = host[4 * padded :].reshape(5, num_sampling)
        starts = np.cumsum(lengths) - lengths
        committed = scheduled[sampling] - drafts
        per_sampling[0] = starts[sampling] + committed  # catch-up row of the last known token's successor
        per_sampling[1] = computed[sampling] + committed  # its position (num_tokens before the step)
        per_sampling[2] = sampling
        # The last position's draft could never be kept: the passes write KV below max_model_len - 1.
        per_sampling[3] = np.minimum(np.asarray(step.num_slots, dtype=np.int64)[sampling], self.max_model_len - 1)
        per_sampling[4] = np.asarray(step.rows, dtype=np.int64)[sampling]
        device_host = self._meta_dev[:size]
        device_host.copy_(host_tensor[:size], non_blocking=True)
        if self._copy_done is not None:
            self._copy_done[self._host_index].record()
        meta_dev = device_host[: 4 * padded].view(4, padded)
        new_row, new_position, sampling_dev, capacity, token_rows = device_host[4 * padded :].view(5, num_sampling)
        if step.computed_base is not None:
            meta_dev[1, :num_reqs] += step.computed_base
            if num_sampling:
                new_position += step.computed_base.index_select(0, sampling_dev)

        inputs = self.inputs
        inputs.block_tables[:num_reqs].copy_(step.block_tables)
        hidden = self._forward(
            step.token_ids, meta_dev, padded, num_tokens, padded_tokens, query_len, bucket, meta_dev[3], mixed=mixed
        )
        if num_proposals == 0:
            return torch.empty((num_sampling, 0), dtype=torch.int64, device=dev), None
        last_index = new_row + step.num_accepted
        position = new_position + step.num_accepted
        # Proposal passes: one token per sampling request, padded to the (S, 1) graph bucket by
        # requests with no tokens.
        pass_bucket = self.graphs.bucket(num_sampling, 1) if self.graphs is not None else None
        pass_padded = pass_bucket if pass_bucket is not None else num_sampling
        if num_proposals > 1:
            torch.index_select(step.block_tables, 0, sampling_dev, out=inputs.block_tables[:num_sampling])
            pass_meta = self._pass_meta
            pass_meta[:, num_sampling:pass_padded] = 0
            pass_meta[0, :num_sampling] = token_rows
            pass_meta[2, :num_sampling] = 1
        loop = None
        if step.metadata.all_greedy:
            loop = self._loops.get((pass_padded, num_proposals))
        if loop is not None:  # the whole greedy loop in one replay
            torch.index_select(hidden, 0, last_index, out=self._loop_hidden[:num_sampling])
            self._loop_position[:num_sampling].copy_(position)
            self._loop_capacity[:num_sampling].copy_(capacity)
            loop.replay()
            self.num_loop_replays += 1
            return loop.out[:num_sampling], None
        logits = self.model.compute_logits(hidden.index_select(0, last_index))
        expanded = None if step.metadata.all_greedy else expand_rows(step.metadata, 1)
        tokens: list[Tensor] = []
        probs: list[Tensor] = []
        for j in range(num_proposals):
            token, q = self._sample(logits, expanded, step)
            tokens.append(token)
            if q is not None:
                probs.append(q)
            if j == num_proposals - 1:
                break
            position = position + 1
            self._pass_meta[1, :num_sampling] = position.clamp_max(self.max_model_len - 1)
            # Past the request's writable slots: compute a useless draft, write nothing.
            hidden = self._forward(
                step.token_ids, self._pass_meta, pass_padded, num_sampling, pass_padded, 1, pass_bucket, capacity, token
            )
            logits = self.model.compute_logits(hidden)
        draft_probs = torch.stack(probs, dim=1) if probs else None
        return torch.stack(tokens, dim=1), draft_probs

    def _forward(
        self,
        token_ids: Tensor,
        meta: Tensor,
        num_reqs: int,
        num_tokens: int,
        padded_tokens: int,
        query_len: int | None,
        bucket: int | None,
        capacity: Tensor,
        input_ids: Tensor | None = None,
        mixed: tuple[int, int] | None = None,
    ) -> Tensor:
        """Builds the inputs of `num_reqs` requests (padding included) from `meta` into the static
        buffers with one kernel, then replays the graph of `bucket` (or the `mixed` graph) or runs eagerly.
        `input_ids` replaces the gathered ids (a proposal pass feeds tokens that are in no buffer)."""
        inputs = self.inputs
        inputs.fill(self._prepare, meta, num_reqs, padded_tokens, token_ids, self.block_size, capacity)
        if input_ids is not None:
            inputs.input_ids[: input_ids.shape[0]].copy_(input_ids)
        if self.debug_invariants:
            check_token_ids(inputs.input_ids[:num_tokens], self.model_config.vocab_size, "the draft's embedding")
        if bucket is not None and query_len is not None and self.graphs is not None:
            return self.graphs.replay(bucket, query_len, num_tokens)
        if mixed is not None and self.graphs is not None:
            return self.graphs.replay_mixed(mixed, num_tokens)
        if self.graphs is not None:
            self.graphs.num_eager += 1
        metadata = inputs.metadata(num_reqs, num_tokens, query_len or num_tokens, self.block_size)
        return self.model(inputs.input_ids[:num_tokens], inputs.positions[:num_tokens], self.kv_caches, metadata)

    @staticmethod
    def _sample(logits: Tensor, expanded: SamplingMetadata | None, step: DraftStep) -> tuple[Tensor, Tensor | None]:
        """The draft's own sampling distribution q (temperature, top-k/p, min-p; no penalties) and a
        token drawn from it; greedy rows take the argmax (`expanded`: the metadata per row, None when
        every row is greedy)."""
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        if expanded is None:
            return greedy, None
        q = process_logits(logits, expanded).softmax(dim=-1)
        sampled = random_sample(q, step.metadata.generators, step.default_generator)
        is_greedy = step.metadata.temperature < 1e-5
        return torch.where(is_greedy, greedy, sampled), q
