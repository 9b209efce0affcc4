"""Where the GPU waits, from a torch.profiler trace of the engine (one call on one card).

Two views:
- `--mode gaps` (default): a batch-1 greedy decode (`--model`, 128 new tokens, the default loop). Of the steady
  middle of the run, the GPU's idle time between consecutive kernels and copies, summed by the pair of
  neighbours around each gap: what follows what when the stream waits (a graph boundary, a copy engine, the host).
- `--mode plans`: one closed batch of `--streams` requests of the bundled target, with and without its draft. Per
  plan of the scheduler: its window (from its scheduling to the next plan's), the GPU's busy time and the kernels
  inside that window, and the plan's shape (requests, k, proposals, steps, tokens); then per kind of plan (prompt,
  k<k> full, k<k> part) its kernels a step, to say what a speculative step spends beside a plain one.

    python3 benchmarks/gpu_idle.py --mode gaps --model llama-1b --output $OUT/gaps.json        # GPU, ~30 s
    python3 benchmarks/gpu_idle.py --mode plans --streams 128 --output $OUT/plans.json          # GPU, ~60 s

Profiler durations run long under programmatic dependent launch (a kernel's programs start early and wait), so
busy times are upper bounds; idle gaps are not affected.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: asyncspec without an install
sys.path.insert(0, str(Path(__file__).resolve().parent))

from plan_trace import DRAFT_SETTINGS, ENGINE_SETTINGS  # noqa: E402  (after the path setup)

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def device_events(trace: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trace's kernels, copies and memsets (chrome-trace events with ts and dur in µs), by start time."""
    return sorted((e for e in trace if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])


def busy_us(events: list[dict[str, Any]], begin: float, end: float) -> float:
    """µs within [begin, end) during which at least one of `events` (sorted by start) ran."""
    total, run_start, run_end = 0.0, None, None
    for e in events:
        a, b = max(e["ts"], begin), min(e["ts"] + e["dur"], end)
        if b <= a:
            continue
        if run_end is None or a > run_end:
            if run_end is not None:
                total += run_end - run_start
            run_start, run_end = a, b
        else:
            run_end = max(run_end, b)
    if run_end is not None:
        total += run_end - run_start
    return total


def kernel_gaps(events: list[dict[str, Any]], top: int = 12) -> dict[str, Any]:
    """Idle time between consecutive device events (sorted by start): the span, the idle total, and the gaps summed
    by (the event that ended last before the gap, the event after it), largest first."""
    if not events:
        return {"span_us": 0.0, "idle_us": 0.0, "events": 0, "pairs": []}
    pairs: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])
    idle = 0.0
    last = events[0]
    end = last["ts"] + last["dur"]
    for e in events[1:]:
        gap = e["ts"] - end
        if gap > 0:
            entry = pairs[(last["name"][:70], e["name"][:70])]
            entry[0] += 1
            entry[1] += gap
            idle += gap
        if e["ts"] + e["dur"] > end:
            end, last = e["ts"] + e["dur"], e
    span = end - events[0]["ts"]
    ranked = sorted(pairs.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "span_us": span,
        "idle_us": idle,
        "events": len(events),
        "pairs": [{"before": a, "after": b, "count": int(n), "us": t} for (a, b), (n, t) in ranked],
    }


def plan_windows(events: list[dict[str, Any]], starts: list[float], end: float) -> list[dict[str, float]]:
    """Per plan starting at starts[i] (µs, sorted), up to the next plan's start (the last: `end`): the window, the
    device's busy time and the device events that began inside it."""
    rows = []
    for i, begin in enumerate(starts):
        stop = starts[i + 1] if i + 1 < len(starts) else end
        inside = [e for e in events if begin <= e["ts"] < stop]
        rows.append({"window_us": stop - begin, "busy_us": busy_us(events, begin, stop), "events": len(inside)})
    return rows


def plan_kind(row: dict[str, Any], streams: int) -> str:
    """A plan's kind for the kernel tables: `prompt` where it holds more tokens than its requests' decodes could
    (k + 1 each), else `k<k> full` (every request of the closed batch) or `k<k> part`."""
    if row["tokens"] > row["requests"] * (row["k"] + 1):
        return "prompt"
    return f"k{row['k']} {'full' if row['requests'] == streams else 'part'}"


def kernels_by_kind(
    events: list[dict[str, Any]], starts: list[float], end: float, rows: list[dict[str, Any]], streams: int
) -> dict[str, dict[str, Any]]:
    """Per plan kind (`plan_kind`): its plans, steps, window and busy µs, and every device event name that began in
    its plans' windows with [count, summed µs], largest first: where a kind's step spends its GPU time."""
    kinds: dict[str, dict[str, Any]] = {}
    for i, (begin, row) in enumerate(zip(starts, rows, strict=False)):
        stop = starts[i + 1] if i + 1 < len(starts) else end
        kind = kinds.setdefault(
            plan_kind(row, streams), {"plans": 0, "steps": 0, "window_us": 0.0, "busy_us": 0.0, "kernels": {}}
        )
        kind["plans"] += 1
        kind["steps"] += row["steps"]
        kind["window_us"] += row["window_us"]
        kind["busy_us"] += row["busy_us"]
        for e in events:
            if begin <= e["ts"] < stop:
                entry = kind["kernels"].setdefault(e["name"][:90], [0, 0.0])
                entry[0] += 1
                entry[1] += e["dur"]
    for kind in kinds.values():
        kind["kernels"] = dict(sorted(kind["kernels"].items(), key=lambda kv: -kv[1][1]))
    return kinds


def _trace(run) -> list[dict[str, Any]]:
    """Runs `run()` under torch.profiler (CPU and CUDA activity) and returns the chrome trace's events."""
    import torch

    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        return json.loads(Path(path).read_text())["traceEvents"]


def mode_gaps(model: str) -> dict[str, Any]:
    import gpu_step_speed as gss

    import asyncspec

    # The closed batch's engine at batch 1 (the asynchronous loop is the CUDA default anyway).
    kwargs: dict[str, Any] = dict(ENGINE_SETTINGS, max_num_seqs=1, gpu_memory_utilization=0.5)
    if gss.MODELS[model]["dummy"]:
        kwargs["load_format"] = "dummy"
    llm = asyncspec.LLM(gss.model_dir(model), **kwargs)
    prompt = gss.load_prompts(1)
    params = asyncspec.SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    walls = []
    for _ in range(3):
        t = time.perf_counter()
        llm.generate(prompt, params)
        walls.append((time.perf_counter() - t) * 1e3)
    events = device_events(_trace(lambda: llm.generate(prompt, params)))
    steady = events[len(events) // 5 : 4 * len(events) // 5]  # past the prompt, before the drain
    return {"model": model, "wall_ms": walls, **kernel_gaps(steady)}


def mode_plans(streams: int) -> dict[str, Any]:
    import torch
    from gpu_step_speed import TARGET, load_prompts

    import asyncspec

    prompts = load_prompts(streams)
    full = asyncspec.SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    result: dict[str, Any] = {"streams": streams, "configs": {}}
    for name, extra in (("draft", DRAFT_SETTINGS), ("plain", {})):
        llm = asyncspec.LLM(str(TARGET), **ENGINE_SETTINGS, **extra)
        llm.generate(prompts, asyncspec.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
        walls = []
        for _ in range(2):
            t = time.perf_counter()
            llm.generate(prompts, full)
            walls.append((time.perf_counter() - t) * 1e3)
        scheduler = llm.engine.engine_core.scheduler
        schedule = scheduler.schedule
        shapes: list[dict[str, int]] = []

        def recording(schedule=schedule, shapes=shapes):
            with torch.profiler.record_function(f"plan {len(shapes)}"):
                so = schedule()
            shapes.append(
                {
                    "requests": len(so.num_scheduled_tokens),
                    "k": so.num_speculative_tokens,
                    "proposals": so.num_proposals,
                    "steps": so.num_steps,
                    "tokens": so.total_num_scheduled_tokens,
                }
            )
            return so

        scheduler.schedule = recording
        try:
            trace = _trace(lambda llm=llm: llm.generate(prompts, full))
        finally:
            scheduler.schedule = schedule
        marks = sorted(
            (e for e in trace if str(e.get("name", "")).startswith("plan ") and e.get("ph") == "X"),
            key=lambda e: e["ts"],
        )
        events = device_events(trace)
        end = max(e["ts"] + e["dur"] for e in events)
        rows = plan_windows(events, [m["ts"] for m in marks], end)
        for row, shape in zip(rows, shapes, strict=False):
            row.update(shape)
        rows = rows[: len(shapes)]
        by_kind = kernels_by_kind(events, [m["ts"] for m in marks], end, rows, streams)
        result["configs"][name] = {"unprofiled_wall_ms": walls, "plans": rows, "kinds": by_kind}
        del llm, trace, events
        gc.collect()  # the next engine sizes its KV pool from the memory this one frees
        torch.cuda.empty_cache()
    return result


def print_kinds(kinds: dict[str, dict[str, Any]], top: int = 16) -> None:
    """Per plan kind: µs of window and of busy GPU a step, device events a step, and its largest kernels a step."""
    for name, kind in kinds.items():
        steps = max(kind["steps"], 1)
        events = sum(n for n, _ in kind["kernels"].values())
        print(
            f"  -- {name}: {kind['plans']} plans, {kind['steps']} steps; a step: window {kind['window_us'] / steps:.1f}"
            f" us, busy {kind['busy_us'] / steps:.1f} us, {events / steps:.1f} device events"
        )
        for kernel, (n, us) in list(kind["kernels"].items())[:top]:
            print(f"     {us / steps:8.1f} us {n / steps:6.2f}x  {us / max(n, 1):6.2f} us each  {kernel[:80]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("gaps", "plans"), default="gaps")
    ap.add_argument("--model", default="llama-1b", help="gaps: bundled, llama-1b or llama-8b")
    ap.add_argument("--streams", type=int, default=128, help="plans: requests in the closed batch")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    result = mode_gaps(args.model) if args.mode == "gaps" else mode_plans(args.streams)
    result["command"] = " ".join(sys.argv)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1))
    if args.mode == "gaps":
        print(
            f"{result['model']}: wall {[round(w, 1) for w in result['wall_ms']]} ms; steady span "
            f"{result['span_us'] / 1e3:.2f} ms, idle {result['idle_us'] / 1e3:.3f} ms "
            f"({result['idle_us'] / max(result['span_us'], 1e-9):.1%})"
        )
        for p in result["pairs"]:
            print(
                f"  {p['us']:9.1f} us  n={p['count']:4d}  {p['us'] / p['count']:6.2f} us  {p['before']} -> {p['after']}"
            )
    else:
        for name, config in result["configs"].items():
            print(f"== {name}: unprofiled {[round(w, 1) for w in config['unprofiled_wall_ms']]} ms")
            for i, row in enumerate(config["plans"]):
                print(f"  {i:3d} {json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()})}")
            print_kinds(config["kinds"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
