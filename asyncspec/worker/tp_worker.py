"""The process of one tensor-parallel rank: joins the group, builds its shard of the model runner,
then runs the engine's commands from its pipe until told to stop or the engine goes away.

Every rank runs every step (the same SchedulerOutput, in the same order) and samples the same
tokens from the same gathered logits with the same seeds, so the device-resident state of the
asynchronous loop (last sampled tokens, drafts, computed counts) stays identical on all ranks
without any exchange beyond the model's own collectives. Only rank 0 sends a step's results back.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from asyncspec.config import EngineConfig
from asyncspec.core.scheduler_output import SchedulerOutput
from asyncspec.core.spec_policy import speculation_choices
from asyncspec.layers.tensor_parallel import TensorParallel
from asyncspec.models.model_config import ModelConfig
from asyncspec.worker.model_runner import ModelRunner, StepHandle
from asyncspec.worker.profiler import ProfileSummary, StepProfiler
from asyncspec.worker.startup_heap import freeze_startup_objects
from asyncspec.worker.symm_all_reduce import make_small_all_reduce

GRAPH_MIXING_ENV = "NCCL_GRAPH_MIXING_SUPPORT"
"""NCCL's support for graphed and eager launches on one communicator; the ranks set it to 0 (unless it is
set already), since their graphed collectives run on a communicator of their own. On two H100s it made the
Llama-8B shape's TP = 2 batch-1 step about 6 % faster (docs/benchmarks.md)."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerArgs:
    """Everything a rank's process needs to start (pickled to the spawned process)."""

    rank: int
    """This process's rank."""
    size: int
    """tensor_parallel_size."""
    init_method: str
    """torch.distributed rendezvous address (tcp://127.0.0.1:<port>)."""
    config: EngineConfig
    """The engine's config (this rank's device is derived from it)."""
    model_config: ModelConfig
    """The target's config, as the engine read it."""
    max_model_len: int
    """The engine's resolved max_model_len."""
    log_level: int
    """The engine process's logging level."""


def rank_device(config: EngineConfig, rank: int) -> str:
    """cuda:<first + rank> on the GPU (first: the index in config.device, 0 by default); cpu stays cpu."""
    device = config.torch_device
    if device.type != "cuda":
        return "cpu"
    return f"cuda:{(device.index or 0) + rank}"


class RankWorker:
    """Executes the engine's commands on this rank's runner."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._handles: deque[StepHandle] = deque()
        self.profiler = StepProfiler(f"rank{runner.tp.rank}", runner.device)

    def determine_num_kv_blocks(self) -> int:
        return self.runner.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)
        if self.runner.config.freeze_gc:
            freeze_startup_objects()  # the rank's start-up is done (pool, graphs); it lives for this engine alone

    def speculation_step_costs(self) -> dict[tuple[int, int], float] | None:
        """The step-cost function as a table over every batch size and k the policy may ask about
        (a closure cannot cross the pipe)."""
        cost = self.runner.speculation_step_cost()
        spec = self.runner.spec
        if cost is None or spec is None:
            return None
        ks = speculation_choices(spec.k) if self.runner.config.adaptive_speculation else [spec.k]
        return {(n, k): cost(n, k) for n in range(1, self.runner.config.max_num_seqs + 1) for k in ks}

    def set_debug_invariants(self, on: bool) -> None:
        self.runner.set_debug_invariants(on)

    def launch(self, so: SchedulerOutput) -> None:
        self._handles.append(self.runner.launch(so))

    def collect(self) -> tuple[Any, float | None, dict[str, int]]:
        """The step's output, the device idle before it and the graph counters (sent with every
        step so that reading the engine's stats needs no round trip)."""
        output = self.runner.collect(self._handles.popleft())
        return output, self.runner.last_device_idle_seconds, self.runner.graph_stats()

    def reset_device_idle(self) -> None:
        self.runner.reset_device_idle()

    def graph_stats(self) -> dict[str, int]:
        return self.runner.graph_stats()

    def set_sync_debug_mode(self, mode: str) -> None:
        torch.cuda.set_sync_debug_mode(mode)

    def start_profile(self, trace_dir: str, with_cpu: bool) -> None:
        self.runner.call_on_stream(lambda: self.profiler.start(trace_dir, with_cpu))

    def stop_profile(self) -> ProfileSummary:
        summary: ProfileSummary = self.runner.call_on_stream(self.profiler.stop)
        return summary


def _ignore_sigterm(signum: int, frame: object) -> None:
    logging.getLogger(__name__).info("SIGTERM ignored: the engine process stops this rank")


def worker_main(args: WorkerArgs, conn: Connection) -> None:
    """The spawned process's entry point. Replies are ("ok", value) or ("error", exception, text)."""
    # Ctrl-C, and a supervisor's SIGTERM to the whole process group (systemd's control-group kill, supervisord's
    # stopasgroup), reach the ranks too: the engine process decides when they stop, after the server's drain.
    # A handler, not SIG_IGN, for SIGTERM: an ignored signal stays ignored in what a rank execs (compile workers).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _ignore_sigterm)
    _exit_with_the_engine()
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s rank{args.rank} %(name)s: %(message)s")
    try:
        worker = _start(args)
    except BaseException as e:  # reported to the engine, which raises it there
        _send_error(conn, e)
        sys.exit(1)
    conn.send(("ok", None))
    ending = "failed"
    try:
        ending = _serve(worker, conn)
    finally:
        if ending == "orphaned":
            # No one is left to wait for a clean end, and a step may be stuck in a collective with a rank
            # that stopped: closing the runner would wait for it.
            os._exit(1)
        worker.runner.close()  # the CPU stream's step, if one runs, ends before the group goes
        if dist.is_initialized():
            dist.destroy_process_group()
    if ending == "failed":
        sys.exit(1)


def _exit_with_the_engine() -> None:
    """Ends this process as soon as the engine's process is gone, whatever its threads are doing: a rank whose
    step hangs (a collective whose peer stopped) would otherwise outlive an engine that exited without stopping
    it (serve's bounded shutdown ends with os._exit, which skips the daemon children's clean-up; a SIGKILL too)."""
    parent = mp.parent_process()
    if parent is None:
        return
    sentinel = parent.sentinel

    def watch() -> None:
        wait([sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="asyncspec-engine-watch", daemon=True).start()


def _start(args: WorkerArgs) -> RankWorker:
    device = rank_device(args.config, args.rank)
    config = dataclasses.replace(args.config, device=device)
    if device == "cpu":
        # The ranks share the host's cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.size))
        backend = "gloo"
    else:
        torch.cuda.set_device(device)
        backend = "nccl"
        # Read by NCCL when it creates a communicator: set before the first. A user's own setting wins.
        os.environ.setdefault(GRAPH_MIXING_ENV, "0")
    dist.init_process_group(backend, init_method=args.init_method, rank=args.rank, world_size=args.size)
    group = dist.group.WORLD
    assert group is not None
    graph_group = None
    if backend == "nccl":
        # The graphs' collectives get a communicator of their own, so that neither communicator mixes
        # graphed and eager launches (what NCCL_GRAPH_MIXING_SUPPORT=0 requires). It is created here, by
        # one eager collective at start-up, before any graph exists: not inside a capture.
        graph_group = dist.new_group(list(range(args.size)))
        dist.all_reduce(torch.zeros(1, device=device), group=graph_group)
        torch.cuda.synchronize(device)
    small = make_small_all_reduce(group, torch.device(device), config.torch_dtype)
    tp = TensorParallel(args.rank, args.size, group, small, graph_group)
    runner = ModelRunner(config, args.model_config, args.max_model_len, tp)
    return RankWorker(runner)


def _serve(worker: RankWorker, conn: Connection) -> str:
    """Commands arrive as pickled (method, args, reply): reply "all" (every rank answers), "first"
    (rank 0 answers: a step's results) or "none". An error ends the process after reporting it (the
    group cannot go on with one rank out of step). Returns how it ended: "stopped" (told to), "failed" (an
    error) or "orphaned" (the engine's end of the pipe closed without a stop)."""
    rank = worker.runner.tp.rank
    while True:
        try:
            method, call_args, reply = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return "orphaned"
        if method == "stop":
            return "stopped"
        try:
            value = getattr(worker, method)(*call_args)
        except BaseException as e:
            logger.exception("rank %d failed in %s", rank, method)
            _send_error(conn, e)
            return "failed"
        if reply == "all" or (reply == "first" and rank == 0):
            conn.send(("ok", value))


def _send_error(conn: Connection, error: BaseException) -> None:
    text = "".join(traceback.format_exception(error))
    try:
        conn.send(("error", error, text))
    except Exception:  # an exception that does not pickle is sent as text
        try:
            conn.send(("error", None, text))
        except OSError:
            pass
