"""The step profiler: exact device-time arithmetic over a trace, the CPU trace it writes, and calls
out of order refused with a clear error that leaves the engine serving."""

from __future__ import annotations

import json
import os

import pytest
import torch

from asyncspec import LLM, SamplingParams
from asyncspec.errors import ProfilerError
from asyncspec.worker.profiler import StepProfiler, summarize_trace
from tests.conftest import TARGET_MODEL


def _kernel(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_summary_counts_overlaps_once_and_ranks_kernels_by_time() -> None:
    trace = {
        "traceEvents": [
            _kernel("gemm", 100.0, 50.0),  # 100..150
            _kernel("nccl", 120.0, 60.0),  # 120..180: overlaps the gemm
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 200.0, "dur": 10.0},  # 200..210
            _kernel("gemm", 300.0, 50.0),  # 300..350
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 1000.0},  # host work: ignored
        ]
    }
    s = summarize_trace(trace, "rank0", "t.json")
    assert s.num_device_events == 4
    assert s.device_span_seconds == pytest.approx(250e-6)
    assert s.device_busy_seconds == pytest.approx((80 + 10 + 50) * 1e-6)
    assert [(k.name, k.count) for k in s.top_kernels] == [("gemm", 2), ("nccl", 1), ("Memcpy DtoH", 1)]
    assert s.top_kernels[0].total_seconds == pytest.approx(100e-6)
    assert [(g.before, g.after, g.count) for g in s.idle_gaps] == [
        ("Memcpy DtoH", "gemm", 1),
        ("nccl", "Memcpy DtoH", 1),
    ]
    assert [g.total_seconds for g in s.idle_gaps] == pytest.approx([90e-6, 20e-6])
    empty = summarize_trace({"traceEvents": []}, "engine", "t.json")
    assert empty.num_device_events == 0 and empty.device_busy_seconds == 0.0


def test_cpu_profile_writes_a_trace_of_the_ops_run(tmp_path) -> None:
    profiler = StepProfiler("engine", torch.device("cpu"))
    profiler.start(tmp_path / "traces")
    with pytest.raises(ProfilerError, match="already running"):
        profiler.start(tmp_path)
    torch.randn(64, 64) @ torch.randn(64, 64)
    summary = profiler.stop()
    names = {e.get("name") for e in json.loads(open(summary.trace_path).read())["traceEvents"]}
    assert "aten::mm" in names
    assert summary.process == "engine" and summary.trace_path.startswith(str(tmp_path / "traces"))
    with pytest.raises(ProfilerError, match="not running"):
        profiler.stop()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_llm_profiles_generation_and_refuses_calls_out_of_order(tmp_path, async_scheduling) -> None:
    """The asynchronous loop on the CPU runs its steps on a thread of their own: the profiler is
    started there, or the trace would hold none of the model's operations."""
    llm = LLM(
        str(TARGET_MODEL),
        device="cpu",
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=64,
        skip_tokenizer_init=True,
        async_scheduling=async_scheduling,
    )
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(ProfilerError, match="not running"):
        llm.stop_profile()
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ProfilerError, match="cannot create the trace directory"):
        llm.start_profile(blocker / "traces")
    llm.start_profile(tmp_path)
    with pytest.raises(ProfilerError, match="already running"):
        llm.start_profile(tmp_path)
    out = llm.generate([[5, 6, 7, 8]], params)
    (summary,) = llm.stop_profile()
    assert summary.process == "engine"
    events = json.loads(open(summary.trace_path).read())["traceEvents"]
    assert any(e.get("name") == "aten::embedding" for e in events), "the model's forward is not in the trace"
    assert llm.generate([[5, 6, 7, 8]], params)[0].token_ids == out[0].token_ids
    # A second window in the same second gets a trace of its own.
    llm.start_profile(tmp_path)
    llm.generate([[5, 6, 7, 8]], params)
    (second,) = llm.stop_profile()
    assert second.trace_path != summary.trace_path
    assert os.path.exists(summary.trace_path) and os.path.exists(second.trace_path)
    llm.start_profile(tmp_path)
    llm.shutdown()  # stops the running profiler too
