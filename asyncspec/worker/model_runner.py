"""Model runner: applies a SchedulerOutput to the persistent batch, builds inputs on the device, runs
the forward pass and samples."""
from __future__ import annotations

import os
from typing import Optional

import torch

from asyncspec.config import EngineConfig
from asyncspec.core.scheduler_output import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from asyncspec.kernels.slot_mapping import compute_slot_mapping_ref
from asyncspec.layers.attention_metadata import AttentionMetadata
from asyncspec.layers.sampler import Sampler, SamplingMetadata, make_generator
from asyncspec.models.loader import load_model
from asyncspec.models.model_config import ModelConfig
from asyncspec.worker.input_batch import InputBatch, RowState

# Share of available host memory the KV pool may take on the CPU when no size is given.
_CPU_KV_MEMORY_FRACTION = 0.25


class ModelRunner:
    """Holds the model, the KV cache tensors and the persistent input batch."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int) -> None:
        self.config = config
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        self.model = load_model(
            config.model, model_config, self.dtype, self.device, config.load_format, config.seed
        )
        self.sampler = Sampler()
        self.default_generator = make_generator(config.seed, self.device)
        self.input_batch = InputBatch(config.max_num_seqs, max_model_len, config.block_size, self.device)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.eos_token_ids = list(model_config.eos_token_ids)

    # -- KV cache ---------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        return self.model_config.kv_bytes_per_token(self.dtype) * self.block_size

    def determine_num_kv_blocks(self) -> int:
        """The pool size from the config, or from available host memory on the CPU."""
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if cfg.kv_cache_bytes is not None:
            return cfg.kv_cache_bytes // self.bytes_per_block
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        by_memory = int(available * _CPU_KV_MEMORY_FRACTION) // self.bytes_per_block
        # More than every request at full length is never useful.
        full_need = cfg.max_num_seqs * -(-self.max_model_len // self.block_size)
        return max(1, min(by_memory, full_need))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        mc = self.model_config
        shape = (num_blocks, self.block_size, mc.num_key_value_heads, mc.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(mc.num_hidden_layers)
        ]

    # -- one step -----------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for request_id in so.finished_req_ids:
            batch.remove_request(request_id)
        for request_id in so.preempted_req_ids:
            batch.remove_request(request_id, preempted=True)
        for data in so.scheduled_new_reqs:
            batch.add_request(data)
        cached = so.scheduled_cached_reqs
        for request_id, new_blocks, num_computed in zip(
            cached.request_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            state = batch.rows[request_id]
            batch.append_blocks(state, new_blocks)
            state.num_computed_tokens = num_computed

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        batch = self.input_batch
        req_ids = list(so.num_scheduled_tokens)
        states = [batch.rows[r] for r in req_ids]
        num_scheduled = [so.num_scheduled_tokens[r] for r in req_ids]
        attn_metadata, positions, input_ids = self._prepare_inputs(states, num_scheduled, so.total_num_scheduled_tokens)

        hidden_states = self.model(input_ids, positions, self.kv_caches, attn_metadata)

        # Only requests whose scheduled tokens reach their last known token sample this step.
        sampling_rows = [
            i for i, (s, n) in enumerate(zip(states, num_scheduled)) if s.num_computed_tokens + n >= s.num_tokens
        ]
        for state, n in zip(states, num_scheduled):
            state.num_computed_tokens += n
        sampled_per_req: list[list[int]] = [[] for _ in req_ids]
        logprobs_per_req: Optional[list[Optional[list[TokenLogprobs]]]] = None
        if sampling_rows:
            last_token_index = attn_metadata.query_start_loc[1:].to(torch.int64) - 1
            rows_t = torch.tensor(sampling_rows, dtype=torch.int64, device=self.device)
            logits = self.model.compute_logits(hidden_states[last_token_index[rows_t]])
            sampling_states = [states[i] for i in sampling_rows]
            metadata = self._sampling_metadata(sampling_states)
            out = self.sampler(logits, metadata, self.default_generator)
            sampled = out.sampled_token_ids
            # The device token buffer is the source of truth for the next step's input ids.
            rows_dev = torch.tensor([s.row for s in sampling_states], dtype=torch.int64, device=self.device)
            cols_dev = torch.tensor([s.num_tokens for s in sampling_states], dtype=torch.int64, device=self.device)
            in_range = cols_dev < self.max_model_len
            batch.token_ids[rows_dev[in_range], cols_dev[in_range]] = sampled[in_range]
            sampled_host = sampled.tolist()
            for i, state, token_id in zip(sampling_rows, sampling_states, sampled_host):
                state.num_tokens += 1
                state.output_token_ids.append(token_id)
                sampled_per_req[i] = [token_id]
            if metadata.max_num_logprobs is not None:
                logprobs_per_req = self._collect_logprobs(out, sampling_rows, sampling_states, len(req_ids))
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled_per_req, logprobs=logprobs_per_req)

    def _prepare_inputs(
        self, states: list[RowState], num_scheduled: list[int], total_tokens: int
    ) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
        """One small host-to-device copy; positions, input ids and slots are derived on the device."""
        dev = self.device
        num_reqs = len(states)
        host = torch.tensor(
            [[s.row for s in states], [s.num_computed_tokens for s in states], num_scheduled], dtype=torch.int64
        )
        rows, num_computed, num_sched = host.to(dev, non_blocking=True).unbind(0)
        query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32, device=dev)
        torch.cumsum(num_sched, 0, out=query_start_loc[1:])
        req_index = torch.repeat_interleave(
            torch.arange(num_reqs, device=dev), num_sched, output_size=total_tokens
        )
        token_offset = torch.arange(total_tokens, device=dev) - query_start_loc[req_index]
        positions = num_computed[req_index] + token_offset
        input_ids = self.input_batch.token_ids[rows[req_index], positions]
        seq_lens_host = [s.num_computed_tokens + n for s, n in zip(states, num_scheduled)]
        max_seq_len = max(seq_lens_host)
        num_block_cols = -(-max_seq_len // self.block_size)
        block_rows = torch.from_numpy(self.input_batch.block_table[[s.row for s in states], :num_block_cols])
        block_tables = block_rows.to(dev, non_blocking=True)
        slot_mapping = compute_slot_mapping_ref(block_tables, query_start_loc, positions, self.block_size)
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=(num_computed + num_sched).to(torch.int32),
            block_tables=block_tables,
            max_query_len=max(num_scheduled),
            max_seq_len=max_seq_len,
            block_size=self.block_size,
        )
        return metadata, positions, input_ids

    def _sampling_metadata(self, states: list[RowState]) -> SamplingMetadata:
        generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        return SamplingMetadata.from_params(
            [s.sampling_params for s in states],
            generators=generators,
            prompt_token_ids=[s.prompt_token_ids for s in states],
            output_token_ids=[s.output_token_ids for s in states],
            eos_token_ids=self.eos_token_ids,
            device=self.device,
        )

    @staticmethod
    def _collect_logprobs(out, sampling_rows: list[int], states: list[RowState], num_reqs: int):
        result: list[Optional[list[TokenLogprobs]]] = [None] * num_reqs
        ids = out.logprob_token_ids.tolist()
        values = out.logprobs.tolist()
        ranks = out.sampled_token_ranks.tolist()
        for j, (i, state) in enumerate(zip(sampling_rows, states)):
            n = state.sampling_params.logprobs
            if n is None:
                continue
            result[i] = [TokenLogprobs(token_ids=ids[j][: n + 1], logprobs=values[j][: n + 1], sampled_token_rank=ranks[j])]
        return result
