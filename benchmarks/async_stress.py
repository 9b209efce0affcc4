"""Randomized AsyncEngine stress, long setting (CI runs a short one: tests/engine/test_async_stress.py).

Concurrent streams with random arrivals, aborts, task cancels, early breaks, id reuse and seeded
sampling against the bundled target model on the CPU (fp32, one thread), on a KV pool small enough
to force preemption. Checks every stream ended exactly once, greedy / seeded outputs equal their
alone runs, and the pool is whole afterwards (see tests/engine/stress_helpers.py). Prints a summary,
writes JSON, and exits 1 if any check failed.

    python benchmarks/async_stress.py [--streams 500] [--seed 1] [--repeat 1] [--output PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).absolute().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from tests.engine.stress_helpers import ENGINE_CONFIG, References, ScenarioConfig, new_engine, run_scenario  # noqa: E402

DEFAULT_OUTPUT = REPO / "benchmarks" / "results" / "async_stress.json"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=500, help="streams per scenario")
    ap.add_argument("--seed", type=int, default=1, help="seed of the first scenario")
    ap.add_argument("--repeat", type=int, default=1, help="scenarios to run (seeds seed, seed+1, ...)")
    ap.add_argument(
        "--mean-arrival-gap",
        type=float,
        default=ScenarioConfig.mean_arrival_gap,
        help="mean seconds between arrivals (exponential)",
    )
    ap.add_argument(
        "--reuse-fraction",
        type=float,
        default=ScenarioConfig.reuse_fraction,
        help="fraction of streams that reuse an earlier stream's id",
    )
    ap.add_argument("--num-kv-blocks", type=int, default=ENGINE_CONFIG["num_kv_blocks"])
    ap.add_argument("--max-num-seqs", type=int, default=ENGINE_CONFIG["max_num_seqs"])
    ap.add_argument("--timeout", type=float, default=None, help="whole-run timeout per scenario (default: scaled)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    overrides = dict(num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs)
    t0 = time.monotonic()
    engine = new_engine(**overrides)
    refs = References(**overrides)
    load_s = time.monotonic() - t0
    timeout = args.timeout if args.timeout is not None else max(60.0, 0.5 * args.streams)

    reports = []
    for i in range(args.repeat):
        cfg = ScenarioConfig(
            seed=args.seed + i,
            num_streams=args.streams,
            mean_arrival_gap=args.mean_arrival_gap,
            reuse_fraction=args.reuse_fraction,
            timeout=timeout,
        )
        report = run_scenario(engine, refs, cfg)
        reports.append(report)
        s = report.summary
        status = "ok" if not report.failures else f"{len(report.failures)} FAILURE(S)"
        print(
            f"seed {cfg.seed}: {s['num_streams']} streams in {s['wall_s']:.2f}s (+{s['reference_s']:.2f}s "
            f"references): {status}"
        )
        print(
            f"  outcomes {s['outcomes']}  id reuses {s['num_id_reuses']}  compared full/prefix "
            f"{s['num_compared_full']}/{s['num_compared_prefix']}"
        )
        print(
            f"  preemptions {s['num_preemptions']}  steps {s['num_steps']}  prefix-cache hits "
            f"{s['prefix_cache_hits']}/{s['prefix_cache_queries']}  tokens {s['num_streamed_tokens']} "
            f"({s['streamed_tokens_per_s']}/s)  TTFT p50/p95 {s['ttft_p50_s']}/{s['ttft_p95_s']}s  "
            f"e2e p50/p95 {s['e2e_p50_s']}/{s['e2e_p95_s']}s"
        )
        if report.failures:
            print("  " + report.failure_text(limit=20).replace("\n", "\n  "))
    asyncio.run(engine.shutdown())

    failures = sum(len(r.failures) for r in reports)
    result = dict(
        benchmark="async_stress",
        argv=sys.argv[1:] if argv is None else list(argv),
        platform=dict(
            python=platform.python_version(), torch=torch.__version__, machine=platform.machine(), threads=args.threads
        ),
        engine_config={**ENGINE_CONFIG, **overrides},
        load_s=round(load_s, 3),
        passed=failures == 0,
        num_failures=failures,
        scenarios=[dict(config=asdict(r.config), summary=r.summary, failures=r.failures[:100]) for r in reports],
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'PASSED' if failures == 0 else f'FAILED ({failures} failures)'}; wrote {args.output}")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
