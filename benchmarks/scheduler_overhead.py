"""CPU cost of one scheduling step: schedule() and schedule() + update_from_output().

No model: a fake ModelRunnerOutput samples one token per decode. The batch is N running
decode requests (prompts of ~128 tokens, block_size 16, a pool large enough that nothing
is preempted, prefix caching on), measured with and without lookahead KV slots, in
the synchronous order and pipelined as the asynchronous loop runs (each step planned while the one
before it is in flight, so every planned request carries a placeholder).

    python benchmarks/scheduler_overhead.py [--num-requests 256] [--steps 2000] [--output PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from asyncspec.core.kv_cache import KVCacheManager
from asyncspec.core.scheduler import Scheduler, SchedulerConfig
from asyncspec.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from asyncspec.request import Request
from asyncspec.sampling_params import SamplingParams

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "scheduler_overhead.json"


def build(num_requests: int, prompt_len: int, block_size: int, lookahead: int, total_steps: int, seed: int):
    rng = random.Random(seed)
    max_len = prompt_len + 16 + total_steps + lookahead + 1
    blocks_per_req = -(-max_len // block_size)
    kv = KVCacheManager(num_requests * blocks_per_req + 16, block_size, enable_prefix_caching=True)
    cfg = SchedulerConfig(
        max_num_seqs=num_requests,
        max_num_batched_tokens=8192,
        max_model_len=max_len,
        num_lookahead_tokens=lookahead,
    )
    sched = Scheduler(cfg, kv)
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    for i in range(num_requests):
        n = prompt_len + rng.randint(-8, 8)
        prompt = [rng.randrange(8192) for _ in range(n)]
        sched.add_request(Request(f"req-{i}", prompt, params, frozenset({2})))
    return sched


def fake_output(so: SchedulerOutput, scheduler: Scheduler, token: int) -> ModelRunnerOutput:
    """One sampled token per request whose scheduled tokens reach its last known token."""
    req_ids = list(so.num_scheduled_tokens)
    reqs = scheduler.requests
    # num_computed_tokens was advanced at schedule time: == num_tokens means "samples now".
    sampled = [[token] if reqs[r].num_computed_tokens >= reqs[r].num_tokens else [] for r in req_ids]
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def percentile(sorted_values: list[float], q: float) -> float:
    k = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


def summarise(ns: list[int]) -> dict:
    us = sorted(v / 1000 for v in ns)
    return {
        "mean_us": round(statistics.fmean(us), 2),
        "p50_us": round(percentile(us, 50), 2),
        "p99_us": round(percentile(us, 99), 2),
        "max_us": round(us[-1], 2),
    }


def run_case(num_requests: int, lookahead: int, steps: int, warmup: int, seed: int, pipelined: bool = False) -> dict:
    sched = build(num_requests, 128, 16, lookahead, warmup + steps, seed)
    # Prefill everything, then warm up on pure decode steps.
    while len(sched.running) < num_requests or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        so = sched.schedule()
        sched.update_from_output(so, fake_output(so, sched, 7))
    for i in range(warmup):
        so = sched.schedule()
        sched.update_from_output(so, fake_output(so, sched, 100 + i % 4000))
    clock = time.perf_counter_ns
    sched_ns: list[int] = []
    step_ns: list[int] = []
    gc.collect()
    # Pipelined (the asynchronous loop): each step is planned while the one before is still in flight, so
    # every request carries a placeholder when it is planned, and a step is reconciled after the next is planned.
    inflight = None
    if pipelined:
        so = sched.schedule()
        inflight = (so, fake_output(so, sched, 99))
    for i in range(steps):
        t0 = clock()
        so = sched.schedule()
        t1 = clock()
        out = fake_output(so, sched, 100 + i % 4000)  # the "GPU": not timed
        t2 = clock()
        if inflight is not None:
            sched.update_from_output(*inflight)
            inflight = (so, out)
        else:
            sched.update_from_output(so, out)
        t3 = clock()
        assert len(so.num_scheduled_tokens) == num_requests and not so.preempted_req_ids
        sched_ns.append(t1 - t0)
        step_ns.append((t1 - t0) + (t3 - t2))
    assert sched.stats.num_preemptions == 0
    return {
        "num_requests": num_requests,
        "num_lookahead_tokens": lookahead,
        "pipelined": pipelined,
        "steps": steps,
        "schedule": summarise(sched_ns),
        "schedule_plus_update": summarise(step_ns),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2000, help="timed decode steps per case")
    ap.add_argument("--warmup", type=int, default=100, help="untimed decode steps per case")
    ap.add_argument("--lookahead", type=int, nargs="+", default=[0, 4], help="num_lookahead_tokens cases")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = ap.parse_args(argv)

    cases = [
        run_case(args.num_requests, k, args.steps, args.warmup, args.seed, pipelined)
        for pipelined in (False, True)
        for k in args.lookahead
    ]
    result = {
        "benchmark": "scheduler_overhead",
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "processor": platform.processor(),
        "block_size": 16,
        "prompt_len": "128 +- 8",
        "prefix_caching": True,
        "cases": cases,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")

    print(f"scheduler step, {args.num_requests} running decodes, {args.steps} timed steps (µs)")
    stats = f"{'p50':>8} {'p99':>8}"
    print(f"{'loop':>9} {'lookahead':>9} | {'schedule mean':>13} {stats} | {'sched+update mean':>17} {stats}")
    for c in cases:
        s, u = c["schedule"], c["schedule_plus_update"]
        loop = "pipelined" if c["pipelined"] else "sync"
        print(
            f"{loop:>9} {c['num_lookahead_tokens']:>9} | "
            f"{s['mean_us']:>13.1f} {s['p50_us']:>8.1f} {s['p99_us']:>8.1f} | "
            f"{u['mean_us']:>17.1f} {u['p50_us']:>8.1f} {u['p99_us']:>8.1f}"
        )
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
