"""CPU cost of the scheduler's two calls per plan with speculation: schedule() and update_from_output().

No model: a scripted device accepts a random number of each decode's k drafts (uniform in 0..k) and returns
what the worker would (the sampled runs; with several steps a plan, each step's run). The batch is N running
decodes with prompts of 128 tokens, no prefix caching, the policy adapting k over measured (fixed) step costs,
its choice forced to k so that every plan verifies k drafts a decode. Only full-batch plans at k are timed.

    python benchmarks/scheduler_spec_overhead.py [--num-requests 128] [--plans 300] [--output PATH]
    python benchmarks/scheduler_spec_overhead.py --smoke      # a few plans: checks the script only
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: asyncspec without an install
from asyncspec.core.kv_cache import KVCacheManager  # noqa: E402
from asyncspec.core.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from asyncspec.request import Request  # noqa: E402
from asyncspec.sampling_params import SamplingParams  # noqa: E402
from tests.core.scheduler_fakes import RunDevice  # noqa: E402  (the scheduler tests' scripted device)


def build(num_requests: int, k: int, steps_per_plan: int, seed: int) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs=num_requests,
        max_num_batched_tokens=8192,
        max_model_len=4096,
        num_scheduler_steps=steps_per_plan,
        num_speculative_tokens=k,
        num_lookahead_tokens=k,
        multi_step_speculation=True,
        enable_prefix_caching=False,
    )
    sched = Scheduler(cfg, KVCacheManager(num_requests * 4096 // 16 + 16, 16, False))
    sched.spec_policy.step_cost = lambda num_decodes, k: 1e-3  # measured costs: the policy prices every plan
    choose = sched.spec_policy.choose
    sched.spec_policy.choose = lambda num_decodes, *counts: (choose(num_decodes, *counts), k)[1]
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True)
    for i in range(num_requests):
        sched.add_request(Request(f"req-{i}", [rng.randrange(8000) for _ in range(128)], params))
    return sched


def run_case(num_requests: int, k: int, steps_per_plan: int, plans: int, seed: int) -> dict:
    sched = build(num_requests, k, steps_per_plan, seed)
    rng = random.Random(seed)
    device = RunDevice(lambda rid, drafts: rng.randint(0, drafts))  # each decode accepts 0..k, every step
    clock = time.perf_counter
    schedule_us: list[float] = []
    update_us: list[float] = []
    for _ in range(plans):
        t0 = clock()
        so = sched.schedule()
        t1 = clock()
        out = device.execute(so)  # the "GPU": not timed
        t2 = clock()
        sched.update_from_output(so, out)
        t3 = clock()
        if (
            so.num_speculative_tokens == k
            and len(so.num_scheduled_tokens) == num_requests
            and not so.scheduled_new_reqs
        ):
            schedule_us.append((t1 - t0) * 1e6)
            update_us.append((t3 - t2) * 1e6)
    if not schedule_us:
        raise RuntimeError("no full-batch plan at k was timed: raise --plans")
    return {
        "num_requests": num_requests,
        "k": k,
        "steps_per_plan": steps_per_plan,
        "timed_plans": len(schedule_us),
        "schedule_p50_us": round(statistics.median(schedule_us), 1),
        "update_from_output_p50_us": round(statistics.median(update_us), 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--steps-per-plan", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--plans", type=int, default=300, help="plans per case (the prompt plans are not timed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args(argv)
    if args.smoke:
        args.num_requests, args.plans = 8, 12
    cases = [run_case(args.num_requests, args.k, n, args.plans, args.seed) for n in args.steps_per_plan]
    result = {
        "benchmark": "scheduler_spec_overhead",
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cases": cases,
    }
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"scheduler per full-batch plan, {args.num_requests} decodes at k = {args.k} (median µs)")
    for c in cases:
        print(
            f"  {c['steps_per_plan']} step(s) a plan: schedule {c['schedule_p50_us']:.0f}, "
            f"update_from_output {c['update_from_output_p50_us']:.0f} ({c['timed_plans']} plans)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
