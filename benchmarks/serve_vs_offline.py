"""Issue 10's GPU benchmark: `asyncspec bench` against `asyncspec serve` beside the engine's own offline
throughput, in one run on one card, at 32 and 128 concurrent streams.

For each concurrency C: `--prompts-per-stream` * C prompts (the benchmark JSONL, token ids, in file order, cycled),
128 new tokens each (ignore_eos), greedy. Offline: `LLM.generate` of all of them with max_num_seqs = C (so at most
C run at once). Served: `asyncspec serve --max-num-seqs C` in its own process (the CLI's defaults otherwise: the
bundled pair with its draft at k = 4), loaded by `asyncspec bench --concurrency C` from this process.

Both sides are loaded at once, each with `--gpu-memory-utilization` of the card, and after one warm-up each the
timed runs alternate, offline then served, `--rounds` times: the host's speed drifts within a call, and a side
measured only first or only last would carry that drift. The ratio is that of the medians.

    python3 benchmarks/serve_vs_offline.py --output $OUT/serve_vs_offline.json     # ~5 min on an H100
    python3 benchmarks/serve_vs_offline.py --device cpu --concurrency 2 --prompts-per-stream 1 --max-tokens 4 \
        --rounds 1 --output /tmp/svo.json                                          # the script only
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_step_speed as gss  # noqa: E402
from serve_helpers import cpu_seconds, running_server, spawned_children  # noqa: E402


def offline_run(llm, prompts, params) -> dict:
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    sync()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    sync()
    duration = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    return {"duration": duration, "total_output_tokens": tokens, "output_throughput": tokens / duration}


def served_run(cfg, prompts, pids: dict[str, int]) -> dict:
    from asyncspec.server import bench

    # Which process saturates: the bench client (this one), the server's, or the engine's own.
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    start = time.monotonic()
    report = asyncio.run(bench.run_bench(cfg, prompts, progress=False))
    wall = time.monotonic() - start
    report["cpu_busy_fraction"] = {name: (cpu_seconds(pid) - before[name]) / wall for name, pid in pids.items()}
    return report


def compare(asyncspec, args: argparse.Namespace, concurrency: int, flags: list[str], extra: dict) -> dict:
    """Both sides loaded, warmed up, then `rounds` alternated timed runs."""
    import torch

    from asyncspec.server import bench

    prompts = gss.load_prompts(args.prompts_per_stream * concurrency)
    params = asyncspec.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    memory = ["--gpu-memory-utilization", str(args.gpu_memory_utilization), "--device", args.device]
    with running_server(["--max-num-seqs", str(concurrency), *memory, *flags]) as server:
        llm = asyncspec.LLM(
            str(REPO / "models" / "stdlib-coder-target"),
            max_num_seqs=concurrency,
            speculative_method="draft_model",
            num_speculative_tokens=4,
            gpu_memory_utilization=args.gpu_memory_utilization,
            device=args.device,
            **extra,
        )
        cfg = bench.BenchConfig(address=server.address, max_tokens=args.max_tokens, concurrency=concurrency)
        llm.generate(prompts[:concurrency], params)  # warm-up: every shape compiled
        asyncio.run(bench.run_bench(cfg, prompts[:concurrency], progress=False))
        pids = {"client": os.getpid(), "server": server.proc.pid}
        pids |= {f"engine{i}": pid for i, pid in enumerate(spawned_children(server.proc.pid))}
        offline, served = [], []
        for _ in range(args.rounds):
            offline.append(offline_run(llm, prompts, params))
            served.append(served_run(cfg, prompts, pids))
        llm.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    median_offline = statistics.median(r["output_throughput"] for r in offline)
    median_served = statistics.median(r["output_throughput"] for r in served)
    last = served[-1]
    return {
        "concurrency": concurrency,
        "num_prompts": len(prompts),
        "offline_rounds": offline,
        "served_rounds": served,
        "offline_output_throughput": median_offline,
        "served_output_throughput": median_served,
        "served_over_offline": median_served / median_offline,
        "served_over_offline_by_round": [
            s["output_throughput"] / o["output_throughput"] for o, s in zip(offline, served, strict=True)
        ],
        "served": last,
        "server_exit_code": server.exit_code,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "gpu_serve_vs_offline.json"))
    parser.add_argument("--concurrency", default="32,128")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompts-per-stream", type=int, default=8, help="prompts = this times the concurrency")
    parser.add_argument("--rounds", type=int, default=2, help="alternated timed runs of each side")
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=0.4, help="each side's share of the card (both are loaded)"
    )
    parser.add_argument("--device", default="cuda", help="cpu: checks the script only")
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="both sides with the asynchronous loop (already the default on CUDA)",
    )
    parser.add_argument(
        "--served-worker-process",
        action="store_true",
        help="the server runs its model in a worker process of its own (--worker-process true); the offline "
        "run keeps it in-process",
    )
    parser.add_argument(
        "--served-in-process",
        action="store_true",
        help="the server runs its engine in its own process (--engine-process false) instead of the default, an "
        "engine process of its own",
    )
    args = parser.parse_args()
    asyncspec = gss._import_asyncspec()
    extra = {"async_scheduling": True} if args.async_scheduling else {}
    flags = ["--async-scheduling", "true"] if args.async_scheduling else []
    if args.served_worker_process:
        flags += ["--worker-process", "true"]
    if args.served_in_process:
        flags += ["--engine-process", "false"]
    results = {
        "card": gss.detect_card(args.device),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(sys.argv),
        "rows": [],
    }
    for c in (int(x) for x in args.concurrency.split(",")):
        row = compare(asyncspec, args, c, flags, extra)
        results["rows"].append(row)
        srv = row["served"]
        rounds = ", ".join(f"{x:.2f}" for x in row["served_over_offline_by_round"])
        print(
            f"C={c}: offline {row['offline_output_throughput']:.0f} tok/s, served {row['served_output_throughput']:.0f}"
            f" tok/s (medians of {args.rounds}: {row['served_over_offline']:.2f}x; by round {rounds}); "
            f"TTFT p50/p99 {srv['median_ttft_ms']:.1f}/{srv['p99_ttft_ms']:.1f} ms, "
            f"ITL p50/p99 {srv['median_itl_ms']:.2f}/{srv['p99_itl_ms']:.2f} ms, failed {srv['failed']}; "
            "CPU busy " + ", ".join(f"{k} {v:.2f}" for k, v in srv["cpu_busy_fraction"].items()),
            flush=True,
        )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
