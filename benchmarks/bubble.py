"""Issue 9's bubble: how long the GPU idles between consecutive steps, synchronous vs asynchronous loop.

For each model, speculation setting, batch size and loop, one steady decode window (the requests prefilled,
3 warm-up steps, then `--steps` engine steps timed): wall time, tokens, TPOT at batch 1, and the device's idle
time between steps, measured by the engine's own CUDA events around each step (`llm.stats()`:
device_idle_seconds_total), as a fraction of the window's wall time. The events sit at each step's first
device work (its input copy) and after its last, so the idle is the bubble between steps, not the launch
gaps inside one. Then a timeline of a few steps per loop (host planning and launching, GPU busy from CUDA
events) for the plot.

    python3 benchmarks/bubble.py --output $OUT/bubble.json            # ~3 min on an H100
    python benchmarks/bubble.py --plot benchmarks/results/gpu_bubble.json --out docs/img/   # the timeline
    python benchmarks/bubble.py --smoke --output /tmp/bubble.json      # CPU: the code paths

Models: `bundled` (models/stdlib-coder-target, with its draft, k=4) and `llama-1b` (the Llama-3.2-1B shape,
random weights; n-gram speculation, k=4). Speculation uses the engine default (adaptive k).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_step_speed as gss  # noqa: E402  (the benchmark next door: engine construction and prompts)

SPEC = {
    "bundled": {"speculative_method": "draft_model", "num_speculative_tokens": 4},
    "llama-1b": {"speculative_method": "ngram", "num_speculative_tokens": 4},
    "tiny-dummy": {"speculative_method": "ngram", "num_speculative_tokens": 4},
}


def engine_kwargs(
    model: str, spec: bool, async_scheduling: bool, s: dict[str, Any], scheduler_steps: int | None = None
) -> dict[str, Any]:
    """None: the engine's default num_scheduler_steps (adaptive in the asynchronous loop on CUDA; a commit older
    than multi-step plans can only be measured so)."""
    kwargs = gss.engine_kwargs(model, "graphed", s, 0.3)  # one engine at a time, each a small pool
    kwargs["async_scheduling"] = async_scheduling
    if scheduler_steps is not None:
        kwargs["num_scheduler_steps"] = scheduler_steps
    if spec:
        kwargs.update(SPEC[model])
        kwargs["max_num_batched_tokens"] = max(kwargs["max_num_batched_tokens"], s["max_num_seqs"] * 5)
    return kwargs


def window(llm: Any, asyncspec: Any, batch: int, steps: int, clock: gss.Clock) -> dict[str, Any]:
    """A steady decode window at `batch` requests."""
    engine = llm.engine
    k = llm.config.num_speculative_tokens if llm.config.speculative_method else 0
    # the most tokens one engine step emits (getattr: A/B runs against commits older than adaptive plans)
    per_step = (k + 1) * getattr(llm.config, "max_scheduler_steps", getattr(llm.config, "num_scheduler_steps", 1))
    params = asyncspec.SamplingParams(temperature=0.0, max_tokens=2 + (steps + 8) * per_step, ignore_eos=True)
    tag = f"b{batch}-{time.monotonic_ns()}"
    reqs = [engine.make_request(p, params, f"{tag}-{i}") for i, p in enumerate(gss.load_prompts(batch))]
    for r in reqs:
        engine.add_request(r, stream_deltas=False, enforce_queue_limit=False)
    try:
        while not all(r.num_output_tokens > 0 for r in reqs):
            engine.step()
        for _ in range(3):
            engine.step()
        before_tokens = sum(r.num_output_tokens for r in reqs)
        s0 = llm.stats()
        t0 = clock()
        for _ in range(steps):
            engine.step()
        wall = clock() - t0
        s1 = llm.stats()
        tokens = sum(r.num_output_tokens for r in reqs) - before_tokens
    finally:
        engine.abort_requests([r.request_id for r in reqs if not r.is_finished])
        while engine.has_unfinished_requests():  # retire what the asynchronous loop still has in flight
            engine.step()
    idle = s1["device_idle_seconds_total"] - s0["device_idle_seconds_total"]
    timed = s1["num_timed_steps"] - s0["num_timed_steps"]
    per_seq = tokens / batch
    return {
        "batch": batch,
        "steps": steps,
        "wall_ms_per_step": wall / steps * 1e3,
        "tokens": tokens,
        "tpot_ms": wall / per_seq * 1e3 if per_seq else None,
        "tok_s": tokens / wall,
        "device_idle_ms_per_step": idle / timed * 1e3 if timed else None,
        "device_idle_fraction": idle / wall,
        "scheduling_ms_per_step": (s1["step_scheduling_seconds_total"] - s0["step_scheduling_seconds_total"])
        / timed
        * 1e3,
        "steps_per_plan_at_end": s1.get("scheduler_steps_per_plan", 1),
        "device_steps_per_plan": (
            (s1["num_device_steps"] - s0["num_device_steps"]) / n
            if "num_device_steps" in s1 and (n := s1["num_steps"] - s0["num_steps"])
            else 1.0
        ),
        "acceptance_length": (
            1 + (s1["spec_num_accepted_tokens"] - s0["spec_num_accepted_tokens"]) / d
            if (d := s1["spec_num_drafts"] - s0["spec_num_drafts"])
            else None
        ),
    }


def timeline(llm: Any, asyncspec: Any, batch: int, num_steps: int, trace_path: Path) -> dict[str, Any]:
    """A few steady steps under torch.profiler: the host's planning, launching and collecting (annotated
    ranges) and the GPU's busy intervals (kernels, copies, memsets), in ms from the first range. The
    profiler slows the host, so the picture exaggerates host time in both loops alike."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    core = llm.engine.engine_core
    runner = core.runner
    originals = {"plan": (core.scheduler, "schedule"), "launch": (runner, "launch"), "collect": (runner, "collect")}
    saved = {name: getattr(obj, attr) for name, (obj, attr) in originals.items()}

    def annotated(name: str, fn: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            with record_function(f"asyncspec.{name}"):
                return fn(*args)

        return wrapper

    engine = llm.engine
    params = asyncspec.SamplingParams(temperature=0.0, max_tokens=num_steps * 6 + 16, ignore_eos=True)
    tag = f"tl-{time.monotonic_ns()}"
    reqs = [engine.make_request(p, params, f"{tag}-{i}") for i, p in enumerate(gss.load_prompts(batch))]
    for r in reqs:
        engine.add_request(r, stream_deltas=False, enforce_queue_limit=False)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
    try:
        while not all(r.num_output_tokens > 0 for r in reqs):
            engine.step()
        for _ in range(3):
            engine.step()
        for name, (obj, attr) in originals.items():
            setattr(obj, attr, annotated(name, saved[name]))
        with profile(activities=activities) as prof:
            for _ in range(num_steps):
                engine.step()
            if runner.device.type == "cuda":
                torch.cuda.synchronize()
        prof.export_chrome_trace(str(trace_path))
    finally:
        for name, (obj, attr) in originals.items():
            setattr(obj, attr, saved[name])
        engine.abort_requests([r.request_id for r in reqs if not r.is_finished])
        while engine.has_unfinished_requests():
            engine.step()
    events = json.loads(trace_path.read_text())["traceEvents"]
    host = [e for e in events if e.get("cat") == "user_annotation" and e.get("name", "").startswith("asyncspec.")]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not host:
        return {"host": [], "gpu": []}
    origin = min(e["ts"] for e in host)
    return {
        "host": [
            {"name": e["name"].split(".", 1)[1], "start_ms": (e["ts"] - origin) / 1e3, "dur_ms": e["dur"] / 1e3}
            for e in sorted(host, key=lambda e: e["ts"])
        ],
        "gpu": _merge([((e["ts"] - origin) / 1e3, (e["ts"] + e["dur"] - origin) / 1e3) for e in gpu]),
    }


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of intervals; gaps under 2 us (kernel-to-kernel) are closed."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1] + 0.002:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def run(args: argparse.Namespace) -> dict[str, Any]:
    asyncspec = gss._import_asyncspec()
    s = gss.settings_from_args(gss_args(args))
    s["max_num_seqs"] = max(args.batches)
    clock = gss.Clock(s["device"])
    results: dict[str, Any] = {
        "card": gss.detect_card(s["device"]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": gss._git_commit(),
        "command": " ".join(sys.argv),
        "rows": [],
        "timelines": {},
    }
    configs = [(False, n) for n in args.scheduler_steps] + ([] if args.skip_spec else [(True, None)])
    for model in args.models:
        for spec, scheduler_steps in configs:
            for async_scheduling in (False, True):
                kwargs = engine_kwargs(model, spec, async_scheduling, s, scheduler_steps)
                llm, startup_s, _ = gss.construct(asyncspec, model, kwargs, clock)
                for batch in args.batches:
                    window(llm, asyncspec, batch, 4, clock)  # compiles what this batch shape needs
                    # The median window of several (a single window of a tiny model is a few
                    # hundred ms: one hiccup of the host would decide it).
                    runs = [window(llm, asyncspec, batch, args.steps, clock) for _ in range(args.repeats)]
                    row = sorted(runs, key=lambda r: r["wall_ms_per_step"])[len(runs) // 2]
                    row["wall_ms_per_step_runs"] = [r["wall_ms_per_step"] for r in runs]
                    row.update(
                        model=model,
                        spec=SPEC[model]["speculative_method"] if spec else None,
                        loop="async" if async_scheduling else "sync",
                        scheduler_steps="auto" if scheduler_steps is None else scheduler_steps,
                    )
                    results["rows"].append(row)
                    print(json.dumps(row), flush=True)
                if model == args.models[0] and not spec and scheduler_steps == args.scheduler_steps[0]:
                    key = "async" if async_scheduling else "sync"
                    trace = Path(args.output).with_suffix(f".{key}.trace.json")
                    results["timelines"][key] = timeline(llm, asyncspec, 1, args.timeline_steps, trace)
                    trace.unlink(missing_ok=True)
                del llm
                _free_device_memory()
    return results


def _free_device_memory() -> None:
    """Drops the last engine's tensors before the next one profiles free memory."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def gss_args(args: argparse.Namespace) -> argparse.Namespace:
    """The settings gpu_step_speed derives from its own flags, for this script's runs."""
    return argparse.Namespace(
        smoke=args.smoke,
        device=args.device,
        new_tokens=16,
        trials=1,
        warmup_runs=1,
        throughput_trials=1,
        concurrency="1",
        window_batches=",".join(map(str, args.batches)),
        sweep_batches="1",
        window_steps=args.steps,
        hf_batch_streams="1",
    )


def print_table(results: dict[str, Any]) -> None:
    print(f"card: {results['card']}")
    print(
        f"{'model':9} {'spec':12} {'steps':>8} {'batch':>5} {'loop':5} {'ms/step':>8} {'TPOT ms':>8} {'idle ms':>8} "
        f"{'idle %':>7}"
    )
    for r in results["rows"]:
        idle = r["device_idle_fraction"] * 100
        print(
            f"{r['model']:9} {str(r['spec']):12} {_steps_label(r):>8} {r['batch']:>5} {r['loop']:5} "
            f"{r['wall_ms_per_step']:8.3f} "
            f"{r['tpot_ms'] or 0:8.3f} {r['device_idle_ms_per_step'] or 0:8.3f} {idle:7.1f}"
        )


def _steps_label(row: dict[str, Any]) -> str:
    """The configured steps a plan; with auto, the mean the plans ran (e.g. auto:2.9)."""
    steps = row.get("scheduler_steps", 1)
    if steps == "auto":
        return f"auto:{row.get('device_steps_per_plan', 1.0):.1f}"
    return str(steps)


def plot(path: Path, out: Path) -> None:
    """The timeline picture: one panel per loop, rows for host planning, launch, collect and GPU busy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = json.loads(path.read_text())
    lanes = ["plan", "launch", "collect", "GPU"]
    colors = {"plan": "tab:blue", "launch": "tab:orange", "collect": "tab:green", "GPU": "tab:red"}
    fig, axes = plt.subplots(2, 1, figsize=(11, 4.5), sharex=True)
    for ax, key in zip(axes, ("sync", "async"), strict=True):
        tl = results["timelines"].get(key, {"host": [], "gpu": []})
        for lane_index, lane in enumerate(lanes):
            if lane == "GPU":
                spans = [(a, b - a) for a, b in tl["gpu"]]
            else:
                spans = [(h["start_ms"], h["dur_ms"]) for h in tl["host"] if h["name"] == lane]
            ax.broken_barh(spans, (lane_index - 0.4, 0.8), color=colors[lane])
        ax.set_yticks(range(len(lanes)), lanes)
        ax.set_title(f"{key} loop (bundled target, batch 1, no speculation; under torch.profiler)", fontsize=9)
    axes[-1].set_xlabel("ms")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "bubble_timeline.png", dpi=120)
    print(f"wrote {out / 'bubble_timeline.png'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=str(gss.REPO / "benchmarks" / "results" / "gpu_bubble.json"))
    parser.add_argument("--models", default="bundled,llama-1b")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--steps", type=int, default=128, help="steps timed per window")
    parser.add_argument("--repeats", type=int, default=3, help="windows per point (the median is kept)")
    parser.add_argument("--timeline-steps", type=int, default=6)
    parser.add_argument(
        "--scheduler-steps",
        default="auto",
        help="num_scheduler_steps values of the configurations without speculation (auto: the engine's default, "
        "which the speculating configurations always run)",
    )
    parser.add_argument("--skip-spec", action="store_true", help="only the configurations without speculation")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="CPU, the tiny random shape, small windows")
    parser.add_argument("--plot", metavar="RESULTS", help="draw the timeline of a results file, measure nothing")
    parser.add_argument("--out", default=str(gss.REPO / "docs" / "img"))
    args = parser.parse_args()
    if args.plot:
        plot(Path(args.plot), Path(args.out))
        return 0
    args.models = [m for m in args.models.split(",") if m]
    args.batches = [int(b) for b in args.batches.split(",")]
    args.scheduler_steps = [None if n == "auto" else int(n) for n in args.scheduler_steps.split(",")]
    if args.smoke:
        args.device, args.models, args.batches, args.steps, args.repeats = "cpu", ["tiny-dummy"], [1, 2], 4, 1
    results = run(args)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=1))
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
