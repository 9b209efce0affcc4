"""Where the host's time goes in a steady decode window, without a profiler: the engine's phases and the
runner's parts timed with perf_counter wrappers (about a microsecond each), per step and per call.

A window is as `bubble.window` (prefilled, 3 warm-up steps, `--steps` engine steps timed) with these methods
wrapped: the scheduler's `schedule` and `update_from_output`; the runner's `launch`, `collect` and, inside
them, `_update_states`, `_prepare_inputs`, `_copy_to_host`; the graph replays (`CudaGraphForward.replay`,
`replay_head`, `replay_tail`, and torch's `CUDAGraph.replay` under them); with speculation, the runner's
verification and proposal (`_verify_and_propose` and the calls under it); the wait for a step's results
(`StepHandle.wait`); the output processor. The loop's own time is the window's wall time minus the phases.

    python3 benchmarks/host_phases.py --output $OUT/host_phases.json      # bundled target, batch 64, both loops
    python3 benchmarks/host_phases.py --smoke                             # CPU: checks the script only
    python3 benchmarks/host_phases.py --spec --cprofile                   # the window under cProfile instead
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bubble  # noqa: E402  (its settings for a decode window)
import gpu_step_speed as gss  # noqa: E402


def _targets(llm: Any) -> list[tuple[str, Any, str]]:
    """(label, object, attribute) of every method timed; objects are instances or classes."""
    import torch

    from asyncspec.engine.output_processor import OutputProcessor
    from asyncspec.spec.draft_model_proposer import DraftModelProposer
    from asyncspec.spec.spec_decoder import SpeculativeDecoder
    from asyncspec.worker.cuda_graphs import CapturedGraph, CudaGraphForward
    from asyncspec.worker.model_runner import StepHandle

    core = llm.engine.engine_core
    runner = core.runner
    return [
        ("schedule", core.scheduler, "schedule"),
        ("update_from_output", core.scheduler, "update_from_output"),
        ("runner.launch", runner, "launch"),
        ("runner.collect", runner, "collect"),
        ("  launch: _update_states", runner, "_update_states"),
        ("  launch: _prepare_inputs", runner, "_prepare_inputs"),
        ("  launch: _copy_to_host", runner, "_copy_to_host"),
        ("  launch: graph replay (forward)", CudaGraphForward, "replay"),
        ("  launch: graph replay (inputs head)", CudaGraphForward, "replay_head"),
        ("  launch: graph replay (sampling tail)", CudaGraphForward, "replay_tail"),
        ("    torch CUDAGraph.replay", torch.cuda.CUDAGraph, "replay"),
        ("  launch: _verify_and_propose (speculation)", runner, "_verify_and_propose"),
        ("    _verify_greedily", runner, "_verify_greedily"),
        ("    _verify (sampler)", runner, "_verify"),
        ("    _sampling_metadata", runner, "_sampling_metadata"),
        ("    _replay_greedy_draft_step", runner, "_replay_greedy_draft_step"),
        ("      captured function replay", CapturedGraph, "replay"),
        ("    _draft_step (its inputs)", runner, "_draft_step"),
        ("    SpeculativeDecoder.propose", SpeculativeDecoder, "propose"),
        ("      DraftModelProposer.propose", DraftModelProposer, "propose"),
        ("  collect: wait for results", StepHandle, "wait"),
        ("process_outputs", OutputProcessor, "process_outputs"),
    ]


class _Timers:
    """Seconds and calls per key (the label, unless a subclass's `key` says otherwise), counted only while
    `active`; `entered` runs before each counted call."""

    def __init__(self) -> None:
        self.active = False
        self.seconds: dict[Any, float] = defaultdict(float)
        self.calls: dict[Any, int] = defaultdict(int)

    def key(self, label: str) -> Any:
        return label

    def entered(self, label: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A counted call of `label` is about to run (nothing here)."""

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.perf_counter

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return fn(*args, **kwargs)
            self.entered(label, args, kwargs)
            key = self.key(label)
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key] += clock() - t0
                self.calls[key] += 1

        return wrapper


def install_timers(timers: _Timers, targets: list[tuple[str, Any, str]]) -> list[tuple[Any, str, Any]]:
    """Wraps every (label, object, attribute) of `targets` with `timers`; returns what `restore_timers` needs."""
    saved = []
    for label, obj, attr in targets:
        # A class keeps its function in __dict__ (restored as it was); an instance gets a shadowing attribute.
        saved.append((obj, attr, obj.__dict__[attr] if isinstance(obj, type) else None))
        setattr(obj, attr, timers.wrap(label, getattr(obj, attr)))
    return saved


def restore_timers(saved: list[tuple[Any, str, Any]]) -> None:
    for obj, attr, class_value in reversed(saved):
        if isinstance(obj, type):
            setattr(obj, attr, class_value)
        else:
            delattr(obj, attr)


def measure(
    llm: Any, asyncspec: Any, batch: int, steps: int, clock: Any, profiler: cProfile.Profile | None = None
) -> dict[str, Any]:
    """A steady decode window (as bubble.window: prefilled, 3 warm-up steps, `steps` timed) with every target
    wrapped; microseconds per step and per call of each, and the loop's own rest. With `profiler`, the
    window also runs under it (the caller reads it)."""
    timers = _Timers()
    targets = _targets(llm) if profiler is None else []
    saved = install_timers(timers, targets)
    engine = llm.engine
    k = llm.config.num_speculative_tokens if llm.config.speculative_method else 0
    per_step = (k + 1) * llm.config.max_scheduler_steps  # the most tokens one engine step emits
    params = asyncspec.SamplingParams(temperature=0.0, max_tokens=2 + (steps + 8) * per_step, ignore_eos=True)
    tag = f"phases-{time.monotonic_ns()}"
    reqs = [engine.make_request(p, params, f"{tag}-{i}") for i, p in enumerate(gss.load_prompts(batch))]
    try:
        for r in reqs:
            engine.add_request(r, stream_deltas=False, enforce_queue_limit=False)
        while not all(r.num_output_tokens > 0 for r in reqs):
            engine.step()
        for _ in range(3):
            engine.step()
        s0, tokens0 = llm.stats(), sum(r.num_output_tokens for r in reqs)
        t0 = clock()
        timers.active = True
        if profiler is not None:
            profiler.enable()
        for _ in range(steps):
            engine.step()
        if profiler is not None:
            profiler.disable()
        timers.active = False
        wall = clock() - t0
        s1, tokens = llm.stats(), sum(r.num_output_tokens for r in reqs) - tokens0
    finally:
        timers.active = False
        restore_timers(saved)
        engine.abort_requests([r.request_id for r in reqs if not r.is_finished])
        while engine.has_unfinished_requests():
            engine.step()
    idle = s1["device_idle_seconds_total"] - s0["device_idle_seconds_total"]
    per_step = {label: timers.seconds[label] / steps * 1e6 for label, _, _ in targets}
    per_call = {
        label: (timers.seconds[label] / n * 1e6 if (n := timers.calls[label]) else None) for label, _, _ in targets
    }
    phases = ("schedule", "update_from_output", "runner.launch", "runner.collect", "process_outputs")
    per_step["rest of the loop"] = wall / steps * 1e6 - sum(per_step.get(p, 0.0) for p in phases)
    per_call["rest of the loop"] = None
    return {
        "wall_ms_per_step": wall / steps * 1e3,
        "tokens_per_step": tokens / steps,
        "device_idle_fraction": idle / wall,
        "us_per_step": per_step,
        "us_per_call": per_call,
    }


def _profile_rows(profiler: cProfile.Profile, steps: int) -> list[dict[str, Any]]:
    """Functions by own time per step, with their callers' names (where a blocking C call is made from)."""
    stats = pstats.Stats(profiler)

    def name(key: tuple[str, int, str]) -> str:
        return f"{Path(key[0]).name}:{key[1]}({key[2]})"

    rows = [
        {
            "function": name(key),
            "calls": nc / steps,
            "own_us": tt / steps * 1e6,
            "cumulative_us": ct / steps * 1e6,
            "callers": ", ".join(name(c) for c in sorted(callers, key=lambda c: -callers[c][2])[:3]),
        }
        for key, (_cc, nc, tt, ct, callers) in stats.stats.items()  # type: ignore[attr-defined]
    ]
    return sorted(rows, key=lambda r: -r["own_us"])[:80]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bundled")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--loops", default="async,sync")
    parser.add_argument("--spec", action="store_true", help="with the model's speculation (bubble.SPEC)")
    parser.add_argument(
        "--scheduler-steps",
        type=lambda v: None if v == "auto" else int(v),
        default=None,
        help="num_scheduler_steps (without --spec); default auto, the engine's default",
    )
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument(
        "--cprofile",
        action="store_true",
        help="profile the window with cProfile instead (function level, C calls included; slows the host)",
    )
    parser.add_argument("--output")
    args = parser.parse_args()
    model = "tiny-dummy" if args.smoke else args.model
    steps = 6 if args.smoke else args.steps
    s = gss.settings_from_args(
        bubble.gss_args(
            argparse.Namespace(
                smoke=args.smoke, device="cpu" if args.smoke else "cuda", batches=[args.batch], steps=steps
            )
        )
    )
    s["max_num_seqs"] = args.batch
    asyncspec = gss._import_asyncspec()
    results = []
    for loop in args.loops.split(","):
        kwargs = bubble.engine_kwargs(model, args.spec, loop == "async", s, args.scheduler_steps)
        llm, _, _ = gss.construct(asyncspec, model, kwargs, gss.Clock(s["device"]))
        profiler = cProfile.Profile() if args.cprofile else None
        row = measure(llm, asyncspec, args.batch, steps, gss.Clock(s["device"]), profiler)
        llm.shutdown()
        if profiler is not None:
            row["cprofile"] = _profile_rows(profiler, steps)
        row.update(model=model, loop=loop, batch=args.batch, spec=args.spec, scheduler_steps=args.scheduler_steps)
        results.append(row)
        w = row
        print(
            f"\n== {model} batch {args.batch} {loop}{' spec' if args.spec else ''}: "
            f"{w['wall_ms_per_step']:.3f} ms a step, device idle {100 * w['device_idle_fraction']:.1f} %"
        )
        for r in row.get("cprofile", [])[:40]:
            own, cum = r["own_us"], r["cumulative_us"]
            print(f"  {own:8.1f} own {cum:8.1f} cum us/step {r['calls']:7.2f} calls  {r['function']}")
            print(f"           called from: {r['callers']}")
        for label, us in row["us_per_step"].items():
            call = row["us_per_call"][label]
            print(f"  {label:40} {us:8.1f} us/step  {'' if call is None else f'{call:8.1f} us/call'}")
    if args.output:
        Path(args.output).write_text(
            json.dumps({"benchmark": "host_phases", "command": " ".join(sys.argv), "rows": results}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
