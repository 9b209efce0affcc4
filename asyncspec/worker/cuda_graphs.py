"""CUDA graphs of a model's forward pass for decode and verification batches.

A decode step (1 token per request) or a verification step (1 + k) replays a graph captured at
start-up for the smallest batch-size bucket that holds it. Inputs go through static buffers; a
batch of n requests in a bucket of B is padded with B - n zero-length requests, and the tail tokens
[T, B * q) write no KV (slot -1) and are never sampled (the attention kernel zeroes their rows).
Requests of different lengths (drafts trimmed near max_tokens, a draft catching up) replay the graph
whose query length q holds the longest (see `select`): every kernel reads lengths and offsets from
the static buffers. The same class graphs the draft model's proposal and catch-up passes over the
draft's own StaticInputs.

A mixed step (prompt chunks, with or without decodes) replays a graph of its own, keyed by a request
bucket R and a token bucket T (`select_mixed`): the attention kernel's launch depends on shapes only, so
one graph serves any split of T tokens among R requests. The request buckets keep the attention tile
near what the real batch would take (it is chosen from T / R). Without such a graph (past the buckets,
or `cuda_graph_max_tokens=0`) the step runs eagerly: on a small model an eager prompt chunk costs the host
far more than the device (about a hundred launches for a few milliseconds of the device's time).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from asyncspec.layers.attention_metadata import AttentionMetadata, StaticInputs

logger = logging.getLogger(__name__)

ModelForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, "int | None"], torch.Tensor]
"""forward(input_ids [T], positions [T], metadata, uniform query length or None) -> hidden [T, H]."""

StepTail = Callable[[torch.Tensor, StaticInputs, int, int], Any]
"""tail(hidden [B * q, H] of a graph, its static inputs, B, q) -> its results (tensors): what follows
the forward pass of a greedy step (the plain decode's sampling, or a speculative step's
verification), captured as a graph of its own so that a step that needs the eager sampler still
replays the forward alone."""

StepHead = Callable[[int, int], None]
"""head(B, q): builds a step's inputs into the graphs' static buffers, for a batch padded to B requests of at
most q tokens, from device-resident counts alone (a kernel whose launch depends on (B, q) only), captured as
a graph of its own per (B, q). The caller replays it instead of launching the kernel; it stays a graph of its
own so that the inputs can be checked (debug mode) before the forward pass reads them."""


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool: Any) -> Iterator[None]:
    """`torch.cuda.graph` with Python's garbage collector paused. A collection inside the capture may free
    another engine's CUDA objects (graphs, events, pinned buffers: an LLM dropped before this one was made),
    and those calls invalidate the capture ("operation failed due to a previous error during capture")."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        if enabled:
            gc.enable()


def batch_size_buckets(max_num_reqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to max_num_reqs (which is always a bucket)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_reqs]
    sizes += list(range(8, max_num_reqs, 8))
    return sorted(set(sizes) | {max_num_reqs})


MIN_MIXED_TOKENS = 64
"""The smallest token bucket of the mixed graphs."""
MIXED_REQUEST_BUCKETS = (16, 64)
"""Request buckets of the mixed graphs below max_num_seqs (which is always one)."""


def mixed_graph_sizes(max_num_reqs: int, max_tokens: int, max_query_len: int) -> list[tuple[int, int]]:
    """(request bucket, token bucket) of the mixed graphs: requests 16, 64 and max_num_reqs; tokens 64, 128,
    256, ... and max_tokens. A pair is left out when no real step maps to it: R requests hold at most
    R * max_query_len tokens, and a step maps to the smallest request bucket that holds it, so a bucket's
    steps have more requests (hence tokens) than the bucket below it."""
    if max_tokens < 1:
        return []
    requests = sorted({min(r, max_num_reqs) for r in MIXED_REQUEST_BUCKETS} | {max_num_reqs})
    tokens = [t for t in (MIN_MIXED_TOKENS << i for i in range(32)) if t < max_tokens] + [max_tokens]
    sizes = []
    for i, r in enumerate(requests):
        below = requests[i - 1] if i else 0
        sizes += [(r, t) for t in tokens if t > below and t <= r * max_query_len]
    return sizes


@dataclass(frozen=True)
class CaptureStats:
    """What capture cost: reported at start-up."""

    num_graphs: int
    """Graphs captured (buckets times query lengths)."""
    seconds: float
    """Wall time of warm-up and capture."""
    memory_bytes: int
    """Device memory reserved by the graphs' private pool."""


class CapturedGraph:
    """A function captured as a graph: `replay` runs it again over the same buffers, and `out` holds
    its results (tensors of the graph's pool, valid until the next replay)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, out: Any) -> None:
        self.graph, self.out = graph, out

    def replay(self) -> None:
        self.graph.replay()


class CudaGraphForward:
    """The graphs of one model over its KV cache and its static inputs. The caller writes a step's
    inputs into the static buffers (padded to `bucket`), then `replay`s; without a bucket it runs
    the model eagerly itself and counts it in `num_eager`."""

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        static: StaticInputs,
        batch_sizes: Iterable[int],
        query_lens: Iterable[int],
        device: torch.device,
        tail: StepTail | None = None,
        tail_query_lens: Iterable[int] = (),
        head: StepHead | None = None,
        mixed_sizes: Iterable[tuple[int, int]] = (),
        pool: Any = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.static = static
        self.batch_sizes = sorted(set(batch_sizes))
        self.query_lens = sorted(set(query_lens))
        self.device = device
        self.mixed_sizes = sorted(set(mixed_sizes))
        """(request bucket, token bucket) of the mixed graphs (see `mixed_graph_sizes`)."""
        largest = [b * q for b in self.batch_sizes[-1:] for q in self.query_lens[-1:]]
        max_reqs = max([*self.batch_sizes[-1:], *(r for r, _ in self.mixed_sizes)], default=0)
        max_tokens = max([*largest, *(t for _, t in self.mixed_sizes)], default=0)
        if static.query_start_loc.shape[0] <= max_reqs or static.input_ids.shape[0] < max_tokens:
            raise ValueError("the static inputs are smaller than the largest graph")
        self._mixed: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        """(request bucket, token bucket) -> the mixed step's graph and its hidden states."""
        self.num_mixed_replays = 0
        """Forward passes of mixed steps (prompt chunks) served by a graph; also counted in num_replays."""
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.tail = tail
        self.tail_query_lens = frozenset(tail_query_lens) if tail is not None else frozenset()
        """The query lengths whose graphs get the tail (1: plain decode; k + 1: verification)."""
        self._tails: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Any]] = {}
        """(bucket, q) -> the tail's graph over the (bucket, q) forward graph's output, and its results."""
        self.head = head
        self._heads: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        """(bucket, q) -> the head's graph: the step's inputs built for that bucket."""
        self._pool: Any = pool
        """The graphs' private memory pool: another object's (`pool`, graphs that never run at the same time), or
        the first graph's."""
        self.num_replays = 0
        """Forward passes served by a graph (tests and benchmarks read it)."""
        self.num_eager = 0
        """Forward passes that ran eagerly."""
        self.num_head_replays = 0
        """Steps whose inputs were built by the head's graph."""
        self.num_decode_tail_replays = 0
        """Decode steps whose greedy sampling was replayed from a tail graph."""
        self.num_verify_tail_replays = 0
        """Speculative steps whose greedy verification was replayed from a tail graph."""
        self.replay_seconds: dict[tuple[int, int], float] = {}
        """Device time of one replay per (batch size, query length), measured at capture."""

    @property
    def pool(self) -> Any:
        """The private memory pool of these graphs (None before the first capture)."""
        return self._pool

    # -- capture -----------------------------------------------------------------------------
    def _run_static(self, num_reqs: int, num_tokens: int, max_query_len: int) -> torch.Tensor:
        static = self.static
        metadata = static.metadata(num_reqs, num_tokens, max_query_len, self.block_size)
        return self.model(static.input_ids[:num_tokens], static.positions[:num_tokens], self.kv_caches, metadata)

    def _capture_forward(self, num_reqs: int, query_lens: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warms up and captures the forward pass of num_reqs requests of `query_lens` tokens each (every
        request sees its own tokens' keys in block 0: finite values; slots -1: nothing written)."""
        static = self.static
        static.query_start_loc[0] = 0
        torch.cumsum(query_lens, 0, dtype=torch.int32, out=static.query_start_loc[1 : num_reqs + 1])
        static.seq_lens[:num_reqs].copy_(query_lens)
        num_tokens, max_query_len = int(query_lens.sum()), int(query_lens.max())
        for _ in range(2):  # compile every Triton specialisation before capture
            self._run_static(num_reqs, num_tokens, max_query_len)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, self._pool):
            out = self._run_static(num_reqs, num_tokens, max_query_len)
        if self._pool is None:
            self._pool = graph.pool()
        return graph, out

    @torch.inference_mode()
    def capture(self, progress: Callable[[int, int], None] | None = None) -> CaptureStats:
        """Warms up and captures every (bucket, query length) and every mixed (requests, tokens), largest
        first so that the smaller graphs reuse the first one's private pool. Capture writes no KV (slots -1)."""
        start = time.perf_counter()
        torch.cuda.synchronize(self.device)
        reserved_before = torch.cuda.memory_reserved(self.device)
        # Largest first (in tokens), uniform (False) and mixed (True) graphs together.
        jobs = [(b * q, False, b, q) for q in self.query_lens for b in self.batch_sizes]
        jobs += [(t, True, r, t) for r, t in self.mixed_sizes]
        jobs.sort(key=lambda job: (job[0], job[1]), reverse=True)
        static = self.static
        static.slot_mapping.fill_(-1)
        static.block_tables.zero_()
        for i, (num_tokens, mixed, num_reqs, query_len) in enumerate(jobs):
            if mixed:
                # The tokens spread over the requests (the split does not matter: shapes alone set the launches).
                bounds = torch.arange(num_reqs + 1, dtype=torch.int64, device=self.device) * num_tokens // num_reqs
                graph, out = self._capture_forward(num_reqs, (bounds[1:] - bounds[:-1]).to(torch.int32))
                graph.replay()  # the first launch uploads the graph: not on a request's step
                self._mixed[(num_reqs, num_tokens)] = (graph, out)
            else:
                lens = torch.full((num_reqs,), query_len, dtype=torch.int32, device=self.device)
                graph, out = self._capture_forward(num_reqs, lens)
                self._graphs[(num_reqs, query_len)] = (graph, out)
                self.replay_seconds[(num_reqs, query_len)] = self._time_replays(graph)
                if self.tail is not None and query_len in self.tail_query_lens:
                    self._tails[(num_reqs, query_len)] = self._capture_tail(self.tail, out, num_reqs, query_len)
                if self.head is not None:
                    self._heads[(num_reqs, query_len)] = self.capture_function(
                        lambda b=num_reqs, q=query_len: self.head(b, q)  # type: ignore[misc]
                    ).graph
            if progress is not None:
                progress(i + 1, len(jobs))
        torch.cuda.synchronize(self.device)
        memory = torch.cuda.memory_reserved(self.device) - reserved_before
        return CaptureStats(len(jobs) + len(self._tails) + len(self._heads), time.perf_counter() - start, memory)

    def _capture_tail(
        self, tail: StepTail, hidden: torch.Tensor, num_reqs: int, query_len: int
    ) -> tuple[torch.cuda.CUDAGraph, Any]:
        # Warm-up runs the tail for real: capture happens at start-up, before any request owns
        # the buffers it writes.
        for _ in range(2):
            tail(hidden, self.static, num_reqs, query_len)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, self._pool):
            out = tail(hidden, self.static, num_reqs, query_len)
        graph.replay()  # the first launch uploads the graph: not on a request's step
        return graph, out

    @torch.inference_mode()
    def capture_function(self, fn: Callable[[], Any]) -> CapturedGraph:
        """Captures `fn` (several forward passes over these static buffers and what lies between
        them, e.g. the draft's greedy proposal loop) into the pool of the graphs already captured.
        Warm-up runs it for real: call this at start-up, before any request owns what it writes."""
        for _ in range(2):
            fn()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, self._pool):
            out = fn()
        graph.replay()  # the first launch uploads the graph: not on a request's step
        return CapturedGraph(graph, out)

    def _time_replays(self, graph: torch.cuda.CUDAGraph, repeats: int = 3) -> float:
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / repeats / 1e3

    def replay_cost(self, num_reqs: int, query_len: int) -> float:
        """Measured seconds of the graph that would serve num_reqs requests of query_len; past the
        largest bucket, that bucket's time scaled by the batch (the step then runs eagerly)."""
        bucket = self.bucket(num_reqs, query_len)
        if bucket is not None:
            return self.replay_seconds[(bucket, query_len)]
        largest = self.batch_sizes[-1]
        return self.replay_seconds[(largest, query_len)] * num_reqs / largest

    # -- replay ------------------------------------------------------------------------------
    def bucket(self, num_reqs: int, query_len: int | None) -> int | None:
        """The smallest captured batch size that holds num_reqs requests of query_len, if any."""
        if query_len is None or query_len not in self.query_lens or not self._graphs:
            return None
        for size in self.batch_sizes:
            if size >= num_reqs:
                return size
        return None

    def select(self, num_reqs: int, max_query_len: int, num_tokens: int) -> tuple[int, int] | None:
        """The graph (bucket, query length) that replays a batch of num_reqs requests of at most
        max_query_len tokens each, num_tokens in all: the smallest captured query length that holds
        the longest request, and its smallest bucket. The kernels read every length and offset from
        the static buffers, so requests shorter than the graph's query length (drafts trimmed near
        max_tokens, a short last prefill chunk) pack at the front and the tail pads. None when no
        graph holds the batch, or when padding would more than double the tokens computed."""
        query_len = next((q for q in self.query_lens if q >= max_query_len), None)
        if query_len is None:
            return None
        bucket = self.bucket(num_reqs, query_len)
        if bucket is None or bucket * query_len > 2 * num_tokens + bucket:
            return None
        return bucket, query_len

    def select_mixed(self, num_reqs: int, num_tokens: int) -> tuple[int, int] | None:
        """The mixed graph (request bucket, token bucket) that replays a step of num_reqs requests and
        num_tokens tokens in all, however they are split: the smallest request bucket that holds the
        requests, then its smallest token bucket that holds the tokens. None when none does."""
        for key in self.mixed_sizes:  # sorted by requests, then tokens
            if key[0] >= num_reqs and key[1] >= num_tokens and key in self._mixed:
                return key
        return None

    def replay_mixed(self, key: tuple[int, int], num_tokens: int) -> torch.Tensor:
        """Runs the mixed graph `key` over the static inputs, which the caller filled for key[0] requests
        (the padding ones with no tokens) and key[1] tokens (the tail with slot -1). Returns the first
        num_tokens hidden states (valid until the next replay)."""
        graph, out = self._mixed[key]
        graph.replay()
        self.num_replays += 1
        self.num_mixed_replays += 1
        return out[:num_tokens]

    def replay(self, bucket: int, query_len: int, num_tokens: int) -> torch.Tensor:
        """Runs the graph of (bucket, query_len) over the static inputs, which the caller filled
        for bucket requests (padding requests with no tokens; the real ones with at most query_len
        tokens each) and bucket * query_len tokens (the tail with slot -1). Returns the first
        num_tokens hidden states (valid until the next replay)."""
        graph, out = self._graphs[(bucket, query_len)]
        graph.replay()
        self.num_replays += 1
        return out[:num_tokens]

    def has_head(self, bucket: int, query_len: int) -> bool:
        return (bucket, query_len) in self._heads

    def replay_head(self, bucket: int, query_len: int) -> None:
        """Builds the step's inputs for (bucket, query_len) from the device's counts (the head's graph);
        the caller has put the step's counts on the device first, on the same stream."""
        self._heads[(bucket, query_len)].replay()
        self.num_head_replays += 1

    def has_tail(self, bucket: int, query_len: int) -> bool:
        return (bucket, query_len) in self._tails

    def tail_outputs(self) -> dict[tuple[int, int], Any]:
        """(bucket, query length) -> the results its tail graph writes at every replay."""
        return {key: out for key, (_, out) in self._tails.items()}

    def replay_tail(self, bucket: int, query_len: int) -> Any:
        """Runs the tail over the output of the (bucket, query_len) graph just replayed; returns its
        results for the whole bucket (valid until the next replay; the caller slices)."""
        graph, out = self._tails[(bucket, query_len)]
        graph.replay()
        if query_len == 1:
            self.num_decode_tail_replays += 1
        else:
            self.num_verify_tail_replays += 1
        return out
