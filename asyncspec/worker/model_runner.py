"""Model runner: applies a SchedulerOutput to the persistent batch, builds inputs on the device, runs
the forward pass and samples."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import operator
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncspec.config import EngineConfig
from asyncspec.core.kv_cache import num_blocks_for_bytes
from asyncspec.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from asyncspec.core.spec_policy import StepCost, speculation_choices
from asyncspec.errors import ConfigError, EngineDeadError
from asyncspec.layers.attention import Attention, select_backend, use_early_kv, use_fused_combine
from asyncspec.layers.attention_metadata import AttentionMetadata, StaticInputs
from asyncspec.layers.linear import SkinnyLinear, make_skinny_linear, use_skinny_linear
from asyncspec.layers.sampler import (
    INVALID_TOKEN_ID,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    check_token_ids,
    greedy_sample,
    greedy_sample_into_tokens,
    host_list_to_device,
    make_generator,
)
from asyncspec.layers.streamed_attn_in import make_streamed_attn_in, use_streamed_attn_in
from asyncspec.layers.streamed_linear import (
    make_streamed_down_proj,
    make_streamed_o_proj,
    use_streamed_down_proj,
    use_streamed_o_proj,
)
from asyncspec.layers.streamed_mlp import make_streamed_mlp, use_streamed_mlp
from asyncspec.layers.tensor_parallel import TensorParallel
from asyncspec.models.loader import load_model
from asyncspec.models.model_config import ModelConfig
from asyncspec.outputs import TokenLogprobs
from asyncspec.sampling_params import MAX_LOGPROBS, SAMPLING_EPS, SamplingParams
from asyncspec.spec.draft_kv_validity import DraftKVValidity
from asyncspec.spec.draft_model_proposer import DraftModelProposer, DraftStep
from asyncspec.spec.factory import make_speculative_decoder
from asyncspec.spec.greedy_verify import GreedyVerification, GreedyVerifyResult
from asyncspec.spec.spec_decoder import SpeculativeDecoder, VerifyInputs
from asyncspec.worker.cuda_graphs import CapturedGraph, CudaGraphForward, batch_size_buckets, mixed_graph_sizes
from asyncspec.worker.gpu_memory import MemorySnapshot, check_free_at_start, kv_cache_budget, snapshot_at_start
from asyncspec.worker.input_batch import SAMPLING_FEATURES, InputBatch, RowState

logger = logging.getLogger(__name__)

# Share of available host memory the KV pool may take on the CPU when no size is given.
_CPU_KV_MEMORY_FRACTION = 0.25


def _available_host_memory() -> int:
    """MemAvailable (free plus reclaimable cache) where Linux reports it, else free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass
class StepInputs:
    """A prepared step: the real requests' view, and how the forward pass runs. The views of the static
    buffers are made on first use: a step that replays a graph and samples inside it never needs them, and
    each costs microseconds of host time."""

    inputs: StaticInputs
    """The static buffers the step's inputs were built into."""
    num_reqs: int
    """Real requests (padding excluded)."""
    num_tokens: int
    """Real tokens (padding excluded): T."""
    max_query_len: int
    """Most tokens of one request."""
    max_seq_len: int
    """An upper bound on every request's sequence length after the step."""
    block_size: int
    """Tokens per KV block."""
    graph_bucket: int | None
    """The captured batch size that replays this step, or None (a mixed graph, or eager)."""
    query_len: int
    """Tokens per request when uniform (what the graph was captured for)."""
    mixed_graph: tuple[int, int] | None = None
    """The mixed graph (request bucket, token bucket) that replays this step when no uniform one does."""

    @functools.cached_property
    def metadata(self) -> AttentionMetadata:
        """Attention inputs of the real requests (views of the static buffers)."""
        metadata = self.inputs.metadata(self.num_reqs, self.num_tokens, self.max_query_len, self.block_size)
        metadata.max_seq_len = self.max_seq_len
        return metadata

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        """[T] int64."""
        return self.inputs.positions[: self.num_tokens]

    @functools.cached_property
    def input_ids(self) -> torch.Tensor:
        """[T] int64."""
        return self.inputs.input_ids[: self.num_tokens]


@dataclass(eq=False)
class StepHandle:
    """A launched step. Its results reach the host through one copy into pinned memory; `ready`
    fires when they are there. `collect` turns them into the step's ModelRunnerOutput."""

    finish: Callable[[np.ndarray], ModelRunnerOutput] | None = None
    """Reads the host copy into the step's output (None: `output` is already final)."""
    host: torch.Tensor | None = None
    """The step's host copy (pinned on CUDA)."""
    ready: torch.cuda.Event | None = None
    """Recorded after the copy (CUDA); None when the copy is already complete."""
    output: ModelRunnerOutput | None = None
    future: concurrent.futures.Future[ModelRunnerOutput] | None = None
    """On the CPU in asynchronous mode: the worker thread's run of the whole step."""
    timing_slot: int | None = None
    """Index of the step's timed CUDA events (device idle before it)."""
    device_idle_seconds: float | None = None
    """On the CPU: the worker's idle time before this step (on CUDA it is read at collection)."""
    debug_rows: dict[str, int] | None = None
    """Debug mode: the step's request rows, and a copy of the device's computed counts after it."""
    debug_computed: torch.Tensor | None = None

    def wait(self) -> None:
        """Blocks until the results are on the host (the engine's worker thread calls this, never the
        event loop)."""
        if self.future is not None:
            concurrent.futures.wait([self.future])
        elif self.ready is not None:
            self.ready.synchronize()


EAGER_SKINNY_ROWS = 2
"""Eager calls of at most this many rows take the skinny kernel; graphed steps use it up to its `max_rows` (256, or
ASYNCSPEC_SKINNY_MAX_ROWS; past 32 rows for small weights only).
Graph capture compiles every kernel variant its sizes need at start-up, while an eager step of 3 to 32
rows (a short prefill chunk) could meet an uncompiled one mid-run (0.3-1 s)."""

SKINNY_LINEAR_ENV = "ASYNCSPEC_SKINNY_LINEAR"
"""Set to 0 to keep the linear layers' calls of up to 32 rows (decode, verification) on cuBLAS instead
of the skinny Triton kernel (layers/linear.py). Inside the engine on an H100, the kernel with PDL made
the batch-1 greedy decode step of the Llama-1B / 8B shapes 11 % / 9 % faster than cuBLAS without PDL,
and their graphed steps at batches 4 to 32 4-8 % faster than cuBLAS with PDL (docs/benchmarks.md)."""

GRAPH_STEP_INPUTS_ENV = "ASYNCSPEC_GRAPH_STEP_INPUTS"
"""Set to 0 to launch the input kernel of a graphed step from Python (Triton's launcher: tens of microseconds of
host time) instead of replaying it as a small graph captured per bucket."""

GREEDY_DRAFT_STEP_GRAPH_ENV = "ASYNCSPEC_GREEDY_DRAFT_STEP_GRAPH"
"""Set to 0 to launch the draft's step after a greedy verification as its catch-up graph and its
proposal-loop graph with host work between them, instead of one graph (docs/benchmarks.md: the
bundled pair's synchronous step 1.64 -> 1.24 ms of wall time with the one graph)."""

TRANSITION_DRAFT_STEP_GRAPH_ENV = "ASYNCSPEC_TRANSITION_DRAFT_STEP_GRAPHS"
"""Set to 0 to capture the draft's one-graph step only for a step that proposes as many drafts as it verified,
so a step where the adaptive policy changes k (verify k, propose j) runs the draft's step eagerly again (an A/B)."""

FUSED_TOKEN_WRITE_ENV = "ASYNCSPEC_FUSED_TOKEN_WRITE"
"""Set to 0 to write a greedy decode step's tokens into the device token buffer with torch's indexing (six small
kernels after the argmax) instead of inside the argmax's last launch (`greedy_sample_into_tokens`)."""

DRAFT_ON_TARGET_INPUTS_ENV = "ASYNCSPEC_DRAFT_ON_TARGET_INPUTS"
"""Set to 0 to make the draft's catch-up over a step that proposes nothing (a plan of prompt chunks) build inputs of
its own, as a step that proposes does, instead of running on the target's step inputs (a graph per mixed graph of
the target: no host work of the draft's own)."""

GRAPH_STATS = (
    "cuda_graph_replays",
    "cuda_graph_decode_tail_replays",
    "cuda_graph_verify_tail_replays",
    "cuda_graph_draft_loop_replays",
    "cuda_graph_draft_step_replays",
    "cuda_graph_eager_forwards",
    "cuda_graph_mixed_replays",
    "cuda_graph_input_replays",
    "step_meta_copies",
    "step_block_table_copies",
    "draft_on_target_inputs_steps",
)
"""The counters of `ModelRunner.graph_stats` (a tensor-parallel executor starts from them at 0);
`cuda_graph_mixed_replays` counts the forward passes of mixed steps (prompt chunks) replayed from a graph (they
are in `cuda_graph_replays` too); `cuda_graph_input_replays` counts the graphed steps whose inputs were built by
a graph too; the last two
count the steps that copied their per-request meta and their block tables to the device (a steady decode
batch copies neither); `draft_on_target_inputs_steps` counts the draft's catch-ups run on the target's step inputs
(`ModelRunner._draft_on_target_inputs`)."""


class GreedyDecodeTail:
    """Greedy sampling of a decode step, graphed after its forward pass: logits, argmax, and each
    new token into the device token buffer (`InputBatch.write_sampled_tokens`, as the eager path;
    padding requests leave it alone), in the argmax's own launches (`greedy_sample_into_tokens`)
    unless `fused_token_write` is off. It holds what it needs, not the runner: the graphs that keep
    it must not keep the runner (and its KV cache) alive in a reference cycle."""

    def __init__(
        self, model: torch.nn.Module, meta: torch.Tensor, input_batch: InputBatch, fused_token_write: bool = True
    ) -> None:
        self.model, self.meta, self.input_batch = model, meta, input_batch
        self.fused_token_write = fused_token_write

    def __call__(self, hidden: torch.Tensor, static: StaticInputs, num_reqs: int, query_len: int = 1) -> torch.Tensor:
        logits = self.model.compute_logits(hidden[:num_reqs], float32=False)  # type: ignore[operator]
        rows = self.meta[0, :num_reqs]
        if self.fused_token_write:
            return greedy_sample_into_tokens(logits, self.input_batch.token_ids, rows, static.seq_lens[:num_reqs])
        sampled = greedy_sample(logits)
        cols = static.seq_lens[:num_reqs].to(torch.int64)
        self.input_batch.write_sampled_tokens(rows, cols, sampled, padded=True)
        return sampled


class GreedyStepTail:
    """A speculating engine's greedy tail: the decode tail after a step of one token a request (k = 0), the
    greedy verification after a wider one."""

    def __init__(self, decode: GreedyDecodeTail, verification: GreedyVerification) -> None:
        self.decode, self.verification = decode, verification

    def __call__(self, hidden: torch.Tensor, static: StaticInputs, num_reqs: int, query_len: int) -> Any:
        if query_len == 1:
            return self.decode(hidden, static, num_reqs)
        return self.verification(hidden, static, num_reqs, query_len)


class PaddedStepInputs:
    """A graphed step's inputs for `bucket` requests of at most `query_len` tokens, from the device's meta and
    counts alone (padding requests have no tokens, and resolving them changes nothing): the head of the
    target's graphs. Like GreedyDecodeTail it holds what it needs, not the runner."""

    def __init__(
        self,
        inputs: StaticInputs,
        prepare: Callable[..., None],
        meta: torch.Tensor,
        input_batch: InputBatch,
        block_size: int,
    ) -> None:
        self.inputs, self.prepare, self.meta, self.input_batch = inputs, prepare, meta, input_batch
        self.block_size = block_size

    def __call__(self, bucket: int, query_len: int) -> None:
        batch = self.input_batch
        self.inputs.fill(
            self.prepare,
            self.meta,
            bucket,
            bucket * query_len,
            batch.token_ids,
            self.block_size,
            resolve=(bucket, batch.num_computed_dev),
        )


class ModelRunner:
    """Holds the model, the KV cache tensors and the persistent input batch."""

    def __init__(
        self, config: EngineConfig, model_config: ModelConfig, max_model_len: int, tp: TensorParallel | None = None
    ) -> None:
        self.config = config
        self.tp = tp if tp is not None else TensorParallel()
        """This runner's rank and group under tensor parallelism (it holds that shard of the target and
        its KV heads; the draft model is replicated on every rank)."""
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.device = config.torch_device
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                f"device={config.device!r} was requested but CUDA is not available "
                "(no GPU, or a CPU-only torch build); use device='cpu'"
            )
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        self.memory_at_start: MemorySnapshot | None = None
        self._device_index = -1
        if self.device.type == "cuda":
            self._device_index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            # Before the weights: what the card holds already is not this engine's (gpu_memory.py).
            self.memory_at_start = snapshot_at_start(self.device)
            check_free_at_start(self.memory_at_start, config.gpu_memory_utilization)
        self.model = load_model(
            config.model,
            model_config,
            self.dtype,
            self.device,
            config.load_format,
            config.seed,
            self.tp,
            max_position=max_model_len,
        )
        self.sampler = Sampler()
        self.default_generator = make_generator(config.seed, self.device)
        self.input_batch = InputBatch(
            config.max_num_seqs,
            max_model_len,
            config.block_size,
            model_config.vocab_size,
            self.device,
            num_spare_token_slots=config.num_lookahead_tokens + 1,
        )
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.eos_token_ids = list(model_config.eos_token_ids)
        self.spec: SpeculativeDecoder | None = make_speculative_decoder(
            config, model_config, max_model_len, self.dtype, self.device
        )
        self._skinny: SkinnyLinear | None = None
        """The decode-shaped linear kernel for eager calls (of at most EAGER_SKINNY_ROWS rows; None: cuBLAS)."""
        self._skinny_graphed: SkinnyLinear | None = None
        """The same kernel for graph capture: every size it takes (the same split-K counters)."""
        if self.device.type == "cuda" and os.environ.get(SKINNY_LINEAR_ENV, "1") != "0":
            self._skinny_graphed = make_skinny_linear(self.device)
            self._skinny = dataclasses.replace(
                self._skinny_graphed, max_rows=min(self._skinny_graphed.max_rows, EAGER_SKINNY_ROWS)
            )
            self._use_skinny(self._skinny)
        # The target's batch-1 post-attention halves, o projections and attention inputs as streamed kernels,
        # where ASYNCSPEC_STREAMED_MLP, ASYNCSPEC_STREAMED_O_PROJ and ASYNCSPEC_STREAMED_DOWN_PROJ (auto by default:
        # the shapes measured faster; the MLP first, since the down projection's auto stays off where it serves)
        # and ASYNCSPEC_STREAMED_ATTN_IN ask for them.
        use_streamed_mlp(self.model, make_streamed_mlp(self.model, self.device))
        use_streamed_o_proj(self.model, make_streamed_o_proj(self.model, self.device))
        use_streamed_down_proj(self.model, make_streamed_down_proj(self.model, self.device))
        use_streamed_attn_in(self.model, make_streamed_attn_in(self.model, self.device))
        # Split-KV attention merging its splits in the split pass, where ASYNCSPEC_ATTN_FUSED_COMBINE asks for it:
        # the draft takes counters of its own, as its own model's layers.
        # The attention's step inputs and older keys read before its PDL wait, where ASYNCSPEC_ATTN_EARLY_KV asks.
        use_fused_combine(self.model, self.device)
        use_early_kv(self.model, self.device)
        if self.spec is not None and isinstance(self.spec.proposer, DraftModelProposer):
            use_fused_combine(self.spec.proposer.model, self.device)
            use_early_kv(self.spec.proposer.model, self.device)
        self.cuda_graphs: CudaGraphForward | None = None
        """The target's graphs (captured with the KV cache); None runs every step eagerly."""
        self.draft_cuda_graphs: CudaGraphForward | None = None
        self.draft_on_target_graphs: CudaGraphForward | None = None
        """The draft model's graphs over the target's step inputs, one per mixed graph of the target
        (`_draft_on_target_inputs`)."""
        self.num_draft_on_target_steps = 0
        """Steps whose draft catch-up ran on the target's step inputs."""
        self._fused_token_write = os.environ.get(FUSED_TOKEN_WRITE_ENV, "1") != "0"
        """Whether the greedy decode tail writes its tokens inside the argmax's launches (read once, at start)."""
        self._draft_on_target = os.environ.get(DRAFT_ON_TARGET_INPUTS_ENV, "1") != "0"
        """Whether a plan that proposes nothing runs the draft on the target's step inputs (read once, at start)."""
        self.debug_invariants = False
        """Check at each boundary that no placeholder or out-of-vocabulary id is fed to a model, and
        report the device's computed counts with each step (tests; synchronizes the device)."""
        self._init_step_buffers()
        self._greedy_draft_steps: dict[tuple[int, int, int], CapturedGraph] = {}
        """(bucket, verification query length, drafts proposed) -> the draft's whole step after that
        verification graph's greedy tail (catch-up and proposals), captured when the draft model proposes."""
        self.num_greedy_draft_steps = 0
        """Steps whose draft work replayed one of `_greedy_draft_steps`."""
        self.draft_kv_validity: DraftKVValidity | None = None
        """Which blocks hold the draft's KV throughout (prefix caching with a draft model; set with the KV cache)."""
        self.num_draft_catch_up_passes = 0
        """Passes of the draft alone over tokens it lacks beyond its lag bound (tests and benchmarks read it)."""
        self._drafts_in_flight = False
        """Whether the step launched last verifies drafts (asynchronous loop): the next plan's counts are then
        optimistic."""
        self._greedy_verification: GreedyVerification | None = None
        """Greedy verification over the step's device buffers (a graph tail, or run eagerly)."""
        if self.spec is not None:
            self._greedy_verification = GreedyVerification(
                self.model.compute_logits,
                self._meta_dev,
                self.input_batch.token_ids,
                self.input_batch.num_computed_dev,
                self.spec,
            )

    def _init_step_buffers(self) -> None:
        """Per-step inputs go through these fixed buffers: no host or device allocation per step
        for them, and one host-to-device copy each."""
        n = self.config.max_num_seqs
        pin = self.device.type == "cuda"
        cols = self.input_batch.max_blocks_per_req
        # Two sets of pinned host buffers used in turn. A non-blocking copy reads its host buffer
        # whenever the GPU gets to it, and a step that samples nothing never waits for the GPU, so a
        # buffer is refilled only after the event of its previous copy (two steps back) has fired.
        # Rows of meta: batch row, num_computed_tokens, num_scheduled_tokens, sampling indices, whether
        # the row's computed count comes from the host (admitted this step) rather than the device,
        # per sampling request its draft positions, per request its writable KV slots, and per sampling request
        # its batch row (row 0 gathered by row 3, here so that no step launches that gather).
        self._meta_host = [torch.zeros((8, n), dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._block_table_host = [torch.zeros((n, cols), dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._copy_done: list[torch.cuda.Event | None] = [None, None]
        self._buffer_index = 0
        # What the device's meta and block tables hold since the last copy: a steady decode batch (the same
        # requests, counts and drafts; nothing admitted) copies neither, the device's counts being the truth.
        self._meta_on_device: tuple | None = None
        self._block_tables_on_device: tuple | None = None
        self.num_meta_copies = 0
        self.num_block_table_copies = 0
        self._meta_dev = torch.zeros((8, n), dtype=torch.int64, device=self.device)
        # The step's model inputs (and the target's CUDA graphs) live at these fixed addresses; the
        # block tables are both the copy target of the host table and the graphs' input.
        self._inputs = StaticInputs.allocate(n, self.config.max_num_batched_tokens, cols, self.device)
        self._block_table_dev = self._inputs.block_tables
        self._prepare_kernel = select_backend(self.device).prepare_inputs
        k = self.spec.k if self.spec is not None else 0
        self._draft_slots = torch.arange(max(k, 1), dtype=torch.int64, device=self.device)
        # The step's one device-to-host copy lands here (sampled tokens, accepted and draft counts,
        # logprobs): two buffers, since the next step's copy is queued before this one is read.
        size = max(n * (k + 3) + n * (k + 1) * (2 * (MAX_LOGPROBS + 1) + 1), n * self.config.max_scheduler_steps)
        self._output_host = [torch.zeros(size, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._output_ready = [torch.cuda.Event() for _ in range(2)] if pin else None
        self._output_index = 0
        # Looked up once: torch.cuda.current_stream() resolves the device on every call.
        self._stream = torch.cuda.current_stream(self.device) if pin else None
        # Timed events around each step measure the device's idle time between steps; three pairs,
        # since a step's are read at its collection, after the next step was launched.
        self._step_events: tuple[list[torch.cuda.Event], list[torch.cuda.Event]] | None = None
        if pin:
            self._step_events = tuple([torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(2))  # type: ignore[assignment]
        self._num_timed_steps = 0
        self._pending_start: torch.cuda.Event | None = None
        self._cpu_step_end: float | None = None
        self.last_device_idle_seconds: float | None = None
        """Device idle before the last collected step (CUDA events); None on the CPU or when not measured."""
        self.last_wait_seconds = 0.0
        """Host time the last `collect` spent blocked on the step's results (the adaptive multi-step's input)."""
        # On the CPU in asynchronous mode a worker thread plays the CUDA stream: it runs the steps
        # in launch order while the engine plans the next one.
        self._closed = False
        self._cpu_stream: concurrent.futures.ThreadPoolExecutor | None = None
        if self.config.use_async_scheduling and not pin:
            self._cpu_stream = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="asyncspec-cpu-stream")

    def check_health(self) -> None:
        """Nothing to check in-process (the executor of tensor parallelism watches its workers)."""

    def call_on_stream(self, fn: Callable[[], Any]) -> Any:
        """Runs fn where the steps run and returns its result: on the CPU stream's thread (the
        asynchronous loop on the CPU), after the steps submitted before it; else here. A profiler
        started elsewhere would not see the steps' operations."""
        if self._cpu_stream is None:
            return fn()
        return self._cpu_stream.submit(fn).result()

    def close(self) -> None:
        """Stops the CPU stream's thread (after the step it is running); idempotent. Steps launched
        afterwards raise EngineDeadError."""
        self._closed = True
        if self._cpu_stream is not None:
            self._cpu_stream.shutdown(wait=True)

    # -- KV cache ---------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        """Target KV plus the draft model's KV (same block ids) per block."""
        draft = self.spec.kv_bytes_per_token if self.spec is not None else 0
        return (self.model_config.kv_bytes_per_token(self.dtype, self.tp.size) + draft) * self.block_size

    def determine_num_kv_blocks(self) -> int:
        """The pool size from the config, or from available host memory on the CPU (a quarter of it, shared by
        the tensor-parallel ranks)."""
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if cfg.kv_cache_bytes is not None:
            return num_blocks_for_bytes(cfg.kv_cache_bytes, self.bytes_per_block)
        if self.device.type == "cuda":
            return self._profile_num_kv_blocks()
        # Every rank of a tensor-parallel group is a process on this host, each with a pool of its own.
        share = _available_host_memory() * _CPU_KV_MEMORY_FRACTION / self.tp.size
        by_memory = int(share) // self.bytes_per_block
        # More than every request at full length is never useful.
        full_need = cfg.max_num_seqs * -(-self.max_model_len // self.block_size)
        return max(1, min(by_memory, full_need))

    def _profile_num_kv_blocks(self) -> int:
        """Free memory after the weights and one forward pass at the full token budget, within
        gpu_memory_utilization, divided into blocks."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        with self._device_context():
            self.dummy_run(self.config.max_num_batched_tokens)
        torch.cuda.synchronize(self.device)
        peak_torch = torch.cuda.max_memory_allocated(self.device)
        # Penalty statistics are allocated on the first penalised request, after the pool exists:
        # keep room for them (float32 counts + bool mask per row and vocab entry).
        penalty_tables = self.config.max_num_seqs * self.model_config.vocab_size * 5
        # Likewise the draft model's sampling distributions (float32 per row, draft position and token).
        if self.spec is not None and self.spec.uses_draft_model:
            penalty_tables += self.config.max_num_seqs * self.spec.k * self.model_config.vocab_size * 4
        graph_memory = self._estimate_cuda_graph_memory() if self.uses_cuda_graphs else 0
        start = self.memory_at_start
        assert start is not None  # taken in __init__ on CUDA
        budget = kv_cache_budget(
            start,
            MemorySnapshot.take(self.device),
            self.config.gpu_memory_utilization,
            peak_torch,
            penalty_tables + graph_memory,
        )
        torch.cuda.empty_cache()
        if budget < self.bytes_per_block:
            raise ConfigError(
                f"no GPU memory is left for the KV cache: the model and activations take "
                f"{(peak_torch - start.torch_allocated) / 2**30:.2f} GiB of this engine's "
                f"{start.total * self.config.gpu_memory_utilization / 2**30:.2f} GiB (gpu_memory_utilization="
                f"{self.config.gpu_memory_utilization}); raise it or lower max_num_batched_tokens"
            )
        return budget // self.bytes_per_block

    @torch.inference_mode()
    def dummy_run(self, num_tokens: int) -> None:
        """A forward pass and a sampling step at `num_tokens` tokens, writing no KV (slots -1), for
        memory profiling and warm-up."""
        mc = self.model_config
        dev = self.device
        num_reqs = max(1, min(self.config.max_num_seqs, num_tokens))
        q_lens = [num_tokens // num_reqs + (1 if i < num_tokens % num_reqs else 0) for i in range(num_reqs)]
        cache_shape = (1, self.block_size, mc.kv_heads_per_rank(self.tp.size), mc.head_dim)
        caches = [(torch.zeros(cache_shape, dtype=self.dtype, device=dev),) * 2 for _ in range(mc.num_hidden_layers)]
        query_start_loc = torch.tensor([0] + list(np.cumsum(q_lens)), dtype=torch.int32, device=dev)
        seq_lens = torch.tensor(q_lens, dtype=torch.int32, device=dev)
        cols = -(-max(q_lens) // self.block_size)
        metadata = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=dev),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=torch.zeros((num_reqs, cols), dtype=torch.int32, device=dev),  # all keys read block 0
            max_query_len=max(q_lens),
            max_seq_len=max(q_lens),
            block_size=self.block_size,
        )
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        positions = torch.cat([torch.arange(q, device=dev) for q in q_lens])
        hidden = self.model(input_ids, positions, caches, metadata)
        logits = self.model.compute_logits(hidden[query_start_loc[1:].long() - 1])
        params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50)] * num_reqs
        self.sampler(logits, SamplingMetadata.from_params(params, device=dev), self.default_generator)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = self.model_config.allocate_kv_cache(
            num_blocks, self.block_size, self.dtype, self.device, self.tp.size
        )
        if self.spec is not None:
            self.spec.initialize_kv_cache(num_blocks)
            if self.spec.uses_draft_model and self.config.enable_prefix_caching:
                self.draft_kv_validity = DraftKVValidity(num_blocks, self.block_size)
        if self.uses_cuda_graphs:
            with self._device_context():
                self._capture_cuda_graphs()
        if self.device.type == "cuda":
            with self._device_context():
                self._compile_attention_variants()
                if self.spec is not None:
                    start = time.perf_counter()
                    calls = self.spec.compile_kernel_variants(self._speculation_choices())
                    torch.cuda.synchronize(self.device)
                    logger.info("rejection kernel variants: %d calls in %.2f s", calls, time.perf_counter() - start)

    def _compile_attention_variants(self) -> None:
        """Every attention tile variant of the target and the draft, compiled at start-up rather than by the first
        eager step that needs it (`Attention.compile_kernel_variants`)."""
        start = time.perf_counter()
        models = [(self.model, self.kv_caches)]
        if self.spec is not None and isinstance(self.spec.proposer, DraftModelProposer):
            models.append((self.spec.proposer.model, self.spec.proposer.kv_caches))
        calls = 0
        for model, kv_caches in models:
            layouts = set()
            for module in model.modules():
                if isinstance(module, Attention) and kv_caches:
                    layout = (
                        module.num_heads,
                        module.num_kv_heads,
                        module.head_dim,
                        module.scale,
                        module.sliding_window,
                    )
                    if layout not in layouts:
                        layouts.add(layout)
                        calls += module.compile_kernel_variants(kv_caches[0], self.dtype)
        torch.cuda.synchronize(self.device)
        logger.info("attention kernel variants: %d calls in %.2f s", calls, time.perf_counter() - start)

    # -- CUDA graphs ------------------------------------------------------------------------
    @property
    def uses_cuda_graphs(self) -> bool:
        """Graphs need CUDA and the Triton kernels (the torch reference attention reads lengths on
        the host), and are off with enforce_eager."""
        return (
            self.device.type == "cuda"
            and not self.config.enforce_eager
            and select_backend(self.device).name == "triton"
        )

    def _graph_batch_sizes(self) -> list[int]:
        limit = self.config.cuda_graph_max_batch_size or self.config.max_num_seqs
        return batch_size_buckets(min(limit, self.config.max_num_seqs))

    def _graph_plan(self) -> list[tuple[torch.nn.Module, ModelConfig, list[int]]]:
        """(model, its config, query lengths of its uniform steps): the target's decode (1) or
        verification (k + 1); the draft's proposal passes (1) and its catch-up over a verification
        step (k + 2: the step's inputs plus the emitted token)."""
        if self.spec is None:
            return [(self.model, self.model_config, [1])]
        choices = self._speculation_choices()
        plan: list[tuple[torch.nn.Module, ModelConfig, list[int]]] = [
            (self.model, self.model_config, [c + 1 for c in choices])
        ]
        proposer = self.spec.proposer
        if isinstance(proposer, DraftModelProposer):
            plan.append((proposer.model, proposer.model_config, sorted({1} | {c + 2 for c in choices})))
        return plan

    def _speculation_choices(self) -> list[int]:
        """The k values a step may verify: the adaptive policy's choices, or k alone."""
        assert self.spec is not None
        return speculation_choices(self.spec.k) if self.config.adaptive_speculation else [self.spec.k]

    def speculation_step_cost(self) -> StepCost | None:
        """Device seconds of a steady decode step verifying and proposing k drafts for n requests, from the
        graphs' replay times: target verification, plus the draft's catch-up and k - 1 proposal passes. A steady
        k = 0 step leaves the draft alone (`_skips_draft`) until its lag reaches max_lag, and the next step catches
        up: one pass of max_lag + 1 tokens a request every max_lag + 1 steps, priced as a one-token pass plus
        max_lag times what a second token adds to it (its 2-token graph's time over the 1-token one's). That
        errs low where the pass is compute-bound, on the side of k = 0 (the plain engine's speed), which
        speculation must never fall below; charging k = 0 a whole draft pass a step kept a GPU-bound batch
        speculating where k = 0 was faster. None without speculation or graphs (the policy then keeps k fixed)."""
        target, draft = self.cuda_graphs, self.draft_cuda_graphs
        if self.spec is None or target is None or not self.config.adaptive_speculation:
            return None
        max_lag = self.config.max_draft_lag

        def step_cost(num_decodes: int, k: int) -> float:
            assert target is not None
            seconds = target.replay_cost(num_decodes, k + 1)
            if draft is None:
                return seconds
            if k == 0:
                one_token = draft.replay_cost(num_decodes, 1)
                per_token = max(draft.replay_cost(num_decodes, 2) - one_token, 0.0)
                return seconds + (one_token + max_lag * per_token) / (max_lag + 1)
            return seconds + draft.replay_cost(num_decodes, k + 2) + (k - 1) * draft.replay_cost(num_decodes, 1)

        return step_cost

    def _mixed_graph_sizes(self, static: StaticInputs) -> list[tuple[int, int]]:
        """The mixed graphs of a model over `static` (its step buffers): up to cuda_graph_max_tokens or the
        buffers' tokens. None under tensor parallelism: their all-reduces are untested on several GPUs."""
        if self.tp.size > 1:
            return []
        limit = static.input_ids.shape[0]
        if self.config.cuda_graph_max_tokens is not None:
            limit = min(limit, self.config.cuda_graph_max_tokens)
        max_reqs = min(self.config.max_num_seqs, static.query_start_loc.shape[0] - 1)
        return mixed_graph_sizes(max_reqs, limit, self.max_model_len)

    def _new_graphs(
        self,
        model,
        kv_caches,
        query_lens: list[int],
        batch_sizes: list[int],
        static: StaticInputs,
        mixed_sizes: list[tuple[int, int]],
    ) -> CudaGraphForward:
        """Graphs over `static`: the target's step buffers, the draft's, or buffers of their own (the memory
        estimate). The target's graphs get a greedy tail: sampling after a plain decode (without speculation),
        verification after a speculative step's forward pass (with it)."""
        tail: GreedyDecodeTail | GreedyStepTail | None = None
        tail_query_lens: list[int] = []
        if model is self.model:
            decode_tail = GreedyDecodeTail(self.model, self._meta_dev, self.input_batch, self._fused_token_write)
            if self._greedy_verification is None:
                tail, tail_query_lens = decode_tail, [1]
            else:
                # A speculating engine's steps at k = 0 (one token a request) sample with the decode tail.
                tail, tail_query_lens = GreedyStepTail(decode_tail, self._greedy_verification), query_lens
        graph_inputs = static is self._inputs and os.environ.get(GRAPH_STEP_INPUTS_ENV, "1") != "0"
        return CudaGraphForward(
            model,
            kv_caches,
            self.block_size,
            static,
            batch_sizes,
            query_lens,
            self.device,
            tail=tail,
            tail_query_lens=tail_query_lens,
            head=PaddedStepInputs(self._inputs, self._prepare_kernel, self._meta_dev, self.input_batch, self.block_size)
            if graph_inputs
            else None,
            mixed_sizes=mixed_sizes,
        )

    def _graph_inputs(self, model: torch.nn.Module) -> StaticInputs:
        """The step buffers a model's graphs read: the target's, or the draft's own."""
        if model is self.model:
            return self._inputs
        assert self.spec is not None and isinstance(self.spec.proposer, DraftModelProposer)
        return self.spec.proposer.inputs

    def _only_greedy(self, num_reqs: int, num_sampling: int) -> bool:
        """Every request samples this step, and every row of the batch (counted whether scheduled or
        not) is greedy with nothing the eager sampler adds (penalties, logprobs, a min_tokens block):
        the step's sampling needs no metadata, so a tail graph can do it."""
        if num_sampling != num_reqs:  # a request mid-prompt: its "next token" slot holds the prompt
            return False
        return self._batch_only_greedy()

    def _batch_only_greedy(self) -> bool:
        """Every row of the batch is greedy with nothing the eager sampler adds (penalties, logprobs, a min_tokens
        block): its sampling is the argmax alone, and needs no sampling metadata."""
        counts = self.input_batch.feature_counts
        return not (counts["random"] or counts["penalties"] or counts["logprobs"] or counts["min_tokens"])

    def _greedy_in_graph(self, step: StepInputs, num_reqs: int, num_sampling: int) -> bool:
        """Whether this step's sampling is the decode tail already captured in its graph: a graphed
        step of one token per request that needs nothing but the argmax."""
        graphs = self.cuda_graphs
        if graphs is None or step.graph_bucket is None or step.query_len != 1:
            return False
        return self._only_greedy(num_reqs, num_sampling) and graphs.has_tail(step.graph_bucket, 1)

    def _estimate_cuda_graph_memory(self) -> int:
        """Captures the largest bucket of each model (and its largest mixed graph) over a one-block KV cache
        and measures its pool: the smaller graphs share that pool, so this is what the real capture will hold."""
        largest = self._graph_batch_sizes()[-1:]
        total = 0
        for model, mc, query_lens in self._graph_plan():
            tp_size = self.tp.size if model is self.model else 1
            caches = mc.allocate_kv_cache(1, self.block_size, self.dtype, self.device, tp_size)
            mixed = self._mixed_graph_sizes(self._graph_inputs(model))[-1:]
            max_tokens = max([largest[0] * max(query_lens), *(t for _, t in mixed)])
            static = StaticInputs.allocate(
                max([largest[0], *(r for r, _ in mixed)]), max_tokens, self.input_batch.max_blocks_per_req, self.device
            )
            with self._device_context(), self._graph_kernels():
                total += self._new_graphs(model, caches, query_lens, largest, static, mixed).capture().memory_bytes
            del caches, static
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self._forget_device_inputs()
        # The draft's graphs over the target's mixed steps share the draft's pool; their outputs stay allocated.
        if self.spec is not None and isinstance(self.spec.proposer, DraftModelProposer):
            hidden_bytes = self.spec.proposer.model_config.hidden_size * self.dtype.itemsize
            total += sum(t for _, t in self._draft_on_target_mixed_sizes()) * hidden_bytes
        # Each smaller graph adds a little (kernel parameters, allocator rounding).
        return int(total * 1.1)

    def _forget_device_inputs(self) -> None:
        """Capture overwrote the device's step buffers: the next step copies its meta and block tables."""
        self._meta_on_device = None
        self._block_tables_on_device = None

    def _use_skinny(self, skinny: SkinnyLinear | None) -> None:
        use_skinny_linear(self.model, skinny)
        if self.spec is not None and isinstance(self.spec.proposer, DraftModelProposer):
            use_skinny_linear(self.spec.proposer.model, skinny)

    @contextlib.contextmanager
    def _graph_kernels(self) -> Iterator[None]:
        """The models' linear layers as graphs capture them: the skinny kernel for every size it takes.
        Every size of the graphs' warm-up and capture compiles its kernel variants at start-up; an eager step
        (a prefill chunk, a batch past the buckets) keeps the kernel to its few rows and so never compiles one
        mid-run. The memory estimate captures under it too, so that it measures what the capture will hold."""
        if self._skinny is None:
            yield
            return
        self._use_skinny(self._skinny_graphed)
        try:
            yield
        finally:
            self._use_skinny(self._skinny)

    def _capture_cuda_graphs(self) -> None:
        with self._graph_kernels():
            self._capture_all_graphs()

    def _capture_all_graphs(self) -> None:
        batch_sizes = self._graph_batch_sizes()
        self._meta_dev.zero_()  # the step-input graphs' warm-up runs for real: every request of it is padding
        for model, _, query_lens in self._graph_plan():
            is_target = model is self.model
            name = "target" if is_target else "draft"
            kv_caches = self.kv_caches if is_target else self.spec.proposer.kv_caches  # type: ignore[union-attr]
            static = self._graph_inputs(model)
            mixed = self._mixed_graph_sizes(static)
            graphs = self._new_graphs(model, kv_caches, query_lens, batch_sizes, static, mixed)

            def progress(done: int, total: int, name: str = name) -> None:
                if done == total or done % 8 == 0:
                    logger.info("capturing CUDA graphs of the %s model: %d/%d", name, done, total)

            stats = graphs.capture(progress)
            logger.info(
                "captured %d CUDA graphs of the %s model (batch sizes %s x query lengths %s; mixed steps up to %d "
                "tokens) in %.2f s, %.1f MiB",
                stats.num_graphs,
                name,
                batch_sizes,
                query_lens,
                max((t for _, t in mixed), default=0),
                stats.seconds,
                stats.memory_bytes / 2**20,
            )
            if is_target:
                self.cuda_graphs = graphs
            else:
                self.draft_cuda_graphs = graphs
                proposer = self.spec.proposer  # type: ignore[union-attr]
                assert isinstance(proposer, DraftModelProposer)
                proposer.graphs = graphs
                start = time.perf_counter()
                choices = self._speculation_choices()
                num_loops = proposer.capture_proposal_loops(batch_sizes, choices)
                logger.info(
                    "captured %d CUDA graphs of the draft's greedy proposal loop (%s proposals) in %.2f s",
                    num_loops,
                    [c for c in choices if c > 1],
                    time.perf_counter() - start,
                )
                if os.environ.get(GREEDY_DRAFT_STEP_GRAPH_ENV, "1") != "0":
                    self._capture_greedy_draft_steps(graphs)
                self._capture_draft_on_target_graphs(graphs)
        self._forget_device_inputs()

    def _draft_on_target_mixed_sizes(self) -> list[tuple[int, int]]:
        """The mixed graphs of the target that get a draft graph over the same inputs (none when the switch is off)."""
        if self.spec is None or not self.spec.uses_draft_model or not self._draft_on_target:
            return []
        return self._mixed_graph_sizes(self._inputs)

    def _capture_draft_on_target_graphs(self, draft_graphs: CudaGraphForward) -> None:
        """For each mixed graph of the target: the draft's forward pass over the same step inputs, in the draft
        graphs' pool (they never run at the same time)."""
        assert self.spec is not None and isinstance(self.spec.proposer, DraftModelProposer)
        mixed = self._draft_on_target_mixed_sizes()
        if not mixed:
            return
        proposer = self.spec.proposer
        graphs = CudaGraphForward(
            proposer.model,
            proposer.kv_caches,
            self.block_size,
            self._inputs,
            [],
            [],
            self.device,
            mixed_sizes=mixed,
            pool=draft_graphs.pool,
        )
        stats = graphs.capture()
        self.draft_on_target_graphs = graphs
        logger.info(
            "captured %d CUDA graphs of the draft over the target's mixed steps in %.2f s, %.1f MiB",
            stats.num_graphs,
            stats.seconds,
            stats.memory_bytes / 2**20,
        )

    def _capture_greedy_draft_steps(self, draft_graphs: CudaGraphForward) -> None:
        """For each verification graph with a greedy tail: the draft's whole step after it (catch-up,
        proposals, drafts recorded and placed), one graph reading the tail's results. One per count of
        proposals the adaptive policy may ask for (above 0), not only the verified k: a step where the policy
        changes k (verify 4, propose 1, say) would otherwise run the draft's step eagerly, which took 1.1-1.7 ms
        against some 0.2 ms for a steady step at batch 1 on an H200 (docs/benchmarks.md, nineteenth session)."""
        assert self.cuda_graphs is not None and self.spec is not None
        proposer = self.spec.proposer
        assert isinstance(proposer, DraftModelProposer)
        start = time.perf_counter()
        self._meta_dev.zero_()  # warm-up runs for real: every request of it is padding
        self._forget_device_inputs()
        transitions = os.environ.get(TRANSITION_DRAFT_STEP_GRAPH_ENV, "1") != "0"
        counts = [c for c in self._speculation_choices() if 0 < c <= self.spec.k]
        for (bucket, query_len), result in self.cuda_graphs.tail_outputs().items():
            if query_len == 1:
                continue  # a decode tail at k = 0: no draft step follows it from a graph
            for num_proposals in sorted({query_len - 1, *(counts if transitions else [])}):
                step = functools.partial(self._greedy_draft_step, proposer, bucket, query_len, num_proposals, result)
                self._greedy_draft_steps[(bucket, query_len, num_proposals)] = draft_graphs.capture_function(step)
        logger.info(
            "captured %d CUDA graphs of the draft's step after a greedy verification in %.2f s",
            len(self._greedy_draft_steps),
            time.perf_counter() - start,
        )

    def _greedy_draft_step(
        self,
        proposer: DraftModelProposer,
        bucket: int,
        query_len: int,
        num_proposals: int,
        verified: GreedyVerifyResult,
    ) -> None:
        assert self.spec is not None
        token_ids = self.input_batch.token_ids
        meta = self._meta_dev
        drafts = proposer.greedy_step(
            meta, self._block_table_dev, token_ids, verified.num_accepted, bucket, query_len, num_proposals
        )
        self.spec.record_greedy_drafts(token_ids, meta, verified.new_num_tokens[:bucket], drafts)

    def graph_stats(self) -> dict[str, int]:
        """Forward passes replayed from a CUDA graph and run eagerly, target and draft together, and
        the decode steps whose greedy sampling replayed the decode tail."""
        graphs = [g for g in (self.cuda_graphs, self.draft_cuda_graphs, self.draft_on_target_graphs) if g is not None]
        counts = (
            sum(g.num_replays for g in graphs),
            sum(g.num_decode_tail_replays for g in graphs),
            sum(g.num_verify_tail_replays for g in graphs),
            self.spec.proposer.num_loop_replays if self.spec is not None and self.spec.uses_draft_model else 0,  # type: ignore[union-attr]
            self.num_greedy_draft_steps,
            sum(g.num_eager for g in graphs),
            sum(g.num_mixed_replays for g in graphs),
            sum(g.num_head_replays for g in graphs),
            self.num_meta_copies,
            self.num_block_table_copies,
            self.num_draft_on_target_steps,
        )
        return dict(zip(GRAPH_STATS, counts, strict=True))

    def _forward(self, step: StepInputs) -> torch.Tensor:
        """The target's forward pass: a graph replay for a uniform batch, else eager."""
        if self.debug_invariants:
            check_token_ids(step.input_ids, self.model_config.vocab_size, "the target's embedding")
        if step.graph_bucket is not None:
            assert self.cuda_graphs is not None
            return self.cuda_graphs.replay(step.graph_bucket, step.query_len, step.num_tokens)
        if step.mixed_graph is not None:
            assert self.cuda_graphs is not None
            return self.cuda_graphs.replay_mixed(step.mixed_graph, step.num_tokens)
        if self.cuda_graphs is not None:
            self.cuda_graphs.num_eager += 1
        return self.model(step.input_ids, step.positions, self.kv_caches, step.metadata)

    def _copy_to_host(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The step's one device-to-host copy: int64 tensors, concatenated, non-blocking into pinned
        memory, then an event. Returns (host tensor, event); the caller waits for the event."""
        flat = torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) > 1 else tensors[0].reshape(-1)
        if self._output_ready is None:
            return flat, None
        i = self._output_index
        self._output_index ^= 1
        host = self._output_host[i][: flat.shape[0]]
        host.copy_(flat, non_blocking=True)
        ready = self._output_ready[i]
        ready.record(self._stream)
        return host, ready

    # -- one step -----------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> tuple[dict[str, str], set[str]]:
        """Applies the step's differences to the persistent batch. Returns the new requests that
        could not be admitted (id -> reason: they fail alone and sit out the step), and the ids
        admitted (their computed counts come from the host this step)."""
        batch = self.input_batch
        # Sorted: freed rows are reused last-in first-out, and tensor-parallel ranks (processes with
        # their own string hashing) must give each request the same row.
        parks = self.spec is not None and self.spec.uses_draft_model
        for request_id in sorted(so.finished_req_ids):
            batch.remove_request(request_id)
            if parks:
                self.spec.drop_parked_drafts(request_id)  # type: ignore[union-attr]
        for request_id in sorted(so.preempted_req_ids):
            state = batch.rows.get(request_id)
            if (
                parks
                and state is not None
                and state.generator is not None
                and not state.sampling_params.is_greedy
                and (state.output_token_ids or state.num_computed_tokens >= state.num_tokens)
            ):
                # Its seeded stream has drawn the randomness of its drafts: the decode after its recompute
                # verifies these, as the interrupted step would have. Also when the step that samples its first
                # token is launched but not yet collected (on a GPU, collect comes after the next plan's launch):
                # that step proposes the drafts, and the park, stream-ordered after it, copies them. Not while its
                # prompt is unfinished: its row holds no drafts of its own yet, and an empty park would shadow the
                # real ones of a later preemption.
                self.spec.park_drafts(request_id, state.row)  # type: ignore[union-attr]
            batch.remove_request(request_id, preempted=True)
        failed: dict[str, str] = {}
        admitted: set[str] = set()
        admitted_rows: list[int] = []
        for data in so.scheduled_new_reqs:
            try:
                state = batch.add_request(data, write_device=False)
            except Exception as e:  # one request's bad data must not end the others' streams
                if self.tp.enabled:
                    # A failure on one rank only (out of memory) would leave the ranks computing
                    # different batches, whose collectives never match: the rank stops instead.
                    raise
                logger.warning("request %s failed at admission to the worker: %r", data.request_id, e)
                failed[data.request_id] = f"the worker could not admit the request: {e!r}"
            else:
                admitted.add(data.request_id)
                admitted_rows.append(state.row)
                if self.draft_kv_validity is not None:
                    self._admit_draft_kv(state)
        if admitted_rows:
            batch.write_admitted()
            if self.spec is not None:
                self.spec.reset_rows(admitted_rows)
        cached = so.scheduled_cached_reqs
        for request_id, new_blocks, num_computed in zip(
            cached.request_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            row_state = batch.rows.get(request_id)
            if row_state is None:
                # Its admission failed in a step the scheduler had not reconciled when it planned this
                # one (asynchronous loop): it sits this step out too; the scheduler ends it once.
                failed[request_id] = "the worker could not admit the request"
                continue
            if new_blocks:  # most decode steps add none: no call
                batch.append_blocks(row_state, new_blocks)
                if self.draft_kv_validity is not None:
                    self.draft_kv_validity.allocated(new_blocks, row_state.draft_lag == 0)
            row_state.num_computed_tokens = num_computed
        return failed, admitted

    def _admit_draft_kv(self, state: RowState) -> None:
        """A request admitted with computed tokens (a prefix-cache hit) has the draft's KV only up to the hit's
        first block without it: its draft lags by the rest and recomputes it when it next runs. Its other
        blocks are new."""
        validity = self.draft_kv_validity
        assert validity is not None
        computed = state.num_computed_tokens
        if computed:
            state.draft_lag = computed - validity.valid_prefix(state.block_ids, computed)
        validity.allocated(state.block_ids[computed // self.block_size :], state.draft_lag == 0)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One step, synchronously: launch, then collect."""
        return self.collect(self.launch(so))

    def launch(self, so: SchedulerOutput) -> StepHandle:
        """Queues the whole step on the device and returns at once: nothing here waits for the GPU.
        Steps run in launch order; a step may be launched before the previous one is collected."""
        if self._closed:
            raise EngineDeadError("the engine was shut down")
        if self._cpu_stream is not None:
            handle = StepHandle()
            handle.future = self._cpu_stream.submit(self._run_step, so, handle)
            return handle
        # Triton launches on the thread's current device, and AsyncEngine steps in its own thread.
        with self._device_context():
            if self._step_events is None:
                start = time.perf_counter()
                handle = self._launch(so)
                self._time_cpu_step(handle, start)
                return handle
            starts, ends = self._step_events
            i = self._num_timed_steps % 3
            # Recorded just before the step's first device work (its input copy), not at the call:
            # the host's bookkeeping before it leaves a synchronous loop's device idle.
            self._pending_start = starts[i]
            handle = self._launch(so)
            if self._pending_start is not None:  # a step with no device work
                self._pending_start.record(self._stream)
                self._pending_start = None
            ends[i].record(self._stream)
            # The first step after the engine ran dry has no bubble before it, only idleness.
            handle.timing_slot = i if self._num_timed_steps > 0 else None
            self._num_timed_steps += 1
            return handle

    def _run_step(self, so: SchedulerOutput, handle: StepHandle) -> ModelRunnerOutput:
        """The CPU worker thread's whole step (the CPU computes as it launches)."""
        start = time.perf_counter()
        output = self._finish(self._launch(so))
        self._time_cpu_step(handle, start)
        return output

    def _time_cpu_step(self, handle: StepHandle, start: float) -> None:
        """On the CPU the worker is the device: its idle time before a step is the time since it
        finished the previous one."""
        last = self._cpu_step_end
        handle.device_idle_seconds = start - last if last is not None and self._num_timed_steps > 0 else None
        self._num_timed_steps += 1
        self._cpu_step_end = time.perf_counter()

    def collect(self, handle: StepHandle) -> ModelRunnerOutput:
        """The step's results, once its copy landed (blocks until then; the engine calls it from its
        worker thread, after launching the next step). Every host-side update of the step happens
        here, in launch order."""
        wait_start = time.perf_counter()
        if handle.future is not None:
            output = handle.future.result()
            self.last_wait_seconds = time.perf_counter() - wait_start
        else:
            handle.wait()
            self.last_wait_seconds = time.perf_counter() - wait_start
            if handle.timing_slot is not None:
                self._measure_device_idle(handle)
            output = self._finish(handle)
        self.last_device_idle_seconds = handle.device_idle_seconds
        return output

    @staticmethod
    def _finish(handle: StepHandle) -> ModelRunnerOutput:
        if handle.finish is None:
            assert handle.output is not None
            output = handle.output
        else:
            assert handle.host is not None
            output = handle.finish(handle.host.numpy())
        if handle.debug_rows is not None and handle.debug_computed is not None:
            values = handle.debug_computed.tolist()
            output.device_num_computed_tokens = {r: values[row] for r, row in handle.debug_rows.items()}
        return output

    def _measure_device_idle(self, handle: StepHandle) -> None:
        """Device time between the previous step's last op and this step's first: the bubble. Read
        once both steps' events completed (this step's results are on the host, so they have)."""
        assert self._step_events is not None and handle.timing_slot is not None
        starts, ends = self._step_events
        previous_end, start = ends[(handle.timing_slot - 1) % 3], starts[handle.timing_slot]
        if previous_end.query() and start.query():
            handle.device_idle_seconds = max(previous_end.elapsed_time(start), 0.0) / 1e3

    def reset_device_idle(self) -> None:
        """The engine ran out of work: the next step's wait is idleness, not a bubble."""
        self._num_timed_steps = 0

    def set_debug_invariants(self, on: bool) -> None:
        self.debug_invariants = on
        if self.spec is not None and self.spec.uses_draft_model:
            self.spec.proposer.debug_invariants = on  # type: ignore[union-attr]

    def _device_context(self) -> contextlib.AbstractContextManager:
        # torch.cuda.device(...) costs tens of microseconds of Python per step; the thread is almost always on
        # the runner's device already.
        if self.device.type != "cuda" or torch.cuda.current_device() == self._device_index:
            return contextlib.nullcontext()
        return torch.cuda.device(self.device)

    def _launch(self, so: SchedulerOutput) -> StepHandle:
        handle = self._launch_step(so)
        # The next step's plan counts this step's drafts as accepted until it is retired (asynchronous loop).
        self._drafts_in_flight = bool(so.num_draft_positions) and self.config.use_async_scheduling
        if self.debug_invariants:
            rows = self.input_batch.rows
            handle.debug_rows = {r: rows[r].row for r in so.num_scheduled_tokens if r in rows}
            handle.debug_computed = self.input_batch.num_computed_dev.clone()
        return handle

    @torch.inference_mode()
    def _launch_step(self, so: SchedulerOutput) -> StepHandle:
        failed, admitted = self._update_states(so)
        scheduled = so.num_scheduled_tokens
        if failed:
            req_ids = [r for r in scheduled if r not in failed]
            num_scheduled = [scheduled[r] for r in req_ids]
        else:
            req_ids, num_scheduled = list(scheduled), list(scheduled.values())
        if not req_ids:
            return StepHandle(output=ModelRunnerOutput(req_ids=[], sampled_token_ids=[], failed_requests=failed))
        rows = self.input_batch.rows
        states = [rows[r] for r in req_ids]
        # Only requests whose scheduled tokens reach their last token sample this step. The host's
        # computed count is the plan's (optimistic) and its token count the last collected one: both
        # bounds hold the comparison exact (a prefill chunk's counts are exact).
        sampling_rows = [
            i
            for i, (s, n) in enumerate(zip(states, num_scheduled, strict=True))
            if s.num_computed_tokens + n >= s.num_tokens
        ]
        # Planned draft positions per sampling request (the scheduler's k for a decode).
        draft_positions = so.num_draft_positions
        num_draft_positions = (
            [draft_positions.get(req_ids[i], 0) for i in sampling_rows] if draft_positions else [0] * len(sampling_rows)
        )
        step = self._prepare_inputs(states, num_scheduled, sampling_rows, num_draft_positions, admitted)
        hidden_states = self._forward(step)
        # Only a chunk that does not sample can stop short of its request's tokens.
        if self.spec is not None and len(sampling_rows) < len(states):
            if self.spec.uses_draft_model:
                self._restore_after_recompute(states, num_scheduled)
            else:
                self._propose_after_recompute(states, num_scheduled, so.num_proposals)
        # The draft model's catch-up starts from the device's computed counts before this step (a view: only
        # speculation reads it, and indexing costs microseconds of host time).
        computed_before = self._meta_dev[1, : len(states)] if self.spec is not None else self._meta_dev[1]
        num_steps = so.num_steps
        for state, n in zip(states, num_scheduled, strict=True):
            state.num_computed_tokens += n * num_steps
        if num_steps > 1:
            if self.spec is not None and so.num_speculative_tokens:
                return self._launch_speculative_steps(req_ids, states, step, hidden_states, so, failed)
            if self.spec is not None:
                self._defer_draft(so, states, num_scheduled, computed_before)
            return self._launch_decode_steps(req_ids, states, step, hidden_states, num_steps, failed)
        if self.spec is not None and not self._samples_plainly(num_draft_positions):
            return self._verify_and_propose(
                req_ids,
                states,
                num_scheduled,
                sampling_rows,
                num_draft_positions,
                hidden_states,
                failed,
                so.num_proposals,
                computed_before,
                step,
            )
        if not sampling_rows:
            # The draft's KV follows every prefill chunk.
            if self.spec is not None and not self._draft_on_target_inputs(so, states, step, None):
                no_rows = torch.empty(0, dtype=torch.int64, device=self.device)
                self._propose_without_drafts(states, num_scheduled, [], no_rows, no_rows, None, so, computed_before)
            output = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[] for _ in req_ids], failed_requests=failed)
            return StepHandle(output=output)
        num_sampling = len(sampling_rows)
        sampling_states = [states[i] for i in sampling_rows]
        num_logprobs: int | None = None
        if self._greedy_in_graph(step, len(states), num_sampling):
            assert self.cuda_graphs is not None and step.graph_bucket is not None
            sampled = self.cuda_graphs.replay_tail(step.graph_bucket, 1)[:num_sampling]
            if self.input_batch.records_sampled:
                self.input_batch.record_sampled(self._meta_dev[0, :num_sampling], sampled)
            if self.spec is not None and not self._skip_draft_step(so, states, num_sampling):
                # A speculating engine's step at k = 0: every request samples, so its new token went to
                # column seq_len of its row.
                batch_rows = self._meta_dev[7, :num_sampling]
                new_num_tokens = step.inputs.seq_lens[:num_sampling].to(torch.int64) + 1
                self._propose_without_drafts(
                    states,
                    num_scheduled,
                    sampling_rows,
                    batch_rows,
                    new_num_tokens,
                    self._sampling_metadata(sampling_states, batch_rows),
                    so,
                    computed_before,
                )
            tensors = [sampled]
        else:
            attn_metadata = step.metadata
            sample_index = self._meta_dev[3, :num_sampling]
            last_token_index = attn_metadata.query_start_loc[1:].to(torch.int64) - 1
            last_hidden = hidden_states[last_token_index[sample_index]]
            batch_rows = self._meta_dev[7, :num_sampling]
            # The device token buffer is the source of truth for the next step's input ids; a
            # sampling request's new token goes at index seq_len (always < max_model_len).
            token_cols = attn_metadata.seq_lens.to(torch.int64).index_select(0, sample_index)
            metadata: SamplingMetadata | None = None
            out: SamplerOutput | None = None
            if self._fused_token_write and self._batch_only_greedy():
                # An eager step of an all-greedy batch (on a GPU, one with prompt chunks): the argmax writes the tokens
                # in its own launch and no sampling metadata is gathered. The sampler, the metadata and the torch
                # write took about a seventh of a prompt plan's launch at 128 streams on an H200.
                logits = self.model.compute_logits(last_hidden, float32=False)
                sampled = greedy_sample_into_tokens(logits, self.input_batch.token_ids, batch_rows, token_cols)
            else:
                logits = self.model.compute_logits(last_hidden)
                metadata = self._sampling_metadata(sampling_states, batch_rows)
                out = self.sampler(logits, metadata, self.default_generator)
                sampled = out.sampled_token_ids
                self.input_batch.write_sampled_tokens(batch_rows, token_cols, sampled)
            self.input_batch.record_sampled(batch_rows, sampled)
            if (
                self.spec is not None
                and not self._skip_draft_step(so, states, num_sampling)
                and not self._draft_on_target_inputs(so, states, step, batch_rows)
            ):
                if metadata is None:  # the draft's own step samples its proposals with it
                    metadata = self._sampling_metadata(sampling_states, batch_rows)
                self._propose_without_drafts(
                    states, num_scheduled, sampling_rows, batch_rows, token_cols + 1, metadata, so, computed_before
                )
            num_logprobs = metadata.max_num_logprobs if metadata is not None else None
            tensors = [sampled] + (_logprob_tensors(out) if out is not None and num_logprobs is not None else [])
        host, ready = self._copy_to_host(tensors)

        def finish(values: np.ndarray) -> ModelRunnerOutput:
            sampled_host = values[:num_sampling].tolist()
            if num_sampling == len(req_ids) and min(sampled_host) >= 0:
                # Every request sampled a valid token (a decode step): no per-request branches.
                sampled_per_req = [[token_id] for token_id in sampled_host]
                for state, token_id in zip(sampling_states, sampled_host, strict=True):
                    state.num_tokens += 1
                    state.output_token_ids.append(token_id)
            else:
                sampled_per_req = [[] for _ in req_ids]
                for i, state, token_id in zip(sampling_rows, sampling_states, sampled_host, strict=True):
                    if token_id == INVALID_TOKEN_ID:
                        failed[state.request_id] = (
                            "the sampler found no valid token: the logits were NaN, or every token was masked"
                        )
                        continue
                    state.num_tokens += 1
                    state.output_token_ids.append(token_id)
                    sampled_per_req[i] = [token_id]
            logprobs_per_req = None
            if num_logprobs is not None:
                ids, lps, ranks = _unpack_logprobs(values[num_sampling:], num_sampling, num_logprobs)
                logprobs_per_req = _logprobs_per_request(
                    ids, lps, ranks, sampling_rows, sampling_states, 1, sampled_per_req, len(req_ids)
                )
            return ModelRunnerOutput(
                req_ids=req_ids, sampled_token_ids=sampled_per_req, logprobs=logprobs_per_req, failed_requests=failed
            )

        return StepHandle(finish=finish, host=host, ready=ready)

    def _launch_decode_steps(
        self,
        req_ids: list[str],
        states: list[RowState],
        step: StepInputs,
        hidden_states: torch.Tensor,
        num_steps: int,
        failed: dict[str, str],
    ) -> StepHandle:
        """A plan of num_steps greedy decode steps (SchedulerOutput.num_steps): this step's forward pass ran;
        each step samples, and the next one builds its inputs on the device from the one before (the head
        resolves the computed counts the previous head advanced, and reads the token the previous tail
        wrote), so nothing but launches happens on the host between them. The tokens of every step come
        back in the plan's one copy."""
        num_reqs = len(states)
        if not self._only_greedy(num_reqs, num_reqs) or step.query_len != 1:
            raise RuntimeError(
                "a multi-step plan needs every request to be a plain greedy decode without drafts "
                "(Scheduler._multi_step_count)"
            )
        graphs = self.cuda_graphs
        bucket = step.graph_bucket
        in_graph = self._greedy_in_graph(step, num_reqs, num_reqs)
        tokens = torch.empty((num_steps, num_reqs), dtype=torch.int64, device=self.device)
        for j in range(num_steps):
            if j:
                self._next_step_inputs(step, num_reqs, 1)
                hidden_states = self._forward(step)
            if in_graph:
                assert graphs is not None and bucket is not None
                tokens[j] = graphs.replay_tail(bucket, 1)[:num_reqs]
            else:
                tokens[j] = self._eager_decode_tail(hidden_states, step.inputs, num_reqs)
        host, ready = self._copy_to_host([tokens])

        def finish(values: np.ndarray) -> ModelRunnerOutput:
            per_step = values[: num_steps * num_reqs].reshape(num_steps, num_reqs).T.tolist()
            sampled_per_req: list[list[int]] = []
            for state, sampled in zip(states, per_step, strict=True):
                if min(sampled) < 0:
                    failed[state.request_id] = (
                        "the sampler found no valid token: the logits were NaN, or every token was masked"
                    )
                    sampled_per_req.append([])
                    continue
                state.num_tokens += num_steps
                state.output_token_ids.extend(sampled)
                sampled_per_req.append(sampled)
            return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled_per_req, failed_requests=failed)

        return StepHandle(finish=finish, host=host, ready=ready)

    def _next_step_inputs(self, step: StepInputs, num_reqs: int, query_len: int) -> None:
        """A run's next step's inputs, built on the device from the device's counts (which the step before
        advanced): the bucket's head graph, or its kernel launched directly."""
        graphs, bucket = self.cuda_graphs, step.graph_bucket
        if bucket is not None and graphs is not None and graphs.has_head(bucket, query_len):
            graphs.replay_head(bucket, query_len)
            return
        padded = bucket if bucket is not None else num_reqs
        step.inputs.fill(
            self._prepare_kernel,
            self._meta_dev,
            padded,
            padded * query_len,
            self.input_batch.token_ids,
            self.block_size,
            resolve=(num_reqs, self.input_batch.num_computed_dev),
        )

    def _launch_speculative_steps(
        self,
        req_ids: list[str],
        states: list[RowState],
        step: StepInputs,
        hidden_states: torch.Tensor,
        so: SchedulerOutput,
        failed: dict[str, str],
    ) -> StepHandle:
        """A plan of num_steps greedy verification steps at k (SchedulerConfig.multi_step_speculation): this
        step's forward pass ran; each step verifies its k drafts greedily and the draft model, caught up on the
        emitted run, proposes the next step's k; the next step's inputs are built on the device from the
        device's counts (the head), so nothing but launches happens on the host between the steps. Every
        step's runs come back in the plan's one copy."""
        assert self.spec is not None
        num_reqs, num_steps, k = len(states), so.num_steps, so.num_speculative_tokens
        query_len = k + 1
        if (
            not self.spec.uses_draft_model
            or not self._only_greedy(num_reqs, num_reqs)
            or step.query_len != query_len
            or step.num_tokens != num_reqs * query_len
            or so.num_proposals != k
            or any(s.draft_lag for s in states)
        ):
            raise RuntimeError(
                "a multi-step speculative plan needs a draft model, greedy requests that all verify k drafts and "
                "propose k, and no draft lagging (Scheduler._multi_step_count)"
            )
        proposer = self.spec.proposer
        assert isinstance(proposer, DraftModelProposer)
        tokens = torch.empty((num_steps, num_reqs, query_len), dtype=torch.int64, device=self.device)
        accepted = torch.empty((num_steps, num_reqs), dtype=torch.int64, device=self.device)
        valid = torch.empty((num_steps, num_reqs), dtype=torch.int64, device=self.device)
        rows = self._meta_dev[7, :num_reqs]
        for j in range(num_steps):
            if j:
                self._next_step_inputs(step, num_reqs, query_len)
                hidden_states = self._forward(step)
            greedy = self._verify_greedily(hidden_states, step, num_reqs, num_reqs, query_len)
            tokens[j] = greedy.output_token_ids[:num_reqs, :query_len]
            accepted[j] = greedy.num_accepted[:num_reqs]
            valid[j] = greedy.num_valid_drafts[:num_reqs]
            if self.input_batch.records_sampled:
                out = tokens[j]
                self.input_batch.record_sampled(rows.unsqueeze(1).expand_as(out).reshape(-1), out.reshape(-1))
            if not self._replay_greedy_draft_step(step, states, k):
                # The same function as the graph, eagerly, over the rows the verification covered.
                self._greedy_draft_step(proposer, greedy.num_accepted.shape[0], query_len, k, greedy)
        host, ready = self._copy_to_host([tokens, accepted, valid])

        def finish(values: np.ndarray) -> ModelRunnerOutput:
            width = num_steps * num_reqs * query_len
            runs = values[:width].reshape(num_steps, num_reqs, query_len).transpose(1, 0, 2)
            lens = values[width : width + num_steps * num_reqs].reshape(num_steps, num_reqs).T + 1
            verified = values[width + num_steps * num_reqs : width + 2 * num_steps * num_reqs]
            verified = verified.reshape(num_steps, num_reqs).T
            # Each request's emitted tokens, its steps' runs in a row: one selection over the whole plan (in request,
            # step, position order) instead of a list per request and step.
            emitted = runs[np.arange(query_len) < lens[:, :, None]]
            ends = np.cumsum(lens.sum(axis=1))
            starts = ends - lens.sum(axis=1)
            invalid: set[int] = set()
            if emitted.min() < 0:
                invalid.update(np.flatnonzero(np.minimum.reduceat(emitted, starts) < 0).tolist())
            emitted_list, bounds = emitted.tolist(), zip(starts.tolist(), ends.tolist(), strict=True)
            lens_list, verified_list, num_drafts = lens.tolist(), verified.tolist(), verified.sum(axis=1).tolist()
            sampled_per_req: list[list[int]] = []
            num_drafts_per_req: list[int] = []
            step_runs: list[list[tuple[int, int]]] = []
            for i, (state, (start, end)) in enumerate(zip(states, bounds, strict=True)):
                if i in invalid:
                    failed[state.request_id] = (
                        "the sampler found no valid token: the logits were NaN, or every token was masked"
                    )
                    sampled_per_req.append([])
                    num_drafts_per_req.append(0)
                    step_runs.append([])
                    continue
                run = emitted_list[start:end]
                state.num_tokens += end - start
                state.output_token_ids.extend(run)
                sampled_per_req.append(run)
                num_drafts_per_req.append(num_drafts[i])
                step_runs.append(list(zip(verified_list[i], lens_list[i], strict=True)))
            return ModelRunnerOutput(
                req_ids=req_ids,
                sampled_token_ids=sampled_per_req,
                num_draft_tokens=num_drafts_per_req,
                step_runs=step_runs,
                failed_requests=failed,
            )

        return StepHandle(finish=finish, host=host, ready=ready)

    def _defer_draft(
        self, so: SchedulerOutput, states: list[RowState], num_scheduled: list[int], computed_before: torch.Tensor
    ) -> None:
        """A multi-step plan of a speculating engine verifies nothing and proposes nothing (the policy chose
        k = 0 for it and the next plan), so it leaves the draft model alone: each request's draft falls the
        plan's steps behind and its next pass catches up on them. Where that would pass the proposer's bound,
        the draft first catches up through the plan's first step (whose input tokens are known), and falls
        behind by the other steps only."""
        assert self.spec is not None
        if so.num_speculative_tokens or so.num_proposals:
            raise RuntimeError("a multi-step plan must verify and propose no drafts (Scheduler.schedule)")
        if not self.spec.uses_draft_model:
            return  # the n-gram proposer keeps no per-step state: it drafts from the token buffer when asked
        num_steps = so.num_steps
        max_lag = self.spec.proposer.max_lag  # type: ignore[union-attr]
        if num_steps - 1 > max_lag:
            raise RuntimeError(
                f"a multi-step plan of {num_steps} steps passes the draft's lag bound {max_lag} "
                "(SchedulerConfig.max_draft_lag)"
            )
        if max(state.draft_lag for state in states) + num_steps > max_lag:
            self._catch_up_draft(states, num_scheduled, computed_before)
            num_steps -= 1
        self._fall_behind(states, [num_steps] * len(states))

    def _catch_up_draft(self, states: list[RowState], num_scheduled: list[int], computed_before: torch.Tensor) -> None:
        """The draft model's pass over this step's tokens and each request's lag, proposing nothing."""
        assert self.spec is not None
        no_rows = torch.empty(0, dtype=torch.int64, device=self.device)
        catch_up = self._draft_step(states, num_scheduled, [], [], no_rows, None, 0, computed_before)
        self.spec.propose(self.input_batch.token_ids, no_rows, no_rows, 0, catch_up, 0)

    def _eager_decode_tail(self, hidden_states: torch.Tensor, inputs: StaticInputs, num_reqs: int) -> torch.Tensor:
        """The decode graph's greedy tail, run eagerly (a step with no graph)."""
        tail = GreedyDecodeTail(self.model, self._meta_dev, self.input_batch, self._fused_token_write)
        return tail(hidden_states, inputs, num_reqs)

    def _propose_after_recompute(self, states: list[RowState], num_scheduled: list[int], num_proposals: int) -> None:
        """A recompute chunk that ends one token short of a request's known tokens (the scheduler
        stops a resumed seeded stream there) is followed by the decode of that token with drafts:
        the n-gram proposer drafts them now from the known tokens, as it did after the step that
        the preemption interrupted. Before the step's counts advance."""
        assert self.spec is not None
        resumed = [(s.row, s.num_tokens) for s, n in zip(states, num_scheduled, strict=True) if _stops_one_short(s, n)]
        if not resumed:
            return
        rows = host_list_to_device([row for row, _ in resumed], self.device)
        num_tokens = host_list_to_device([n for _, n in resumed], self.device)
        bound = min(max(n for _, n in resumed), self.input_batch.token_ids.shape[1])
        self.spec.propose(self.input_batch.token_ids, rows, num_tokens, bound, None, num_proposals)

    def _restore_after_recompute(self, states: list[RowState], num_scheduled: list[int]) -> None:
        """A resumed seeded request whose recompute chunk ends one token short of its known tokens gets back
        the drafts parked at its preemption: the decode of that token verifies them, as the interrupted step
        would have (the draft model's proposals drew from its stream; proposing again would draw anew)."""
        assert self.spec is not None
        for s, n in zip(states, num_scheduled, strict=True):
            if _stops_one_short(s, n) and self.spec.has_parked_drafts(s.request_id):
                self.spec.restore_drafts(s.request_id, s.row, s.num_tokens, self.input_batch.token_ids)

    def _samples_plainly(self, num_draft_positions: list[int]) -> bool:
        """With speculation on, a step that verifies no draft samples as a plain step does (the decode tail,
        or the plain sampler) instead of the verification path, at the plain step's cost: a step at k = 0,
        and a step whose sampling requests all complete their prompts (the policy's k applies to decodes
        only). Not while a seeded request runs: its stream must draw the same randomness whatever k its
        steps have."""
        return not any(num_draft_positions) and self.input_batch.feature_counts["seeded"] == 0

    def _propose_without_drafts(
        self,
        states: list[RowState],
        num_scheduled: list[int],
        sampling_rows: list[int],
        rows: torch.Tensor,
        new_num_tokens: torch.Tensor,
        metadata: SamplingMetadata | None,
        so: SchedulerOutput,
        computed_before: torch.Tensor,
    ) -> None:
        """After a plainly sampled step: the draft catches up (every sampling request emitted one
        token and verified nothing) and the proposer drafts for the next step."""
        assert self.spec is not None
        num_sampling = len(sampling_rows)
        draft_step = None
        if self.spec.uses_draft_model:
            no_accepted = torch.zeros(num_sampling, dtype=torch.int64, device=self.device)
            draft_step = self._draft_step(
                states,
                num_scheduled,
                sampling_rows,
                [0] * num_sampling,
                no_accepted,
                metadata,
                so.num_proposals,
                computed_before,
            )
        self.spec.propose(
            self.input_batch.token_ids,
            rows,
            new_num_tokens,
            self._token_bound(states, sampling_rows),
            draft_step,
            so.num_proposals,
        )

    def _draft_on_target_inputs(
        self, so: SchedulerOutput, states: list[RowState], step: StepInputs, sampling_rows: torch.Tensor | None
    ) -> bool:
        """The draft's catch-up over a step that proposes nothing (`so.num_proposals` = 0: a plan of prompt chunks),
        when no request's draft lags: its KV then needs exactly the target's tokens of this step, at the same slots,
        so it runs on the target's step inputs, with no inputs of its own to build. A sampling request's new token
        is the first input of its next step for both models (a step that proposes feeds it to the draft at once,
        to propose from its hidden state, and the next step computes its KV again). The draft graph of the
        target's mixed graph replays it; a step the target ran eagerly runs it eagerly. Returns whether it ran."""
        assert self.spec is not None
        if not self.spec.uses_draft_model or so.num_proposals or not self._draft_on_target:
            return False
        graphs = self.draft_on_target_graphs
        graphed = step.mixed_graph is not None and graphs is not None
        if not graphed and (step.graph_bucket is not None or step.mixed_graph is not None):
            return False  # a graphed target step with no twin: the draft's own graphs serve it
        if any(s.draft_lag for s in states):
            return False
        proposer = self.spec.proposer
        assert isinstance(proposer, DraftModelProposer)
        if graphed:
            assert graphs is not None and step.mixed_graph is not None
            graphs.replay_mixed(step.mixed_graph, step.num_tokens)
        else:
            if graphs is not None:
                graphs.num_eager += 1
            proposer.forward_on(step.input_ids, step.positions, step.metadata)
        if sampling_rows is not None:
            self.spec.clear_drafts(sampling_rows)
        self.num_draft_on_target_steps += 1
        return True

    def _token_bound(self, states: list[RowState], sampling_rows: list[int]) -> int:
        """An upper bound of the sampling rows' token counts after this step (seq_len + 1 with the
        plan's computed counts, which are never below the device's), clamped to the buffer."""
        known = max((states[i].num_computed_tokens for i in sampling_rows), default=0) + 1
        return min(known, self.input_batch.token_ids.shape[1])

    def _skip_draft_step(self, so: SchedulerOutput, states: list[RowState], num_sampling: int) -> bool:
        """Whether this plainly sampled step leaves the draft model alone (`_skips_draft`); if so, every
        request's draft falls one token further behind."""
        if not self._skips_draft(so, states, num_sampling):
            return False
        self._fall_behind(states, [1] * len(states))
        return True

    def _skips_draft(self, so: SchedulerOutput, states: list[RowState], num_sampling: int) -> bool:
        """A decode step that verifies nothing and proposes nothing (the policy chose k = 0 for this
        step and the next) leaves the draft model alone: it costs what a step without speculation
        costs, and the draft catches up on these tokens in its next pass. Only while every lag stays
        within the proposer's bound (its input buffers hold the catch-up)."""
        assert self.spec is not None
        if not self.spec.uses_draft_model or so.num_proposals or num_sampling != len(states):
            return False
        if so.num_speculative_tokens or so.total_num_scheduled_tokens != len(states):
            return False
        max_lag = self.spec.proposer.max_lag  # type: ignore[union-attr]
        return max(state.draft_lag for state in states) < max_lag

    def _fall_behind(self, states: list[RowState], num_skipped: list[int]) -> None:
        """Each request's draft misses its last `num_skipped` computed tokens (already counted in its
        num_computed_tokens); with prefix caching their blocks lose the draft's KV."""
        for state, n in zip(states, num_skipped, strict=True):
            state.draft_lag += n
        validity = self.draft_kv_validity
        if validity is not None:
            assert self.spec is not None  # the flags exist only with a draft model
            rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
            end = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=len(states))
            # The host's counts are the plan's: with drafts in flight the device's may be up to k lower.
            slack = self.spec.k if self._drafts_in_flight else 0
            start = np.maximum(end - np.asarray(num_skipped, dtype=np.int64) - slack, 0)
            validity.skipped(self.input_batch.block_table, rows, start, end)

    def _catch_up_lag(self, states: list[RowState], num_scheduled: list[int], computed_before: torch.Tensor) -> None:
        """Passes of the draft alone over the oldest tokens it lacks, at most max_num_batched_tokens a pass,
        until no request lags by more than the proposer's bound (the draft's input buffers hold one step's
        tokens plus that bound a request): a prefix-cache hit on blocks without the draft's KV
        (`_admit_draft_kv`) lags by the hit's tokens from the first such block."""
        assert self.spec is not None
        max_lag = self.spec.proposer.max_lag  # type: ignore[union-attr]
        no_rows = torch.empty(0, dtype=torch.int64, device=self.device)
        while True:
            excess = [max(s.draft_lag - max_lag, 0) for s in states]
            if not any(excess):
                return
            budget = self.config.max_num_batched_tokens
            chunk = []
            for e in excess:
                chunk.append(min(e, budget))
                budget -= chunk[-1]
            step = self._new_draft_step(states, [-s.draft_lag for s in states], chunk, computed_before)
            self.spec.propose(self.input_batch.token_ids, no_rows, no_rows, 0, step, 0)
            self.num_draft_catch_up_passes += 1
            self._draft_computed(states, num_scheduled, chunk, in_sync=False)
            for state, n in zip(states, chunk, strict=True):
                state.draft_lag -= n

    def _draft_computed(
        self, states: list[RowState], num_scheduled: list[int], num_tokens: list[int], in_sync: bool
    ) -> None:
        """With prefix caching: the draft computes the oldest `num_tokens` of each request's missed tokens
        (`in_sync`: all of them, and this step's, after which the request's draft no longer lags)."""
        validity = self.draft_kv_validity
        if validity is None:
            return
        picked = [i for i, n in enumerate(num_tokens) if n]
        if not picked:
            return
        rows = np.asarray([states[i].row for i in picked], dtype=np.int64)
        if in_sync:
            num_blocks = np.asarray([len(states[i].block_ids) for i in picked], dtype=np.int64)
            validity.synced(self.input_batch.block_table, rows, num_blocks)
            return
        # Host counts after this step, minus this step's tokens and the lag: where the draft's KV stops.
        start = np.asarray([states[i].num_computed_tokens - num_scheduled[i] - states[i].draft_lag for i in picked])
        end = start + np.asarray([num_tokens[i] for i in picked])
        validity.computed(self.input_batch.block_table, rows, np.maximum(start, 0), end)

    def _verify_and_propose(
        self,
        req_ids: list[str],
        states: list[RowState],
        num_scheduled: list[int],
        sampling_rows: list[int],
        num_draft_positions: list[int],
        hidden_states: torch.Tensor,
        failed: dict[str, str],
        num_proposals: int,
        computed_before: torch.Tensor,
        step: StepInputs,
    ) -> StepHandle:
        """Speculative sampling: every sampling request emits its accepted drafts plus one token
        (a request without drafts: one sampled token), then proposes `num_proposals` drafts for the
        next step (the scheduler's current choice of k)."""
        assert self.spec is not None
        if not sampling_rows:
            if self.spec.uses_draft_model:  # the draft's KV follows every prefill chunk
                self._catch_up_draft(states, num_scheduled, computed_before)
            output = ModelRunnerOutput(req_ids, [[] for _ in req_ids], failed_requests=failed)
            return StepHandle(output=output)
        num_sampling = len(sampling_rows)
        num_positions = max(num_draft_positions) + 1
        sampling_states = [states[i] for i in sampling_rows]
        rows = self._meta_dev[7, :num_sampling]  # the sampling requests' batch rows
        # The greedy path reads no sampling metadata; the draft's eager step still does.
        metadata: SamplingMetadata | None = None
        logits: torch.Tensor | None = None
        draft_done = False
        if self._batch_only_greedy():
            greedy = self._verify_greedily(hidden_states, step, len(states), num_sampling, num_positions)
            draft_done = num_sampling == len(states) and self._replay_greedy_draft_step(step, states, num_proposals)
            num_positions = greedy.output_token_ids.shape[1]
            out, num_accepted = greedy.output_token_ids[:num_sampling], greedy.num_accepted[:num_sampling]
            num_valid, new_num_tokens = greedy.num_valid_drafts[:num_sampling], greedy.new_num_tokens[:num_sampling]
            if self.input_batch.records_sampled:
                self.input_batch.record_sampled(rows.unsqueeze(1).expand_as(out).reshape(-1), out.reshape(-1))
        else:
            metadata = self._sampling_metadata(sampling_states, rows)
            out, num_accepted, num_valid, new_num_tokens, logits = self._verify(
                states, num_scheduled, sampling_rows, num_draft_positions, hidden_states, rows, metadata
            )
        if not draft_done:
            draft_step = None
            if self.spec.uses_draft_model:
                if metadata is None:
                    metadata = self._sampling_metadata(sampling_states, rows)
                draft_step = self._draft_step(
                    states,
                    num_scheduled,
                    sampling_rows,
                    num_draft_positions,
                    num_accepted,
                    metadata,
                    num_proposals,
                    computed_before,
                )
            bound = self._token_bound(states, sampling_rows)
            self.spec.propose(self.input_batch.token_ids, rows, new_num_tokens, bound, draft_step, num_proposals)
        num_logprobs = metadata.max_num_logprobs if metadata is not None else None
        tensors = [out, num_accepted, num_valid]
        if num_logprobs is not None:
            assert logits is not None  # the greedy path serves no batch that asks for logprobs
            raw = logits.float().log_softmax(dim=-1).view(-1, logits.shape[-1])
            logprob_out = SamplerOutput(sampled_token_ids=out.clamp_min(0).view(-1))
            Sampler._gather_logprobs(logprob_out, raw, num_logprobs)
            tensors += _logprob_tensors(logprob_out)
        host, ready = self._copy_to_host(tensors)

        def finish(values: np.ndarray) -> ModelRunnerOutput:
            sampled_per_req: list[list[int]] = [[] for _ in req_ids]
            num_drafts_per_req = [0] * len(req_ids)
            width = num_sampling * num_positions
            flat_out = values[:width].tolist()
            accepted = values[width : width + num_sampling].tolist()
            valid = values[width + num_sampling : width + 2 * num_sampling].tolist()
            any_drafts = False
            for n, (i, state) in enumerate(zip(sampling_rows, sampling_states, strict=True)):
                run = flat_out[n * num_positions : n * num_positions + accepted[n] + 1]
                if run[-1] == INVALID_TOKEN_ID:
                    failed[state.request_id] = (
                        "the sampler found no valid token: the logits were NaN, or every token was masked"
                    )
                    continue
                state.num_tokens += len(run)
                state.output_token_ids.extend(run)
                sampled_per_req[i] = run
                num_drafts_per_req[i] = valid[n]
                any_drafts = any_drafts or valid[n] > 0
            logprobs_per_req = None
            if num_logprobs is not None:
                ids, lps, ranks = _unpack_logprobs(values[width + 2 * num_sampling :], width, num_logprobs)
                logprobs_per_req = _logprobs_per_request(
                    ids, lps, ranks, sampling_rows, sampling_states, num_positions, sampled_per_req, len(req_ids)
                )
            return ModelRunnerOutput(
                req_ids=req_ids,
                sampled_token_ids=sampled_per_req,
                logprobs=logprobs_per_req,
                num_draft_tokens=num_drafts_per_req if any_drafts else None,
                failed_requests=failed,
            )

        return StepHandle(finish=finish, host=host, ready=ready)

    def _verify_greedily(
        self, hidden_states: torch.Tensor, step: StepInputs, num_reqs: int, num_sampling: int, num_positions: int
    ) -> GreedyVerifyResult:
        """Greedy verification of an all-greedy step: the tail graph of the step's forward graph
        (over its query length, at least num_positions), or the same function run eagerly (a step
        without a graph), over the sampling requests alone where prompt chunks beside them sample nothing
        (a mixed plan's decodes verifying drafts: eager, a few launches more than the tail, no sampler)."""
        assert self._greedy_verification is not None
        if num_sampling < num_reqs:
            return self._greedy_verification.sampling_only(hidden_states, self._inputs, num_sampling, num_positions)
        graphs, bucket = self.cuda_graphs, step.graph_bucket
        # One token a request (drafts planned, none left to verify) is the decode tail's shape, not this one's.
        if graphs is not None and bucket is not None and step.query_len > 1 and graphs.has_tail(bucket, step.query_len):
            return graphs.replay_tail(bucket, step.query_len)
        return self._greedy_verification(hidden_states, self._inputs, num_reqs, num_positions)

    def _replay_greedy_draft_step(self, step: StepInputs, states: list[RowState], num_proposals: int) -> bool:
        """After a greedy verification replayed from its tail graph: the draft's whole step from one
        graph, when one was captured for this step's shape (bucket, verified k, proposals; none proposes 0)
        and no request's draft lags. Returns whether it ran."""
        bucket = step.graph_bucket
        if bucket is None:
            return False
        graph = self._greedy_draft_steps.get((bucket, step.query_len, num_proposals))
        if graph is None or any(s.draft_lag for s in states):
            return False
        graph.replay()
        self.num_greedy_draft_steps += 1
        return True

    def _verify(
        self,
        states: list[RowState],
        num_scheduled: list[int],
        sampling_rows: list[int],
        num_draft_positions: list[int],
        hidden_states: torch.Tensor,
        rows: torch.Tensor,
        metadata: SamplingMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Verification with the full sampler (temperature, penalties, min_tokens): the emitted runs
        go into the token buffer and the rejected positions leave the device's computed counts.
        Returns (output ids [S, P], accepted [S], verified drafts [S], known tokens after [S],
        logits [S, P, V])."""
        assert self.spec is not None
        num_sampling = len(sampling_rows)
        ends = np.cumsum(num_scheduled)
        num_positions = max(num_draft_positions) + 1
        # Hidden rows of each request's last known token and its draft positions (padding repeats
        # the last row: its verdict is never read).
        index = [
            int(ends[i]) - 1 - d + min(j, d)
            for i, d in zip(sampling_rows, num_draft_positions, strict=True)
            for j in range(num_positions)
        ]
        gather = host_list_to_device(index, self.device)
        logits = self.model.compute_logits(hidden_states.index_select(0, gather))
        logits = logits.view(num_sampling, num_positions, -1)
        sampling_states = [states[i] for i in sampling_rows]
        blocked: dict[int, list[int]] = {}
        if self.input_batch.feature_counts["min_tokens"]:
            for i, state in enumerate(sampling_states):
                p = state.sampling_params
                for j in range(num_positions):
                    if p.min_tokens and len(state.output_token_ids) + j < p.min_tokens:
                        ids = p.all_stop_token_ids(self.eos_token_ids)
                        if ids:
                            blocked[i * num_positions + j] = sorted(ids)
        planned = self._meta_dev[5, :num_sampling]
        result = self.spec.verify(
            VerifyInputs(
                rows=rows,
                row_ids=[s.row for s in sampling_states],
                num_draft_positions=planned,
                logits=logits,
                metadata=metadata,
                blocked_token_ids=blocked,
                is_greedy=metadata.temperature < SAMPLING_EPS,
            ),
            metadata.generators,
            self.default_generator,
        )
        out, num_accepted = result.output_token_ids, result.num_accepted
        # The emitted tokens become known tokens on the device: positions num_tokens + j, j <= accepted,
        # where num_tokens (before the step) = seq_len - planned draft positions.
        token_ids = self.input_batch.token_ids
        sample_index = self._meta_dev[3, :num_sampling]
        base = self._inputs.seq_lens.to(torch.int64).index_select(0, sample_index) - planned
        cols = base.unsqueeze(1) + torch.arange(num_positions, device=self.device)
        row_grid = rows.unsqueeze(1).expand_as(cols)
        keep = out >= 0
        token_ids[row_grid, cols] = torch.where(keep, out, token_ids[row_grid, cols])
        self.input_batch.record_sampled(row_grid.reshape(-1), out.reshape(-1))
        # The accepted counts correct the device's computed counts: rejected positions are not computed.
        self.input_batch.num_computed_dev.index_add_(0, rows, num_accepted - planned)
        return out, num_accepted, result.num_valid_drafts, base + num_accepted + 1, logits

    def _draft_step(
        self,
        states: list[RowState],
        num_scheduled: list[int],
        sampling_rows: list[int],
        num_draft_positions: list[int],
        num_accepted: torch.Tensor,
        metadata: SamplingMetadata | None,
        num_proposals: int,
        computed_before: torch.Tensor,
    ) -> DraftStep:
        if metadata is None:  # no request samples: the draft only catches up
            metadata = SamplingMetadata.from_params([], device=self.device)
        # The draft's KV trails the target's by each row's lag; the counts themselves are the device's.
        lag = [s.draft_lag for s in states]
        if any(lag):
            self._catch_up_lag(states, num_scheduled, computed_before)
            lag = [s.draft_lag for s in states]
            self._draft_computed(states, num_scheduled, lag, in_sync=True)
            for s in states:
                s.draft_lag = 0
        draft_scheduled = [n + x for n, x in zip(num_scheduled, lag, strict=True)]
        return self._new_draft_step(
            states,
            [-x for x in lag],
            draft_scheduled,
            computed_before,
            sampling_rows,
            num_draft_positions,
            num_accepted,
            metadata,
            num_proposals,
        )

    def _new_draft_step(
        self,
        states: list[RowState],
        num_computed: list[int],
        num_tokens: list[int],
        computed_before: torch.Tensor,
        sampling_rows: list[int] | None = None,
        num_draft_positions: list[int] | None = None,
        num_accepted: torch.Tensor | None = None,
        metadata: SamplingMetadata | None = None,
        num_proposals: int = 0,
    ) -> DraftStep:
        """A draft pass over `num_tokens` of each request from `num_computed` (relative to the device's computed
        counts before this step); without the sampling arguments it only catches up."""
        return DraftStep(
            num_computed=num_computed,
            computed_base=computed_before,
            num_scheduled=num_tokens,
            sampling_index=sampling_rows or [],
            num_draft_positions=num_draft_positions or [],
            rows=[s.row for s in states],
            token_ids=self.input_batch.token_ids,
            block_tables=self._block_table_dev[: len(states)],
            num_slots=[min(len(s.block_ids) * self.block_size, self.max_model_len) for s in states],
            num_accepted=num_accepted
            if num_accepted is not None
            else torch.empty(0, dtype=torch.int64, device=self.device),
            metadata=metadata if metadata is not None else SamplingMetadata.from_params([], device=self.device),
            default_generator=self.default_generator,
            num_proposals=num_proposals,
        )

    def _prepare_inputs(
        self,
        states: list[RowState],
        num_scheduled: list[int],
        sampling_rows: list[int],
        num_draft_positions: list[int],
        admitted: set[str],
    ) -> StepInputs:
        """One host-to-device copy of per-request counts (and of the block tables); on the device the
        computed counts are taken from the device's own (a step in flight may have rejected drafts
        the host does not know of yet), the drafts are placed after each request's tokens, and one
        kernel builds positions, input ids, slots, query starts and sequence lengths, padded to the
        graph bucket when one replays the step."""
        num_reqs = len(states)
        num_sampling = len(sampling_rows)
        total_tokens = sum(num_scheduled)
        graphs = self.cuda_graphs
        graph = graphs.select(num_reqs, max(num_scheduled), total_tokens) if graphs is not None else None
        mixed = graphs.select_mixed(num_reqs, total_tokens) if graphs is not None and graph is None else None
        bucket, query_len = graph if graph is not None else (None, max(num_scheduled))
        if bucket is not None:
            padded_reqs, padded_tokens = bucket, bucket * query_len
        else:
            padded_reqs, padded_tokens = mixed if mixed is not None else (num_reqs, total_tokens)
        rows = [s.row for s in states]
        computed = [s.num_computed_tokens for s in states]
        writable = (
            [min(len(s.block_ids) * self.block_size, self.max_model_len) for s in states]
            if self._greedy_draft_steps or (self.spec is not None and self.spec.uses_draft_model)
            else None
        )
        if self._pending_start is not None:
            self._pending_start.record(self._stream)
            self._pending_start = None
        # Without admissions (row 4 all 0) the device takes every computed count from its own and rewrites row 1
        # before anything reads it, so the host's counts are not in the key; any other row the device reads is.
        meta_key = (
            tuple(rows),
            tuple(num_scheduled),
            tuple(sampling_rows),
            tuple(num_draft_positions),
            tuple(writable) if writable is not None else None,
            padded_reqs,
        )
        table_key = (meta_key[0], self.input_batch.block_table_version)
        copy_meta = bool(admitted) or meta_key != self._meta_on_device
        copy_table = table_key != self._block_tables_on_device
        if copy_meta or copy_table:
            i = self._buffer_index
            self._buffer_index ^= 1
            copy_done = self._copy_done[i]
            if copy_done is not None:
                copy_done.synchronize()
            meta_host, block_table_host = self._meta_host[i], self._block_table_host[i]
            if copy_meta:
                meta = meta_host.numpy()
                meta[0, :num_reqs] = rows
                meta[1, :num_reqs] = computed
                meta[2, :num_reqs] = num_scheduled
                meta[:3, num_reqs:padded_reqs] = 0  # padding requests: no tokens
                meta[3, :num_sampling] = sampling_rows
                meta[7, :num_sampling] = rows if num_sampling == num_reqs else [rows[j] for j in sampling_rows]
                meta[4, :num_reqs] = [s.request_id in admitted for s in states] if admitted else 0
                meta[5, :num_sampling] = num_draft_positions
                if writable is not None:
                    meta[6, :num_reqs] = writable
                self._meta_dev.copy_(meta_host, non_blocking=True)
                self._meta_on_device = None if admitted else meta_key
                self.num_meta_copies += 1
            if copy_table:
                np.take(self.input_batch.block_table, rows, axis=0, out=block_table_host.numpy()[:num_reqs])
                self._block_table_dev[:num_reqs].copy_(block_table_host[:num_reqs], non_blocking=True)
                self._block_tables_on_device = table_key
                self.num_block_table_copies += 1
            if self.device.type == "cuda":
                event = self._copy_done[i] or torch.cuda.Event()
                event.record(self._stream)
                self._copy_done[i] = event
        inputs = self._inputs
        # The block tables were copied into inputs.block_tables (= self._block_table_dev) above. The plan's
        # computed counts in the device meta are replaced by the device's own (the truth), except for rows
        # admitted this step (the host's count is theirs), and the device's counts advance by the scheduled
        # tokens (verification takes back the rejected ones): one launch with the inputs where it can, or the
        # bucket's graph of that launch.
        if bucket is not None and self.cuda_graphs is not None and self.cuda_graphs.has_head(bucket, query_len):
            self.cuda_graphs.replay_head(bucket, query_len)
        else:
            inputs.fill(
                self._prepare_kernel,
                self._meta_dev,
                padded_reqs,
                padded_tokens,
                self.input_batch.token_ids,
                self.block_size,
                resolve=(num_reqs, self.input_batch.num_computed_dev),
            )
        return StepInputs(
            inputs=inputs,
            num_reqs=num_reqs,
            num_tokens=total_tokens,
            max_query_len=max(num_scheduled),
            # An upper bound (the plan's computed counts are never below the device's).
            max_seq_len=max(map(operator.add, computed, num_scheduled)),
            block_size=self.block_size,
            graph_bucket=bucket,
            query_len=query_len,
            mixed_graph=mixed,
        )

    def _sampling_metadata(self, states: list[RowState], batch_rows: torch.Tensor) -> SamplingMetadata:
        """Gathers the rows' device-resident parameters. When the rows are the whole batch (every
        decode step) the batch's feature counts say which features are in use; the requests are
        scanned only for a feature some row uses (or when only part of the batch samples)."""
        tensors = self.input_batch.sampling_tensors
        if len(states) == len(self.input_batch):
            counts = self.input_batch.feature_counts
        else:
            counts = dict.fromkeys(SAMPLING_FEATURES, 0)
            for state in states:
                for name in state.features:
                    counts[name] += 1

        def rows_of(name: str, used: bool) -> torch.Tensor | None:
            return tensors[name].index_select(0, batch_rows) if used else None

        uses_penalties = counts["penalties"] > 0
        blocked: dict[int, list[int]] = {}
        if counts["min_tokens"]:
            for i, state in enumerate(states):
                p = state.sampling_params
                if p.min_tokens and len(state.output_token_ids) < p.min_tokens:
                    ids = p.all_stop_token_ids(self.eos_token_ids)
                    if ids:
                        blocked[i] = sorted(ids)
        max_num_logprobs = None
        if counts["logprobs"]:
            max_num_logprobs = max(s.sampling_params.logprobs for s in states if s.sampling_params.logprobs is not None)
        generators = (
            {i: s.generator for i, s in enumerate(states) if s.generator is not None} if counts["seeded"] else {}
        )
        return SamplingMetadata(
            temperature=tensors["temperature"].index_select(0, batch_rows),
            top_k=rows_of("top_k", counts["top_k"] > 0),
            top_p=rows_of("top_p", counts["top_p"] > 0),
            min_p=rows_of("min_p", counts["min_p"] > 0),
            generators=generators,
            presence_penalty=rows_of("presence_penalty", uses_penalties),
            frequency_penalty=rows_of("frequency_penalty", uses_penalties),
            repetition_penalty=rows_of("repetition_penalty", uses_penalties),
            prompt_token_ids=None,
            output_token_ids=[s.output_token_ids for s in states] if uses_penalties else [],
            blocked_token_ids=blocked,
            max_num_logprobs=max_num_logprobs,
            all_greedy=counts["random"] == 0,
            all_random=counts["random"] == len(states),
            output_token_counts=self._penalty_rows(self.input_batch.output_token_counts, batch_rows, uses_penalties),
            prompt_token_mask=self._penalty_rows(self.input_batch.prompt_token_mask, batch_rows, uses_penalties),
        )

    @staticmethod
    def _penalty_rows(table: torch.Tensor | None, batch_rows: torch.Tensor, used: bool) -> torch.Tensor | None:
        return table.index_select(0, batch_rows) if used and table is not None else None


def _stops_one_short(state: RowState, num_scheduled: int) -> bool:
    """Whether this step's chunk is a resumed request's recompute that ends one token short of its known tokens
    (the scheduler stops a resumed seeded stream there, so that the decode of that token verifies drafts)."""
    return bool(state.output_token_ids) and state.num_computed_tokens + num_scheduled == state.num_tokens - 1


def _logprob_tensors(out: SamplerOutput) -> list[torch.Tensor]:
    """The logprob results as int64 tensors for the step's one copy (the float values travel as the
    bit patterns of float64)."""
    assert out.logprob_token_ids is not None and out.logprobs is not None and out.sampled_token_ranks is not None
    return [out.logprob_token_ids, out.logprobs.to(torch.float64).view(torch.int64), out.sampled_token_ranks]


def _unpack_logprobs(values: np.ndarray, num_rows: int, num_logprobs: int) -> tuple[list, list, list]:
    """The inverse of _logprob_tensors on the host copy: (token ids, logprobs, ranks) per row."""
    width = num_logprobs + 1
    ids = values[: num_rows * width].reshape(num_rows, width)
    lps = values[num_rows * width : 2 * num_rows * width].view(np.float64).reshape(num_rows, width)
    ranks = values[2 * num_rows * width : 2 * num_rows * width + num_rows]
    return ids.tolist(), lps.tolist(), ranks.tolist()


def _logprobs_per_request(
    ids: list,
    values: list,
    ranks: list,
    sampling_rows: list[int],
    states: list[RowState],
    num_positions: int,
    sampled_per_req: list[list[int]],
    num_reqs: int,
) -> list[list[TokenLogprobs] | None]:
    """Per request, one TokenLogprobs per emitted token (rows n * num_positions + j)."""
    result: list[list[TokenLogprobs] | None] = [None] * num_reqs
    for n, (i, state) in enumerate(zip(sampling_rows, states, strict=True)):
        top = state.sampling_params.logprobs
        if top is None:
            continue
        rows = range(n * num_positions, n * num_positions + len(sampled_per_req[i]))
        result[i] = [
            TokenLogprobs(token_ids=ids[r][: top + 1], logprobs=values[r][: top + 1], sampled_token_rank=ranks[r])
            for r in rows
        ]
    return result
