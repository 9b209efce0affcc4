"""The engine's side of tensor parallelism: one spawned process per rank, each holding its shard
of the target (and a replica of the draft), driven through one pipe per rank.

A step crosses as the SchedulerOutput, pickled once and written to every rank's pipe; nothing
waits for the ranks at launch, so the asynchronous loop keeps a step in flight across all of them.
Only rank 0 answers a collect. Any rank that raises reports it and exits; any rank that dies is
seen through its process sentinel: either way every rank is stopped and the call raises
WorkerDiedError (no hang on a collective that will never complete)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
import time
import weakref
from collections import deque
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from asyncspec.config import EngineConfig
from asyncspec.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from asyncspec.core.spec_policy import StepCost
from asyncspec.errors import AsyncSpecError, WorkerDiedError
from asyncspec.models.model_config import ModelConfig
from asyncspec.worker.model_runner import GRAPH_STATS, StepHandle
from asyncspec.worker.profiler import ProfileSummary
from asyncspec.worker.tp_worker import WorkerArgs, worker_main

logger = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 10.0
"""How long `close` waits for a rank to exit by itself before killing it."""
STORE_DIR_PREFIX = "asyncspec-tp-"
"""Rendezvous directories are <temp>/asyncspec-tp-<engine pid>-<random>."""
_START_UP = ("starting", "determine_num_kv_blocks", "initialize_kv_cache")
"""Calls whose AsyncSpecError (a ConfigError: no memory for the KV pool, ...) is raised as itself."""


class TensorParallelExecutor:
    """Runs the model over `config.tensor_parallel_size` worker processes; the same methods as
    ModelRunner that the engine core calls."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int) -> None:
        self.config = config
        self.size = config.tensor_parallel_size
        self.last_device_idle_seconds: float | None = None
        """Rank 0's device idle before the last collected step."""
        self.last_wait_seconds = 0.0
        """Time the last `collect` blocked on rank 0's reply (what this process waited for the devices)."""
        self._handles: deque[StepHandle] = deque()
        self._collect_ranks: list[int] | None = None
        """The ranks asked for the oldest step's results and not all heard from yet (None: not asked)."""
        self._collect_replies: dict[int, Any] = {}
        """Their replies so far."""
        self._last_collected: tuple[StepHandle, ModelRunnerOutput] | None = None
        """The last step collected and its output."""
        self._abandoned: tuple[list[int], str, dict[int, Any]] | None = None
        """A command other than collect whose wait for replies was interrupted (Ctrl-C): its ranks, name and the
        replies read so far. The rest come first in the pipes, and the next reader drops them."""
        self._graph_stats: dict[str, int] = dict.fromkeys(GRAPH_STATS, 0)
        self._dead: WorkerDiedError | None = None
        self._debug = False
        self._store_dir = make_store_dir()
        context = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs: list[BaseProcess] = []
        # Ranks are stopped when the executor is closed, collected or the interpreter exits; the
        # finalizer exists before the first rank does, so that a failed start leaks nothing.
        self._finalizer = weakref.finalize(self, _stop_all, self._conns, self._procs, self._store_dir)
        level = logging.getLogger().getEffectiveLevel()
        init_method = f"file://{os.path.join(self._store_dir, 'store')}"
        start = time.perf_counter()
        try:
            for rank in range(self.size):
                parent, child = context.Pipe()
                args = WorkerArgs(rank, self.size, init_method, config, model_config, max_model_len, level)
                proc = context.Process(target=worker_main, args=(args, child), name=f"asyncspec-tp{rank}", daemon=True)
                self._conns.append(parent)
                proc.start()
                self._procs.append(proc)
                child.close()
            self._replies(range(self.size), "starting")
        except BaseException:
            self.close()
            raise
        logger.info("%d tensor-parallel ranks ready in %.1f s", self.size, time.perf_counter() - start)

    # -- the engine core's interface ------------------------------------------------------------
    def determine_num_kv_blocks(self) -> int:
        """The smallest pool any rank can hold (every rank holds the same block ids)."""
        return min(self._call_all("determine_num_kv_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call_all("initialize_kv_cache", num_blocks)

    def speculation_step_cost(self) -> StepCost | None:
        table = self._call_first("speculation_step_costs")
        if table is None:
            return None

        def step_cost(num_decodes: int, k: int) -> float:
            return table[(num_decodes, k)]

        return step_cost

    def set_debug_invariants(self, on: bool) -> None:
        """Also makes every rank answer each collect, and checks that they agree (see collect)."""
        self._call_all("set_debug_invariants", on)
        self._debug = on

    def launch(self, so: SchedulerOutput) -> StepHandle:
        """Sends the step to every rank and returns at once."""
        self._send("launch", (so,), "none")
        handle = StepHandle()
        self._handles.append(handle)
        return handle

    def collect(self, handle: StepHandle) -> ModelRunnerOutput:
        """Rank 0's results of the oldest step in flight (steps are collected in launch order). A collect
        interrupted while it waits (Ctrl-C in LLM.generate) may be called again for the same step: the ranks were
        asked once, and their replies, whenever they come, are that step's."""
        if self._dead is not None:
            raise WorkerDiedError(*self._dead.args)
        if self._last_collected is not None and self._last_collected[0] is handle:
            return self._last_collected[1]  # interrupted after its collect returned, before the engine took it
        if not self._handles or self._handles[0] is not handle:
            raise RuntimeError("steps must be collected in the order they were launched")
        wait_start = time.perf_counter()
        self._drop_abandoned()
        self._ask_collect()
        assert self._collect_ranks is not None
        replies = self._replies(self._collect_ranks, "collect", self._collect_replies)
        self._collect_ranks = None
        self._collect_replies = {}
        self._handles.popleft()
        if len(replies) > 1:
            check_ranks_agree([reply[0] for reply in replies])
        self.last_wait_seconds = time.perf_counter() - wait_start
        output, idle, self._graph_stats = replies[0]
        self.last_device_idle_seconds = idle
        self._last_collected = (handle, output)
        return output

    def _ask_collect(self) -> None:
        """Asks the ranks for the oldest step's results, unless an interrupted collect already did."""
        if self._collect_ranks is None:
            ranks = list(range(self.size)) if self._debug else [0]
            self._send("collect", (), "all" if self._debug else "first")
            self._collect_ranks = ranks

    def _take_pending_collect(self) -> None:
        """Reads the replies of a collect that was interrupted (Ctrl-C) before a command that waits for replies
        of its own: they come first in the pipes. The next collect returns them."""
        if self._collect_ranks is not None and self._dead is None:
            self._replies(self._collect_ranks, "collect", self._collect_replies)

    def reset_device_idle(self) -> None:
        self._send("reset_device_idle", (), "none")

    def graph_stats(self) -> dict[str, int]:
        """Rank 0's graph counters as of the last collected step (readable after a failure too)."""
        return dict(self._graph_stats)

    def set_sync_debug_mode(self, mode: str) -> None:
        """torch.cuda.set_sync_debug_mode on every rank ("error": a step that synchronizes the host
        with its device fails; tests of the hot loop)."""
        self._call_all("set_sync_debug_mode", mode)

    def start_profile(self, trace_dir: str, with_cpu: bool = True) -> None:
        """Starts torch.profiler on every rank (each writes its own trace into trace_dir). A rank's
        failure ends the group, so the caller checks the order of calls and the directory first."""
        self._call_all("start_profile", trace_dir, with_cpu)

    def stop_profile(self) -> list[ProfileSummary]:
        """Stops every rank's profiler; their summaries in rank order."""
        return self._call_all("stop_profile")

    def close(self) -> None:
        """Stops every rank (politely, then by force) and frees the rendezvous files; idempotent.
        Call it with no step in progress on another thread (AsyncEngine.shutdown waits for its step):
        the pipes are not shared between threads."""
        if self._dead is None:
            self._dead = WorkerDiedError("the engine was shut down: its tensor-parallel workers are stopped")
        self._finalizer()

    def check_health(self) -> None:
        """Raises WorkerDiedError (after stopping every rank) if any rank has exited."""
        self._check_alive()

    # -- plumbing -------------------------------------------------------------------------------
    def _call_all(self, method: str, *args: Any) -> list[Any]:
        return self._call(method, args, list(range(self.size)), "all")

    def _call_first(self, method: str, *args: Any) -> Any:
        return self._call(method, args, [0], "first")[0]

    def _call(self, method: str, args: tuple[Any, ...], ranks: list[int], reply: str) -> list[Any]:
        """Sends a command and waits for the replies of `ranks`. Ctrl-C in that wait leaves the command to the
        ranks; its replies, whenever they come, are dropped by the next reader (not taken for its own)."""
        self._take_pending_collect()
        self._drop_abandoned()
        self._send(method, args, reply)
        values: dict[int, Any] = {}
        try:
            return self._replies(ranks, method, values)
        except KeyboardInterrupt:
            if self._dead is None:
                self._abandoned = (ranks, method, values)
            raise

    def _drop_abandoned(self) -> None:
        """Reads and drops the replies of an interrupted command (`_call`): they come first in the pipes."""
        if self._abandoned is not None and self._dead is None:
            ranks, method, values = self._abandoned
            self._replies(ranks, method, values)
        self._abandoned = None

    def _send(self, method: str, args: tuple[Any, ...], reply: str) -> None:
        self._check_alive()
        message = pickle.dumps((method, args, reply), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for rank, conn in enumerate(self._conns):
                try:
                    conn.send_bytes(message)
                except OSError:
                    self._raise_pending_error(rank)
                    self._fail(f"rank {rank} is unreachable ({self._describe(rank)})")
        except KeyboardInterrupt:
            # Some ranks may hold the command and others not, or one a part of it: they cannot go on in step.
            self._interrupted(f"sending {method} to the ranks")
            raise

    def _replies(self, ranks: Any, what: str, values: dict[int, Any] | None = None) -> list[Any]:
        """One reply from each of `ranks`, in rank order, while watching every rank: an error reply
        or an exit from any rank fails the executor. `values` keeps the replies read so far (if the wait is
        interrupted, a later call with it waits only for the others)."""
        values = {} if values is None else values
        pending = {rank: self._conns[rank] for rank in ranks if rank not in values}
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs)}
        watched = {conn: rank for rank, conn in enumerate(self._conns)}
        while pending:
            ready = wait([*watched, *sentinels])
            # Read replies first: a rank that answered and then exited (a stop) is not a failure.
            for item in ready:
                rank = watched.get(item) if isinstance(item, Connection) else None
                if rank is None:
                    continue
                try:
                    reply = self._conns[rank].recv()
                    if reply[0] != "error" and rank in pending:
                        values[rank] = reply[1]
                except (EOFError, OSError):
                    self._fail(self._exit_message(rank, what))
                except KeyboardInterrupt:
                    if rank not in values:  # a reply read in part, or read and not kept: the pipe is out of step
                        self._interrupted(f"reading rank {rank}'s reply to {what}")
                    raise
                if reply[0] == "error":
                    self._raise_error(rank, what, reply)
                if rank not in pending:
                    self._fail(f"rank {rank} answered {what} unexpectedly")
                del pending[rank]
            for item in ready:
                rank = sentinels.get(item) if isinstance(item, int) else None
                if rank is not None and not self._conns[rank].poll():
                    self._fail(self._exit_message(rank, what))
        return [values[rank] for rank in sorted(values)]

    def _interrupted(self, what: str) -> None:
        """Ctrl-C came in a pipe's read or write, not in the wait between them (where it is harmless): the ranks'
        commands and replies are no longer known to match, so the ranks are stopped (a clear error for the next
        call, not a hang)."""
        self._stop()
        self._dead = WorkerDiedError(
            f"interrupted while {what}: the tensor-parallel ranks were stopped, since they could be out of step; "
            f"start a new engine"
        )

    def _raise_error(self, rank: int, what: str, reply: tuple[Any, ...]) -> None:
        error, text = reply[1], reply[2]
        logger.error("tensor-parallel rank %d failed during %s:\n%s", rank, what, text)
        # A rank whose peer died mid-collective fails with a transport error (a reset connection) that may reach
        # us before the dead peer's exit does: name the peer, the cause, not the rank that reported it.
        peer = self._exited_peer(rank) if what not in _START_UP else None
        message = f"tensor-parallel rank {rank} failed during {what}: {error!r}"
        if peer is not None:
            message = (
                f"tensor-parallel rank {peer} exited ({self._describe(peer)}) and rank {rank} failed during {what}: "
                f"{error!r}"
            )
        self._stop()
        self._dead = WorkerDiedError(message)
        if isinstance(error, AsyncSpecError) and what in _START_UP:
            raise error  # a config or model error: the same message as with one GPU
        raise self._dead

    def _exited_peer(self, rank: int, grace_s: float = 0.5) -> int | None:
        """The lowest other rank that has exited, or exits within `grace_s` (a killed process closes its sockets
        a moment before it can be reaped); None if every other rank still runs."""
        sentinels = {p.sentinel: other for other, p in enumerate(self._procs) if other != rank}
        exited = wait(list(sentinels), timeout=grace_s) if sentinels else []
        return min((sentinels[s] for s in exited if isinstance(s, int)), default=None)

    def _fail(self, message: str) -> None:
        self._stop()
        self._dead = WorkerDiedError(f"{message}; every rank was stopped and the engine cannot continue")
        raise self._dead

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise WorkerDiedError(*self._dead.args)
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive():
                self._raise_pending_error(rank)
                self._fail(f"rank {rank} is not running ({self._describe(rank)})")

    def _raise_pending_error(self, rank: int) -> None:
        """A rank that failed in a command nobody waits a reply to (launch, or collect on a rank
        other than 0) left its error in the pipe: raise that, not a bare exit."""
        conn = self._conns[rank]
        try:
            while conn.poll():
                reply = conn.recv()
                if reply[0] == "error":
                    self._raise_error(rank, "a step", reply)
        except (EOFError, OSError):
            pass

    def _exit_message(self, rank: int, what: str) -> str:
        message = f"rank {rank} exited during {what} ({self._describe(rank)})"
        if what == "starting" and self._procs[rank].exitcode == 1:
            # It failed before it could report: most often a spawned process importing a script that starts an
            # engine at import time, whose own error then went to the rank's stderr alone.
            message += (
                "; its error is on its stderr. A script that starts an engine with tensor parallelism or "
                'worker_process must do so under `if __name__ == "__main__":` (each rank imports the script)'
            )
        return message

    def _describe(self, rank: int) -> str:
        proc = self._procs[rank]
        # Its pipe closes a moment before the kernel reports the exit: wait briefly for the status.
        proc.join(1.0)
        code = proc.exitcode
        if code is None:
            return f"pid {proc.pid}"
        if code < 0:
            return f"pid {proc.pid} killed by signal {-code}"
        return f"pid {proc.pid} exit status {code}"

    def _stop(self) -> None:
        """After a failure: the other ranks may be blocked in a collective that will never complete,
        so they are killed at once."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        self._finalizer()


def check_ranks_agree(outputs: list[ModelRunnerOutput]) -> None:
    """Debug mode: every rank sampled the same tokens, verified the same drafts and holds the same
    computed counts. Each rank feeds its own sampled tokens to its next step, so ranks that parted
    would compute a different batch each, silently: this is the invariant that rules it out."""
    first = outputs[0]
    for rank, other in enumerate(outputs[1:], start=1):
        for field in ("req_ids", "sampled_token_ids", "num_draft_tokens", "step_runs", "device_num_computed_tokens"):
            if getattr(other, field) != getattr(first, field):
                raise AssertionError(
                    f"tensor-parallel rank {rank} parted from rank 0 in {field}: "
                    f"{getattr(other, field)!r} != {getattr(first, field)!r}"
                )


def make_store_dir() -> str:
    """A fresh rendezvous directory for the ranks' process group, named by this process's id; first removes those
    of engine processes that died without stopping their ranks (SIGKILL, a hard exit), which nothing else would."""
    remove_stale_store_dirs()
    return tempfile.mkdtemp(prefix=f"{STORE_DIR_PREFIX}{os.getpid()}-")


def remove_stale_store_dirs(directory: str | None = None) -> None:
    """Removes the rendezvous directories under `directory` (the temporary one) whose process has exited."""
    directory = directory or tempfile.gettempdir()
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        owner = name[len(STORE_DIR_PREFIX) :].split("-", 1)[0]
        if not name.startswith(STORE_DIR_PREFIX) or not owner.isdigit() or _process_exists(int(owner)):
            continue
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def _stop_all(conns: list[Connection], procs: list[BaseProcess], store_dir: str) -> None:
    message = pickle.dumps(("stop", (), "none"))
    for conn in conns:
        try:
            conn.send_bytes(message)
        except OSError:
            pass
    deadline = time.monotonic() + _STOP_TIMEOUT_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)
    for conn in conns:
        conn.close()
    shutil.rmtree(store_dir, ignore_errors=True)
