"""The shipped speculation policy against one change of it (`--other`), beside the plain engine, in one process:
- `pooled`: the policy priced on the pooled history alone (`choose` without the requests' acceptance counts, as
  before 2026-12-02);
- `prior_first`: a fresh policy priced on its prior from the first plan (as before the widest-k-first rule of
  2026-12-02), where the shipped one takes the largest k until it has seen a step at a k > 0;
- `margin`: the shipped policy with another `switch_margin` (`--margin`);
- `transitions_eager`: the shipped policy on an engine that captured the draft's one-graph step only for steps
  proposing as many drafts as they verify, so a step that changes k runs the draft's step eagerly (as before
  2026-12-02's nineteenth session).

The runs are closed batches of `--streams` requests (128 new tokens each, the throughput run of
`gpu_step_speed.py`), the three engines' trials alternated, then batch-1 TPOT.

- `fresh`: every engine is reset as after its warm-up before each trial (a fresh policy: a served engine's start).
- `steady`: the policies carry over from trial to trial.
- `sustained`: as steady, but each trial sends `--sustained-factor` times as many requests as the engines'
  `max_num_seqs` (128) and only that many run at once, a new one admitted as one ends: `--streams` concurrent
  streams held full, as `vllm bench serve --max-concurrency` measures, where a closed batch also times its drain
  (only `--streams 128` applies).

    python3 benchmarks/spec_policy_ab.py --output $OUT/spec_policy_ab.json   # GPU, ~2 min with start-up
    python3 benchmarks/spec_policy_ab.py --smoke                             # CPU: the script only

On the CPU the policy has no step costs and keeps the largest k, so the smoke run shows no difference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: asyncspec without an install
sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_trace import DRAFT_SETTINGS, ENGINE_SETTINGS, TARGET, load_prompts, trace  # noqa: E402

OTHERS = ("pooled", "prior_first", "margin", "transitions_eager")
TRANSITION_GRAPHS_ENV = "ASYNCSPEC_TRANSITION_DRAFT_STEP_GRAPHS"  # read at capture (worker/model_runner.py)


def pool_only(llm: Any) -> None:
    """Makes the engine's current policy price every batch on the pooled history alone: no batch model, as
    before 2026-12-02 (so `plan_trace`'s records of its choices are priced the same way)."""
    policy = llm.engine.engine_core.scheduler.spec_policy
    policy.batch_tokens = lambda accepted, rejected: None


def prior_first(llm: Any) -> None:
    """Makes the engine's current policy price its first plans on the prior, as if it had seen a step at k > 0."""
    policy = llm.engine.engine_core.scheduler.spec_policy
    policy._has_speculated = lambda: True


def prepare(name: str, llm: Any, reset: bool, margin: float) -> None:
    if reset:
        llm.engine.engine_core.reset_after_warm_up()
    if name == "pooled":
        pool_only(llm)
    elif name == "prior_first":
        prior_first(llm)
    elif name == "margin":
        llm.engine.engine_core.scheduler.spec_policy.switch_margin = margin


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", default="prior_first", choices=OTHERS, help="the policy the shipped one is set against")
    ap.add_argument("--margin", type=float, default=0.05, help="the switch_margin of `--other margin`")
    ap.add_argument("--streams", default="128,32")
    ap.add_argument("--modes", default="fresh,steady")
    ap.add_argument("--sustained-factor", type=int, default=4, help="requests a sustained trial sends per stream")
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--tpot-trials", type=int, default=9)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny settings: checks the script")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    import asyncspec

    streams = [int(s) for s in args.streams.split(",")]
    modes = args.modes.split(",")
    if any(m not in ("fresh", "steady", "sustained") for m in modes):
        ap.error(f"--modes takes fresh, steady and/or sustained, got {args.modes}")
    if args.sustained_factor < 1:
        ap.error(f"--sustained-factor is at least 1, got {args.sustained_factor}")
    base: dict[str, Any] = dict(ENGINE_SETTINGS, gpu_memory_utilization=0.25)
    if args.smoke:
        streams, args.trials, args.tpot_trials, args.new_tokens = [4], 1, 1, 6
        base.update(device="cpu", dtype="float32", max_num_seqs=4, num_kv_blocks=256, max_model_len=512)
        base.pop("gpu_memory_utilization")
    if "sustained" in modes and base["max_num_seqs"] not in streams:
        ap.error(f"the sustained mode holds max_num_seqs = {base['max_num_seqs']} streams: add it to --streams")
    import torch

    llms: dict[str, Any] = {}
    startup: dict[str, dict[str, float]] = {}
    for name in ("plain", args.other, "shipped"):
        if name == "transitions_eager":
            os.environ[TRANSITION_GRAPHS_ENV] = "0"
        reserved = torch.cuda.memory_reserved() if torch.cuda.is_available() else 0
        llms[name] = asyncspec.LLM(str(TARGET), **base, **({} if name == "plain" else DRAFT_SETTINGS))
        os.environ.pop(TRANSITION_GRAPHS_ENV, None)
        startup[name] = llms[name].engine.engine_core.startup_timings.as_stats()
        if torch.cuda.is_available():
            startup[name]["reserved_mib"] = (torch.cuda.memory_reserved() - reserved) / 2**20
        print(f"{name}: start-up {startup[name]}", flush=True)
    results: dict[str, Any] = {"command": " ".join(sys.argv), "other": args.other, "rows": {}, "tpot_ms": {}}
    results["startup"] = startup
    full = asyncspec.SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    warm = asyncspec.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for mode in modes:
        for c in streams:
            if mode == "sustained" and c != base["max_num_seqs"]:
                continue
            prompts = load_prompts(c * (args.sustained_factor if mode == "sustained" else 1))
            for name, llm in llms.items():
                prepare(name, llm, False, args.margin)
                llm.generate(prompts, warm)
            rows: dict[str, list[dict[str, Any]]] = {n: [] for n in llms}
            for t in range(args.trials):
                for name, llm in llms.items():
                    prepare(name, llm, mode == "fresh", args.margin)
                    rows[name].append(trace(llm, prompts, full, name != "plain" and t == args.trials - 1, True))
            results["rows"][f"{mode}@{c}"] = rows
            expected = len(prompts) * args.new_tokens  # ignore_eos: every request runs to max_tokens
            for name, trials in rows.items():
                wrong = [(r["generated_tokens"], r["failed_requests"]) for r in trials]
                wrong = [w for w in wrong if w[0] != expected]
                if wrong:
                    raise RuntimeError(f"{mode}@{c}: {name}'s trials made (tokens, failures) {wrong}, not {expected}")
            med = {n: statistics.median(r["wall_ms"] for r in v) for n, v in rows.items()}
            print(
                f"{mode} @{c}: "
                + ", ".join(
                    f"{n} {[round(r['wall_ms'], 1) for r in v]} (median {med[n]:.1f} ms)" for n, v in rows.items()
                )
                + f" | on / off, median: {args.other} {med['plain'] / med[args.other]:.3f}"
                + f", shipped {med['plain'] / med['shipped']:.3f}",
                flush=True,
            )
    one = load_prompts(1)
    first = asyncspec.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for name, llm in llms.items():
        prepare(name, llm, True, args.margin)
        llm.generate(one, full)
    tpot: dict[str, list[float]] = {n: [] for n in llms}
    for _ in range(args.tpot_trials):
        for name, llm in llms.items():
            t0 = time.perf_counter()
            llm.generate(one, full)
            whole = time.perf_counter() - t0
            t0 = time.perf_counter()
            llm.generate(one, first)
            tpot[name].append((whole - (time.perf_counter() - t0)) / (args.new_tokens - 1) * 1e3)
    results["tpot_ms"] = tpot
    print(
        "batch-1 TPOT (ms): "
        + ", ".join(f"{n} {statistics.median(v):.4f} {[round(x, 3) for x in v]}" for n, v in tpot.items())
    )
    # What each engine ran: graph replays and eager forwards over the whole run; the scheduler's counts since
    # the last fresh policy (the batch-1 TPOT runs). Every timed trial's token count is checked above.
    kept = ("num_generation_tokens", "num_finished_requests")
    results["graph_stats"] = {
        name: {k: v for k, v in llm.stats().items() if k.startswith("cuda_graph") or k in kept}
        for name, llm in llms.items()
    }
    for name, counts in results["graph_stats"].items():
        print(f"{name}: {counts}")
    if args.output:
        args.output.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
