"""Persistent per-request state of the worker: one row per request, kept across steps."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from asyncspec.core.scheduler_output import NewRequestData
from asyncspec.layers.sampler import host_array_to_device, host_list_to_device, make_generator
from asyncspec.sampling_params import SamplingParams


@dataclass
class RowState:
    """Host-side facts of one row (the token ids themselves live on the device)."""

    request_id: str
    row: int
    num_prompt_tokens: int
    num_tokens: int
    """Tokens known to the worker: prompt plus every sampled token."""
    num_computed_tokens: int
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    block_ids: list[int] = field(default_factory=list)
    features: tuple[str, ...] = ()
    """The sampling features this row uses (see SAMPLING_FEATURES), counted in InputBatch.feature_counts."""
    draft_lag: int = 0
    """Tokens the target computed that the draft model has not (decode steps without speculation that
    proposed nothing skip the draft); its next pass catches up on them."""


SAMPLING_FEATURES = ("random", "top_k", "top_p", "min_p", "penalties", "logprobs", "min_tokens", "seeded")
"""Per-row sampling features whose batch-wide counts let a step skip scanning every request."""


def sampling_features(params: SamplingParams, seeded: bool) -> tuple[str, ...]:
    random = not params.is_greedy
    flags = {
        "random": random,
        "top_k": random and params.top_k > 0,
        "top_p": random and params.top_p < 1.0,
        "min_p": random and params.min_p > 0.0,
        "penalties": params.uses_penalties,
        "logprobs": params.logprobs is not None,
        "min_tokens": params.min_tokens > 0,
        "seeded": seeded,
    }
    return tuple(name for name in SAMPLING_FEATURES if flags[name])


_SAMPLING_FIELDS = {
    "temperature": torch.float32,
    "top_k": torch.int64,
    "top_p": torch.float32,
    "min_p": torch.float32,
    "presence_penalty": torch.float32,
    "frequency_penalty": torch.float32,
    "repetition_penalty": torch.float32,
}


_FLOAT32_MAX = float(np.finfo(np.float32).max)
_FLOAT_FIELDS = tuple(name for name, dtype in _SAMPLING_FIELDS.items() if dtype == torch.float32)
# Where each field sits in a row's values (`_row_sampling_values`, in _SAMPLING_FIELDS order).
_FLOAT_INDICES = [list(_SAMPLING_FIELDS).index(name) for name in _FLOAT_FIELDS]
_TOP_K_INDEX = list(_SAMPLING_FIELDS).index("top_k")


def _check_representable(values: dict[str, float]) -> None:
    """Raises (OverflowError) for a value its device table cannot hold; a row's values are checked before
    any reaches the device, so a failed admission leaves nothing behind."""
    for name, value in values.items():
        if _SAMPLING_FIELDS[name] == torch.int64:
            np.int64(value)  # raises OverflowError past int64
        elif abs(value) > _FLOAT32_MAX:
            raise OverflowError(f"{name}={value} does not fit float32")


def _row_sampling_values(params: SamplingParams) -> dict[str, float]:
    # Greedy rows carry temperature 0 (the sampler's marker) and neutral truncation values (verification processes
    # them beside random rows, and their argmax must not depend on their own top-p); disabled top-k is 0. In
    # _SAMPLING_FIELDS order.
    greedy = params.is_greedy
    return {
        "temperature": 0.0 if greedy else params.temperature,
        "top_k": 0 if greedy else max(params.top_k, 0),
        "top_p": 1.0 if greedy else params.top_p,
        "min_p": 0.0 if greedy else params.min_p,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
    }


class InputBatch:
    """Rows are assigned on arrival and released on finish or preemption.

    `token_ids` is a device tensor and the source of truth for the tokens fed to the model:
    sampled tokens are written there on the device, never re-uploaded from the host.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        vocab_size: int,
        device: torch.device,
        num_spare_token_slots: int = 0,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        # Allocated when the first penalised request arrives: [max_num_reqs, vocab] each.
        self.output_token_counts: torch.Tensor | None = None
        self.prompt_token_mask: torch.Tensor | None = None
        self.max_model_len = max_model_len
        self.max_blocks_per_req = -(-max_model_len // block_size)
        self.device = device
        # Spare columns past max_model_len: a verification run's unused tail may be written there
        # (masked) without clamping indices onto a real position.
        self.token_ids = torch.zeros(
            (max_num_reqs, max_model_len + num_spare_token_slots), dtype=torch.int64, device=device
        )
        self.block_table = np.zeros((max_num_reqs, self.max_blocks_per_req), dtype=np.int32)
        # Written only by append_blocks, which bumps block_table_version: the runner skips the copy of a step
        # whose rows and version match its last copy's, so a write that does not bump it would go unseen.
        self.block_table_version = 0
        """Bumped by every write to block_table."""
        self.num_computed_dev = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        """Per row, tokens whose KV is computed: the truth, advanced by each step and corrected by its
        accepted counts on the device (the host's plan may be ahead of it while steps are in flight)."""
        self.rows: dict[str, RowState] = {}
        # Sampling parameters per row, on the device: a step gathers its rows instead of
        # building new tensors on the host.
        # The float fields are rows of one table, so an admission writes all of them with one scatter.
        self._float_table = torch.zeros((len(_FLOAT_FIELDS), max_num_reqs), dtype=torch.float32, device=device)
        self.sampling_tensors = {
            name: (
                self._float_table[_FLOAT_FIELDS.index(name)]
                if dtype == torch.float32
                else torch.zeros(max_num_reqs, dtype=dtype, device=device)
            )
            for name, dtype in _SAMPLING_FIELDS.items()
        }
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        self._unwritten: list[tuple[int, list[int], tuple[float, ...]]] = []
        """Rows admitted whose token ids and sampling values are not on the device yet (`write_admitted`)."""
        self.feature_counts = dict.fromkeys(SAMPLING_FEATURES, 0)
        """Rows using each sampling feature: kept on admission and removal, so a step whose rows
        are the whole batch learns, e.g., that every row is greedy without looking at each."""
        # Seeded generators of preempted requests, so a resumed request continues its stream.
        self._parked_generators: dict[str, torch.Generator] = {}

    def add_request(self, data: NewRequestData, write_device: bool = True) -> RowState:
        """Gives the request a row. All or nothing: if anything fails (a value its device tables
        cannot hold, say), the row is free again and the error propagates to the caller, which
        fails this request alone. With write_device=False its token ids and sampling values reach the
        device at the next `write_admitted` (a step admits all its requests, then writes them at once)."""
        if not self._free_rows:
            raise RuntimeError("input batch is full: more running requests than max_num_seqs")
        row = self._free_rows.pop()
        try:
            state = self._fill_row(row, data)
        except BaseException:
            self.rows.pop(data.request_id, None)
            self._free_rows.append(row)
            raise
        if write_device:
            self.write_admitted()
        return state

    def write_admitted(self) -> None:
        """The token ids and sampling values of the rows admitted since the last call onto the device: one
        host-to-device copy and three scatters (token ids, top-k, the float table), however many rows (a few
        launches per row would make a step that admits a hundred requests wait on the host)."""
        if not self._unwritten:
            return
        pending, self._unwritten = self._unwritten, []
        num_rows = len(pending)
        lengths = np.fromiter((len(tokens) for _, tokens, _ in pending), dtype=np.int64, count=num_rows)
        rows = np.fromiter((row for row, _, _ in pending), dtype=np.int64, count=num_rows)
        num_tokens = int(lengths.sum())
        num_ints = 2 * num_tokens + 2 * num_rows
        # One staging array: int64 (token ids, their flat index in token_ids, the rows, top_k), then float32
        # (the other values, a row per field), so one copy carries everything.
        staging = np.empty(8 * num_ints + 4 * len(_FLOAT_FIELDS) * num_rows, dtype=np.uint8)
        ints = staging[: 8 * num_ints].view(np.int64)
        start = 0
        for (_, tokens, _), n in zip(pending, lengths.tolist(), strict=True):
            ints[start : start + n] = tokens
            start += n
        cols = self.token_ids.shape[1]
        row_starts = np.cumsum(lengths) - lengths
        ints[num_tokens : 2 * num_tokens] = np.arange(num_tokens) + np.repeat(rows * cols - row_starts, lengths)
        ints[2 * num_tokens : 2 * num_tokens + num_rows] = rows
        ints[2 * num_tokens + num_rows :] = [v[_TOP_K_INDEX] for _, _, v in pending]
        floats = staging[8 * num_ints :].view(np.float32).reshape(len(_FLOAT_FIELDS), num_rows)
        floats[:] = np.array([v for _, _, v in pending], dtype=np.float64)[:, _FLOAT_INDICES].T
        staged = host_array_to_device(staging, self.device)
        ints_dev = staged[: 8 * num_ints].view(torch.int64)
        floats_dev = staged[8 * num_ints :].view(torch.float32).view(len(_FLOAT_FIELDS), num_rows)
        self.token_ids.view(-1).index_copy_(0, ints_dev[num_tokens : 2 * num_tokens], ints_dev[:num_tokens])
        rows_dev = ints_dev[2 * num_tokens : 2 * num_tokens + num_rows]
        self.sampling_tensors["top_k"].index_copy_(0, rows_dev, ints_dev[2 * num_tokens + num_rows :])
        self._float_table.index_copy_(1, rows_dev, floats_dev)

    def _fill_row(self, row: int, data: NewRequestData) -> RowState:
        n = len(data.token_ids)
        if n > self.token_ids.shape[1]:
            raise ValueError(f"{n} tokens do not fit a row of {self.token_ids.shape[1]}")
        params = data.sampling_params
        state = RowState(
            request_id=data.request_id,
            row=row,
            num_prompt_tokens=data.num_prompt_tokens,
            num_tokens=n,
            num_computed_tokens=data.num_computed_tokens,
            sampling_params=params,
            prompt_token_ids=data.token_ids[: data.num_prompt_tokens],
            output_token_ids=data.token_ids[data.num_prompt_tokens :],
            generator=self._parked_generators.get(data.request_id),
        )
        if state.generator is None and params.seed is not None and not params.is_greedy:  # greedy draws nothing
            state.generator = make_generator(params.seed, self.device)
        values = _row_sampling_values(params)
        _check_representable(values)
        if params.uses_penalties:
            self._init_penalty_row(state)
        self.append_blocks(state, data.block_ids)
        state.features = sampling_features(params, state.generator is not None)
        self.rows[data.request_id] = state
        self._unwritten.append((row, data.token_ids, tuple(values.values())))
        for name in state.features:
            self.feature_counts[name] += 1
        if data.request_id in self._parked_generators:
            # Only now that the row is complete: a failed admission keeps a resumed stream's state.
            del self._parked_generators[data.request_id]
        return state

    def _init_penalty_row(self, state: RowState) -> None:
        """Token statistics of a penalised row, on the device: built once here, then updated on the
        device from each sampled token (record_sampled), so a step does no host work for them."""
        if self.output_token_counts is None:
            shape = (self.max_num_reqs, self.vocab_size)
            self.output_token_counts = torch.zeros(shape, dtype=torch.float32, device=self.device)
            self.prompt_token_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        assert self.prompt_token_mask is not None
        row = state.row
        self.output_token_counts[row].zero_()
        self.prompt_token_mask[row].zero_()
        prompt = host_list_to_device(state.prompt_token_ids, self.device)
        self.prompt_token_mask[row].index_fill_(0, prompt, True)
        if state.output_token_ids:
            outputs = host_list_to_device(state.output_token_ids, self.device)
            self.output_token_counts[row].index_add_(
                0, outputs, torch.ones(len(state.output_token_ids), device=self.device)
            )

    def write_sampled_tokens(
        self, batch_rows: torch.Tensor, cols: torch.Tensor, sampled: torch.Tensor, padded: bool = False
    ) -> None:
        """The sampled tokens into the device token buffer at (row, sequence length), where the next
        step reads its input ids. Never a placeholder: an invalid (negative) id is written as 0 (its
        request fails; a step already planned behind this one feeds the value to the model). With
        `padded`, entries of sequence length 0 (the padding requests of a graph bucket, row 0) write
        back the value already there."""
        values = sampled.clamp_min(0)
        if padded:
            values = torch.where(cols > 0, values, self.token_ids[batch_rows, cols])
        self.token_ids[batch_rows, cols] = values

    @property
    def records_sampled(self) -> bool:
        """Whether a step's sampled tokens go into the output statistics: only while a penalised row is in
        the batch. A row's statistics are rebuilt when a penalised request takes it (_init_penalty_row), so
        no other row's counts are ever read; once the table exists (the start-up warm-up's penalised dummy
        request allocates it) counting every step's tokens cost ~0.2 ms of host time per step."""
        return self.output_token_counts is not None and self.feature_counts["penalties"] > 0

    def record_sampled(self, batch_rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Counts the sampled tokens of rows [N] in the device output statistics (while any row is
        penalised). An invalid (negative) id counts nothing: as an index it would wrap around."""
        if not self.records_sampled:
            return
        assert self.output_token_counts is not None
        # One flat index_add (atomic adds of whole numbers: exact, so deterministic), not index_put_ with
        # accumulate, which sorts the indices (several kernels and their launches per step).
        flat = batch_rows.to(torch.int64) * self.vocab_size + token_ids.clamp_min(0)
        self.output_token_counts.view(-1).index_add_(0, flat, (token_ids >= 0).to(torch.float32))

    def append_blocks(self, state: RowState, block_ids: list[int]) -> None:
        if block_ids:
            start = len(state.block_ids)
            self.block_table[state.row, start : start + len(block_ids)] = block_ids
            self.block_table_version += 1
            state.block_ids.extend(block_ids)

    def remove_request(self, request_id: str, preempted: bool = False) -> None:
        state = self.rows.pop(request_id, None)
        if state is None:
            if not preempted:
                self._parked_generators.pop(request_id, None)
            return
        self._free_rows.append(state.row)
        for name in state.features:
            self.feature_counts[name] -= 1
        if preempted and state.generator is not None:
            self._parked_generators[request_id] = state.generator

    def __len__(self) -> int:
        return len(self.rows)
