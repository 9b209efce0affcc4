"""Host CPU time per generated token of the server's process and of the engine's, with the engine in the server's
process or in its own (`serve --engine-process true`), under a bench load at a fixed concurrency.

python3 benchmarks/serve_cpu_cost.py --output $OUT/serve_cpu_cost.json [--device cpu] [--concurrency 128]

Each mode starts `asyncspec serve` (the bundled pair with its draft, the serve defaults), runs one warm-up and
one timed bench (asyncspec's load generator, in this process), and reads the server's and the engine's user +
system CPU time from /proc around the timed run. The served rate is capped by the slower process once the
engine has its own: the server process's CPU per token says how many tokens per second one gRPC process can
carry. Linux only (reads /proc).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from serve_helpers import cpu_seconds, running_server, spawned_children  # noqa: E402

DATASET = REPO / "benchmarks" / "data" / "prompts-code.jsonl"


def timed_bench(address: str, prompts: list[list[int]], args: argparse.Namespace, pids: list[int]) -> tuple:
    """One warm-up and one timed bench (in this process, so its CPU is neither process's); the timed run's
    report, wall seconds and the CPU seconds each of `pids` spent in it."""
    from asyncspec.server import bench

    cfg = bench.BenchConfig(address=address, max_tokens=args.max_tokens, concurrency=args.concurrency)
    asyncio.run(bench.run_bench(cfg, prompts, progress=False))
    before = [cpu_seconds(pid) for pid in pids]
    start = time.monotonic()
    report = asyncio.run(bench.run_bench(cfg, prompts, progress=False))
    wall = time.monotonic() - start
    return report, wall, [cpu_seconds(pid) - b for pid, b in zip(pids, before, strict=True)]


def run_mode(engine_process: bool, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    flags = ["--device", args.device, "--max-model-len", "1024"]
    flags += ["--engine-process", "true" if engine_process else "false"]
    if args.device == "cpu":
        flags += ["--dtype", "float32"]
    with running_server(flags) as server:
        pids = [server.proc.pid, *spawned_children(server.proc.pid)]
        report, wall, spent = timed_bench(server.address, prompts, args, pids)
    tokens = report["total_output_tokens"]
    return {
        "engine_process": engine_process,
        "wall_s": wall,
        "output_tokens": tokens,
        "output_throughput": report["output_throughput"],
        "server_cpu_s": spent[0],
        "server_cpu_us_per_token": 1e6 * spent[0] / tokens,
        "engine_cpu_s": spent[1] if engine_process else None,
        "engine_cpu_us_per_token": 1e6 * spent[1] / tokens if engine_process else None,
        "spec_decode_acceptance_length": report.get("spec_decode_acceptance_length"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    from asyncspec.server import bench

    prompts = bench.load_dataset(str(DATASET), args.num_prompts, seed=0)
    rows = [run_mode(engine_process, args, prompts) for engine_process in (False, True)]
    result = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "nproc": os.cpu_count(),
        "settings": vars(args) | {"output": str(args.output)},
        "rows": rows,
    }
    args.output.write_text(json.dumps(result, indent=1))
    print(f"{'engine':<16}{'tok/s':>9}{'server µs/tok':>15}{'engine µs/tok':>15}")
    for row in rows:
        engine = f"{row['engine_cpu_us_per_token']:.0f}" if row["engine_process"] else "-"
        where = "own process" if row["engine_process"] else "in the server"
        print(f"{where:<16}{row['output_throughput']:>9.0f}{row['server_cpu_us_per_token']:>15.0f}{engine:>15}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
