"""torch.profiler over a window of engine steps: one Chrome trace per process (the engine's, or each
tensor-parallel rank's) and a summary of where the device's time went."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from asyncspec.errors import ProfilerError

# Chrome-trace categories of device work (kernels launched directly or by a graph replay, copies, fills).
_DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


@dataclass
class KernelTime:
    """One kernel name's share of the profiled window."""

    name: str
    """The kernel's name as the trace records it."""
    count: int
    """How many times it ran."""
    total_seconds: float
    """Its summed duration."""


@dataclass
class IdleGap:
    """The device's idle time between two kinds of consecutive events."""

    before: str
    """The name of the event that ended the busy stretch (truncated to 80 characters)."""
    after: str
    """The name of the event that began the next one."""
    count: int
    """How many such gaps."""
    total_seconds: float
    """Their summed length."""


@dataclass
class ProfileSummary:
    """What one process's device did during the profiled window."""

    process: str
    """"engine" for a single-process engine, "rank<N>" for a tensor-parallel rank."""
    trace_path: str
    """The Chrome trace (open it in chrome://tracing or Perfetto)."""
    device_span_seconds: float = 0.0
    """From the first device event's start to the last one's end (0 without device work)."""
    device_busy_seconds: float = 0.0
    """The union of the device events' intervals: span minus busy is the device's idle time."""
    num_device_events: int = 0
    """Kernels, copies and fills recorded."""
    top_kernels: list[KernelTime] = field(default_factory=list)
    """Device time by name, largest first."""
    idle_gaps: list[IdleGap] = field(default_factory=list)
    """Where the device waited: idle time between consecutive device events, by the pair of names
    around it, largest first (a wait after a step's last kernel is the host's turn)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize_trace(trace: dict[str, Any], process: str, trace_path: str, top: int = 100) -> ProfileSummary:
    """The device-time summary of a Chrome trace as torch.profiler exports it."""
    events = [e for e in trace.get("traceEvents", []) if e.get("cat") in _DEVICE_CATEGORIES and "dur" in e]
    summary = ProfileSummary(process, trace_path, num_device_events=len(events))
    if not events:
        return summary
    ordered = sorted(events, key=lambda e: float(e["ts"]))
    busy = 0.0
    gaps: dict[tuple[str, str], list[float]] = {}
    start = float(ordered[0]["ts"])
    end = start + float(ordered[0]["dur"])
    last_name = str(ordered[0].get("name", "?"))[:80]
    for e in ordered[1:]:
        s, d, name = float(e["ts"]), float(e["dur"]), str(e.get("name", "?"))[:80]
        if s > end:
            busy += end - start
            gaps.setdefault((last_name, name), []).append(s - end)
            start, end = s, s + d
        else:
            end = max(end, s + d)
        if s + d >= end:
            last_name = name
    busy += end - start
    summary.device_span_seconds = (end - float(ordered[0]["ts"])) / 1e6  # trace times are µs
    summary.device_busy_seconds = busy / 1e6
    ranked_gaps = sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:top]
    summary.idle_gaps = [IdleGap(b, a, len(g), sum(g) / 1e6) for (b, a), g in ranked_gaps]
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(str(e.get("name", "?")), []).append(float(e["dur"]))
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    summary.top_kernels = [KernelTime(name, len(durs), sum(durs) / 1e6) for name, durs in ranked]
    return summary


class StepProfiler:
    """Starts and stops torch.profiler for one process; CUDA activity is recorded where the device
    is a GPU (kernels replayed from CUDA graphs included)."""

    def __init__(self, process: str, device: torch.device) -> None:
        self.process = process
        self.device = device
        self._profile: profile | None = None
        self._trace_dir: Path | None = None
        self._num_traces = 0

    def start(self, trace_dir: str | Path, with_cpu: bool = True) -> None:
        """with_cpu=False records device activity only: far less host overhead, so the device's
        idle gaps are those of an unprofiled run."""
        if self._profile is not None:
            raise ProfilerError("the profiler is already running: call stop_profile() first")
        path = Path(trace_dir)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ProfilerError(f"cannot create the trace directory {path}: {e}") from e
        activities = [ProfilerActivity.CPU] if with_cpu or self.device.type != "cuda" else []
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        prof = profile(activities=activities)
        prof.__enter__()
        self._profile, self._trace_dir = prof, path

    def discard(self) -> None:
        """Stops recording without writing a trace (the engine shuts down with it running)."""
        prof, self._profile = self._profile, None
        if prof is not None:
            prof.__exit__(None, None, None)

    def stop(self) -> ProfileSummary:
        """Waits for the device's queued work, writes the trace and returns its summary."""
        if self._profile is None or self._trace_dir is None:
            raise ProfilerError("the profiler is not running: call start_profile(trace_dir) first")
        prof, self._profile = self._profile, None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        prof.__exit__(None, None, None)
        self._num_traces += 1
        now = time.time_ns()
        stamp = time.strftime("%Y%m%dT%H%M%S", time.localtime(now // 10**9)) + f".{now % 10**9:09d}"
        trace_path = self._trace_dir / f"{self.process}-{stamp}-pid{os.getpid()}-{self._num_traces}.trace.json"
        prof.export_chrome_trace(str(trace_path))
        trace = json.loads(trace_path.read_text())
        return summarize_trace(trace, self.process, str(trace_path))
