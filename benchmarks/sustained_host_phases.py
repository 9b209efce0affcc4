"""Where the host's time goes under a sustained load, per kind of plan: 512 requests (128 new tokens each) through
engines of 128 streams, the plain engine and the draft engine in one process, their trials alternated.

Every method `host_phases.py` times (and the runner's speculation, admission and sampling parts) is wrapped with a
perf_counter timer, and each call is charged to the kind of the plan launched last ("prompt k0->4 new9": a plan
with prompt chunks verifying 0 drafts a request and proposing 4, admitting 9 or more; "decode k4->4 x4": a 4-step
decode plan at k = 4). In the asynchronous loop the retirement of a plan (collect, update_from_output) runs after
the next plan's launch, so it is charged to that next plan's kind. Then one trial per engine under cProfile.

    python3 benchmarks/sustained_host_phases.py --output $OUT/sustained_host_phases.json   # GPU, ~1 min
    python3 benchmarks/sustained_host_phases.py --streams 32 --factor 1                    # a closed batch of 32
    python3 benchmarks/sustained_host_phases.py --smoke                                    # CPU: the script only
    python3 benchmarks/sustained_host_phases.py --with-prompts --no-cprofile --trials 2    # + speculate_with_prompts

`--with-prompts` adds a third engine whose plans with prompt chunks verify drafts (`speculate_with_prompts`): on an
H100 its prompt plans under this load took 7.1 ms against the default's 4.6 (2026-12-07, plan_trace.py), and the
phases say where the difference goes.

`--streams 32 --factor 1` submits `plan_trace.py --streams 32`'s closed batch (32 requests on the same engines of
128 slots): the unprofiled host time of its prompt plans, where the draft engine loses to the plain one (cProfile,
`plan_trace.py --host-profile`, runs Python about twice as slow and was enabled mid-stack, which left cumulative
times that did not add up: 2026-12-07, the draft's pass over the target's inputs at 2.4 ms a prompt plan with no
callee to hold it).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import host_phases  # noqa: E402
from plan_trace import DRAFT_SETTINGS, ENGINE_SETTINGS, TARGET, load_prompts  # noqa: E402

EXTRA = [
    "_propose_without_drafts",
    "_draft_on_target_inputs",
    "_defer_draft",
    "_catch_up_draft",
    "_catch_up_lag",
    "_forward",
    "_launch_speculative_steps",
    "_launch_decode_steps",
    "_restore_after_recompute",
    "_launch_step",
    "_draft_computed",
    "_fall_behind",
    "_new_draft_step",
]


def kind_of(so: Any) -> str:
    """A plan's kind: prompt (chunks or admissions) or decode, drafts verified and proposed, admissions or steps."""
    k, p = so.num_speculative_tokens, so.num_proposals
    n = so.num_scheduled_tokens
    if so.scheduled_new_reqs or any(v > k + 1 for v in n.values()):
        return f"prompt k{k}->{p} new{min(len(so.scheduled_new_reqs), 9)}"
    return f"decode k{k}->{p} x{so.num_steps}"


class Timers(host_phases._Timers):
    """`host_phases._Timers` keyed by (label, kind of the plan launched last); counts the plans of each kind."""

    def __init__(self) -> None:
        super().__init__()
        self.kind = "?"
        self.plans: dict[str, int] = defaultdict(int)

    def key(self, label: str) -> Any:
        return (label, self.kind)

    def entered(self, label: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if label == "runner.launch":
            self.kind = kind_of(args[-1] if args else kwargs["so"])
            self.plans[self.kind] += 1


def install(llm: Any, timers: Timers) -> list[tuple[Any, str, Any]]:
    """Wraps host_phases' targets, the runner's parts in EXTRA, and the admission, sampling and scheduler parts."""
    runner = llm.engine.engine_core.runner
    import torch

    from asyncspec.worker.cuda_graphs import CudaGraphForward

    targets = host_phases._targets(llm) + [(f"  runner.{m}", runner, m) for m in EXTRA if hasattr(runner, m)]
    ib = runner.input_batch
    sch = llm.engine.engine_core.scheduler
    targets += [
        ("  sampler.forward", runner.sampler, "forward"),
        ("  model.compute_logits", runner.model, "compute_logits"),
        ("  ib.add_request", ib, "add_request"),
        ("  ib.write_admitted", ib, "write_admitted"),
        ("  ib.write_sampled_tokens", ib, "write_sampled_tokens"),
        ("  ib.remove_request", ib, "remove_request"),
        ("  graphs.replay_mixed", CudaGraphForward, "replay_mixed"),
        ("  graphs.select_mixed", CudaGraphForward, "select_mixed"),
        ("  Event.synchronize", torch.cuda.Event, "synchronize"),
        ("  inputs.fill", type(runner._inputs), "fill"),
        ("  sch._multi_step_count", sch, "_multi_step_count"),
        ("  kv.allocate_slots", sch.kv_cache_manager, "allocate_slots"),
        ("  sch._plan_next_k", sch, "_plan_next_k"),
        ("  engine.make_request", llm.engine, "make_request"),
        ("  engine.add_request", llm.engine, "add_request"),
    ]
    if runner.spec is not None:
        targets.append(("  spec.reset_rows", runner.spec, "reset_rows"))
        targets.append(("  spec.clear_drafts", runner.spec, "clear_drafts"))
    return host_phases.install_timers(timers, targets)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--streams", type=int, default=128, help="requests per unit of --factor (the engines hold 128)")
    ap.add_argument("--factor", type=int, default=4, help="requests: --factor times --streams, submitted at once")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument(
        "--with-prompts",
        action="store_true",
        help="also a draft engine whose plans with prompt chunks verify drafts (speculate_with_prompts)",
    )
    ap.add_argument("--no-cprofile", action="store_true", help="skip the closing cProfile trials")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    import asyncspec

    base = dict(ENGINE_SETTINGS, gpu_memory_utilization=0.25)
    streams = args.streams
    if args.smoke:
        base.update(device="cpu", dtype="float32", max_num_seqs=4, num_kv_blocks=256, max_model_len=512)
        base.pop("gpu_memory_utilization")
        streams = 4
        args.trials, args.factor = 1, 2
    llms = {"plain": asyncspec.LLM(str(TARGET), **base), "draft": asyncspec.LLM(str(TARGET), **base, **DRAFT_SETTINGS)}
    if args.with_prompts:
        llms["draft_with_prompts"] = asyncspec.LLM(str(TARGET), **base, **DRAFT_SETTINGS, speculate_with_prompts=True)
    prompts = load_prompts(streams * args.factor)
    if args.smoke:
        prompts = [p[:32] for p in prompts]  # short prompts: the same plans, a fraction of the CPU's prefill time
    full = asyncspec.SamplingParams(temperature=0.0, max_tokens=8 if args.smoke else 128, ignore_eos=True)
    for llm in llms.values():
        llm.generate(prompts, full)
    timers = {n: Timers() for n in llms}
    walls = {n: [] for n in llms}
    idle = {n: [] for n in llms}
    saved = {n: install(llm, timers[n]) for n, llm in llms.items()}
    for _ in range(args.trials):
        for n, llm in llms.items():
            s0 = llm.stats()
            timers[n].active = True
            t0 = time.perf_counter()
            llm.generate(prompts, full)
            walls[n].append((time.perf_counter() - t0) * 1e3)
            timers[n].active = False
            idle[n].append((llm.stats()["device_idle_seconds_total"] - s0["device_idle_seconds_total"]) * 1e3)
    for n in llms:
        host_phases.restore_timers(saved[n])
    out: dict[str, Any] = {"walls_ms": walls, "idle_ms": idle, "engines": {}}
    for n, tm in timers.items():
        per_kind = defaultdict(dict)
        for (label, kind), s in tm.seconds.items():
            per_kind[kind][label.strip()] = [round(s / args.trials * 1e3, 2), tm.calls[(label, kind)] / args.trials]
        out["engines"][n] = {"plans": {k: v / args.trials for k, v in tm.plans.items()}, "ms_per_trial": per_kind}
    print(
        "walls",
        {n: [round(w, 1) for w in v] for n, v in walls.items()},
        "idle",
        {n: [round(w, 1) for w in v] for n, v in idle.items()},
    )
    for n, e in out["engines"].items():
        print(f"== {n}")
        for kind in sorted(e["plans"]):
            labels = e["ms_per_trial"][kind]
            top = sorted(labels.items(), key=lambda kv: -kv[1][0])[:14]
            parts = "; ".join(f"{label} {v[0]}ms/{v[1]:.0f}" for label, v in top)
            print(f"  {kind}: plans {e['plans'][kind]:.1f}; {parts}")
        tot = defaultdict(float)
        for labels in e["ms_per_trial"].values():
            for label, v in labels.items():
                tot[label] += v[0]
        ranked = sorted(tot.items(), key=lambda kv: -kv[1])[:16]
        print("  totals: " + "; ".join(f"{label} {v:.1f}" for label, v in ranked))
    # one cProfile trial each
    out["cprofile"] = {}
    for n, llm in () if args.no_cprofile else llms.items():
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        llm.generate(prompts, full)
        prof.disable()
        wall = time.perf_counter() - t0
        st = pstats.Stats(prof)
        rows = sorted(
            ((tt, nc, ct, f"{Path(k[0]).name}:{k[1]}({k[2]})") for k, (cc, nc, tt, ct, _) in st.stats.items()),
            reverse=True,
        )[:45]
        out["cprofile"][n] = {
            "wall_ms": wall * 1e3,
            "rows": [[round(tt * 1e3, 2), nc, round(ct * 1e3, 2), name] for tt, nc, ct, name in rows],
        }
        print(f"== cprofile {n}: wall {wall * 1e3:.0f} ms")
        for tt, nc, ct, name in rows[:32]:
            print(f"  {tt * 1e3:8.2f} {nc:8d} {ct * 1e3:9.2f} {name}")
    if args.output:
        args.output.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
