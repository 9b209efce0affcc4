"""Admission waves (`admission_delay_runs`) on and off, for the plain engine and the speculating one, in one
process: `--streams` concurrent streams held full (`max_num_seqs`), each trial sending `--factor` times as many
requests, so that a new request is admitted as one ends (what `vllm bench serve --max-concurrency` measures).

- `fixed`: every request 128 new tokens (`--new-tokens`, ignore_eos): the plain engine's requests end together
  and admit in waves anyway; the speculating engine's ends spread.
- `varied`: new tokens drawn from a seeded uniform range around the same mean (a quarter to seven quarters of
  it): every engine's ends spread, as a server's do.

The engines' trials alternate; each trial reports the wall time, the output tokens per second, and the requests'
queue times (arrival to first scheduling, `RequestOutput.queued_seconds`).

    python3 benchmarks/admission_waves_ab.py --output $OUT/admission_waves_ab.json   # GPU, ~3 min with start-up
    python3 benchmarks/admission_waves_ab.py --smoke                                 # CPU: the script only
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: asyncspec without an install
sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_trace import DRAFT_SETTINGS, ENGINE_SETTINGS, TARGET, load_prompts  # noqa: E402

WORKLOADS = ("fixed", "varied")


def new_tokens(workload: str, n: int, mean: int, seed: int) -> list[int]:
    if workload == "fixed":
        return [mean] * n
    rng = random.Random(seed)
    return [rng.randint(max(1, mean // 4), mean * 7 // 4) for _ in range(n)]


def run_trial(llm: Any, prompts: list[list[int]], lengths: list[int], asyncspec: Any) -> dict[str, Any]:
    params = [asyncspec.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outputs)
    queued = sorted(o.queued_seconds or 0.0 for o in outputs)
    return {
        "wall_ms": wall * 1e3,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "queued_ms_p50": queued[len(queued) // 2] * 1e3,
        "queued_ms_p90": queued[int(len(queued) * 0.9)] * 1e3,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=128)
    ap.add_argument("--factor", type=int, default=4, help="requests a trial sends per stream")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--delay", type=int, default=2, help="admission_delay_runs of the engines with waves")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument(
        "--keep-drafts-too",
        action="store_true",
        help="also a speculating engine with waves whose admitting plans keep the drafts they hold",
    )
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny settings: checks the script")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    import asyncspec

    workloads = args.workloads.split(",")
    if any(w not in WORKLOADS for w in workloads):
        ap.error(f"--workloads takes {', '.join(WORKLOADS)}, got {args.workloads}")
    if args.factor < 1 or args.delay < 1:
        ap.error("--factor and --delay are at least 1")
    base: dict[str, Any] = dict(ENGINE_SETTINGS, max_num_seqs=args.streams, gpu_memory_utilization=0.18)
    if args.smoke:
        args.streams, args.factor, args.trials, args.new_tokens = 8, 2, 1, 8
        base.update(
            device="cpu",
            dtype="float32",
            max_num_seqs=8,
            num_kv_blocks=512,
            max_model_len=512,
            num_scheduler_steps=4,
        )
        base.pop("gpu_memory_utilization")
    engines = {
        "plain, no waves": {"admission_delay_runs": 0},
        "plain, waves": {"admission_delay_runs": args.delay},
        "draft, no waves": {"admission_delay_runs": 0, **DRAFT_SETTINGS},
        "draft, waves": {"admission_delay_runs": args.delay, **DRAFT_SETTINGS},
    }
    if args.keep_drafts_too:
        engines["draft, waves, drafts kept"] = engines["draft, waves"]
        if "gpu_memory_utilization" in base:
            base["gpu_memory_utilization"] = 0.15
    llms = {name: asyncspec.LLM(str(TARGET), **base, **extra) for name, extra in engines.items()}
    if args.keep_drafts_too:
        llms["draft, waves, drafts kept"].engine.engine_core.scheduler._admits_wave = lambda defers: False
    prompts = load_prompts(args.streams * args.factor)
    if args.smoke:
        prompts = [p[:24] for p in prompts]
    results: dict[str, Any] = {"command": " ".join(sys.argv), "streams": args.streams, "workloads": {}}
    for workload in workloads:
        lengths = new_tokens(workload, len(prompts), args.new_tokens, seed=0)
        for llm in llms.values():  # untimed: this workload's shapes, the policies' first estimates
            run_trial(llm, prompts[: args.streams], lengths[: args.streams], asyncspec)
        rows: dict[str, list[dict[str, Any]]] = {name: [] for name in llms}
        for _ in range(args.trials):
            for name, llm in llms.items():
                rows[name].append(run_trial(llm, prompts, lengths, asyncspec))
        med = {n: statistics.median(r["tokens_per_s"] for r in v) for n, v in rows.items()}
        results["workloads"][workload] = {"rows": rows, "median_tokens_per_s": med}
        print(f"{workload} @{args.streams} streams, {len(prompts)} requests:", flush=True)
        for name, v in rows.items():
            print(
                f"  {name:25s} {med[name]:9.0f} tok/s {[round(r['wall_ms'], 1) for r in v]} ms,"
                f" queued p50 {statistics.median(r['queued_ms_p50'] for r in v):.1f} ms"
                f" p90 {statistics.median(r['queued_ms_p90'] for r in v):.1f} ms"
            )
        print(
            f"  draft / plain: no waves {med['draft, no waves'] / med['plain, no waves']:.3f},"
            f" waves {med['draft, waves'] / med['plain, waves']:.3f};"
            f" waves / none: plain {med['plain, waves'] / med['plain, no waves']:.3f},"
            f" draft {med['draft, waves'] / med['draft, no waves']:.3f}"
        )
    if args.output:
        args.output.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
