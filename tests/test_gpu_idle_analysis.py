"""The trace arithmetic of benchmarks/gpu_idle.py (the GPU runs are the device's): busy time as the union of
overlapping events clipped to a window, idle gaps charged to the event that ended last before them, and per-plan
windows."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_idle.py"
_spec = importlib.util.spec_from_file_location("gpu_idle", SCRIPT)
assert _spec is not None and _spec.loader is not None
gpu_idle = importlib.util.module_from_spec(_spec)
sys.modules["gpu_idle"] = gpu_idle
_spec.loader.exec_module(gpu_idle)


def ev(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"name": name, "ts": ts, "dur": dur, "cat": cat, "ph": "X"}


# A [0, 10), B [12, 20) after a 2 µs gap, C [15, 30) overlapping B, a copy D [35, 40) after a 5 µs gap that follows
# C (which ended last), E [40, 41) right after D.
EVENTS = [ev("A", 0, 10), ev("B", 12, 8), ev("C", 15, 15), ev("D", 35, 5, "gpu_memcpy"), ev("E", 40, 1)]


def test_device_events_keeps_kernels_and_copies_in_start_order() -> None:
    trace = [EVENTS[3], ev("cpu op", 1, 50, "cpu_op"), EVENTS[0], ev("plan 0", 0, 3, "user_annotation"), EVENTS[1]]
    assert [e["name"] for e in gpu_idle.device_events(trace)] == ["A", "B", "D"]


def test_busy_is_the_union_of_events_clipped_to_the_window() -> None:
    assert gpu_idle.busy_us(EVENTS, 0, 41) == 10 + 18 + 6  # [0,10) + [12,30) + [35,41)
    assert gpu_idle.busy_us(EVENTS, 5, 16) == 5 + 4  # [5,10) + [12,16)
    assert gpu_idle.busy_us(EVENTS, 30, 35) == 0
    assert gpu_idle.busy_us([], 0, 100) == 0


def test_gaps_are_charged_to_the_event_that_ended_last() -> None:
    result = gpu_idle.kernel_gaps(EVENTS)
    assert result["span_us"] == 41 and result["idle_us"] == 7 and result["events"] == 5
    assert result["pairs"] == [
        {"before": "C", "after": "D", "count": 1, "us": 5},
        {"before": "A", "after": "B", "count": 1, "us": 2},
    ]
    repeated = gpu_idle.kernel_gaps([ev("A", 0, 1), ev("B", 3, 1), ev("A", 6, 1), ev("B", 9, 1)])
    assert repeated["pairs"][0] == {"before": "A", "after": "B", "count": 2, "us": 4}
    assert repeated["pairs"][1] == {"before": "B", "after": "A", "count": 1, "us": 2}
    assert gpu_idle.kernel_gaps([])["idle_us"] == 0


def test_plan_windows_split_the_trace_at_each_plan() -> None:
    rows = gpu_idle.plan_windows(EVENTS, [0, 14, 33], 45)
    assert [r["window_us"] for r in rows] == [14, 19, 12]
    assert [r["events"] for r in rows] == [2, 1, 2]  # A, B | C | D, E: by their start
    assert [r["busy_us"] for r in rows] == [12, 16, 6]


def test_help_names_both_modes() -> None:
    """The modes need CUDA (the device tool runs them); --help runs anywhere."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--mode gaps" in proc.stdout and "--mode plans" in proc.stdout


def test_a_windows_busy_time_is_the_union_of_its_device_events() -> None:
    """gpu_step_speed.py's windows: under PDL a kernel's programs start inside its predecessor's time, so the
    summed durations pass the wall time; the busy time it reports is the union of the trace's device events
    (a CPU op on the host row counts for nothing)."""
    import json

    step_speed = sys.modules["gpu_step_speed"]  # imported by gpu_idle (through plan_trace)

    class FakeProfile:
        def export_chrome_trace(self, path: str) -> None:
            host = {"name": "aten::mm", "ts": 0, "dur": 100, "cat": "cpu_op", "ph": "X"}
            Path(path).write_text(json.dumps({"traceEvents": [*EVENTS, host]}))

    busy_us = step_speed.device_busy_seconds(FakeProfile()) * 1e6  # the summary's seconds, from the trace's µs
    assert math.isclose(busy_us, 10 + 18 + 6, rel_tol=1e-12)  # as gpu_idle.busy_us over [0, 41)
    assert sum(e["dur"] for e in EVENTS) == 39  # what summing would have said
    assert step_speed._busy_fraction({"gpu_busy_fraction_union": 0.93, "gpu_busy_fraction": 1.5}) == 0.93
    assert step_speed._busy_fraction({"gpu_busy_fraction_union": None, "gpu_busy_fraction": 0.4}) == 0.4


def test_kernels_by_kind_sums_each_kind_of_plan() -> None:
    # Plan 0 a prompt (20 tokens for 2 requests at k = 0), plans 1 and 2 full-batch k = 4 steps, plan 3 a part.
    shapes = [
        {"requests": 2, "k": 0, "steps": 1, "tokens": 20},
        {"requests": 2, "k": 4, "steps": 2, "tokens": 10},
        {"requests": 2, "k": 4, "steps": 1, "tokens": 10},
        {"requests": 1, "k": 4, "steps": 1, "tokens": 5},
    ]
    starts = [0, 14, 33, 40]
    rows = gpu_idle.plan_windows(EVENTS, starts, 45)
    for row, shape in zip(rows, shapes, strict=True):
        row.update(shape)
    assert [gpu_idle.plan_kind(r, 2) for r in rows] == ["prompt", "k4 full", "k4 full", "k4 part"]
    kinds = gpu_idle.kernels_by_kind(EVENTS, starts, 45, rows, streams=2)
    assert set(kinds) == {"prompt", "k4 full", "k4 part"}
    full = kinds["k4 full"]
    assert (full["plans"], full["steps"], full["window_us"]) == (2, 3, 19 + 7)
    assert full["kernels"] == {"C": [1, 15], "D": [1, 5]}  # C began in plan 1, D in plan 2
    assert kinds["prompt"]["kernels"] == {"A": [1, 10], "B": [1, 8]}
    assert list(kinds["prompt"]["kernels"]) == ["A", "B"]  # largest first
    assert kinds["k4 part"]["kernels"] == {"E": [1, 1]}
