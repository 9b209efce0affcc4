"""Issue 10's GPU benchmark: `asyncspec bench` against `asyncspec serve` beside the engine's own offline
throughput, in one run on one card, at 32 and 128 concurrent streams.

For each concurrency C: 4*C prompts (the benchmark JSONL, token ids), 128 new tokens each (ignore_eos),
greedy. Offline: `LLM.generate` of all of them with max_num_seqs = C (so at most C run at once).
Served: `asyncspec serve --max-num-seqs C` in its own process (the CLI's defaults otherwise: the bundled
pair with its draft at k = 4), loaded by `asyncspec bench --concurrency C`. Both after a warm-up run.

    python3 benchmarks/serve_vs_offline.py --output $OUT/serve_vs_offline.json     # ~4 min on an H100
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_step_speed as gss  # noqa: E402
from serve_helpers import cpu_seconds, running_server, spawned_children  # noqa: E402


def offline(asyncspec, prompts, concurrency: int, max_tokens: int, extra: dict) -> dict:
    import torch

    llm = asyncspec.LLM(
        str(REPO / "models" / "stdlib-coder-target"),
        max_num_seqs=concurrency,
        speculative_method="draft_model",
        num_speculative_tokens=4,
        **extra,
    )
    params = asyncspec.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:concurrency], params)  # warm-up: every shape compiled
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    duration = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    del llm, outputs
    gc.collect()
    torch.cuda.empty_cache()
    return {"duration": duration, "total_output_tokens": tokens, "output_throughput": tokens / duration}


def served(prompts, concurrency: int, max_tokens: int, extra_flags: list[str]) -> dict:
    from asyncspec.server import bench

    with running_server(["--max-num-seqs", str(concurrency), *extra_flags]) as server:
        cfg = bench.BenchConfig(address=server.address, max_tokens=max_tokens, concurrency=concurrency)
        asyncio.run(bench.run_bench(cfg, prompts[:concurrency], progress=False))  # warm-up
        # Which process saturates: the bench client (this one), the server's, or the engine's own.
        pids = {"client": os.getpid(), "server": server.proc.pid}
        pids |= {f"engine{i}": pid for i, pid in enumerate(spawned_children(server.proc.pid))}
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        start = time.monotonic()
        report = asyncio.run(bench.run_bench(cfg, prompts, progress=False))
        wall = time.monotonic() - start
        report["cpu_busy_fraction"] = {name: (cpu_seconds(pid) - before[name]) / wall for name, pid in pids.items()}
    report["server_exit_code"] = server.exit_code
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "gpu_serve_vs_offline.json"))
    parser.add_argument("--concurrency", default="32,128")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--async-scheduling", action="store_true", help="both sides with the asynchronous loop")
    parser.add_argument(
        "--served-worker-process",
        action="store_true",
        help="the server runs its model in a worker process of its own (--worker-process true); the offline "
        "run keeps it in-process",
    )
    parser.add_argument(
        "--served-engine-process",
        action="store_true",
        help="the server runs its engine (scheduling, output processing, model) in a process of its own "
        "(--engine-process true) and keeps only the gRPC work",
    )
    args = parser.parse_args()
    asyncspec = gss._import_asyncspec()
    extra = {"async_scheduling": True} if args.async_scheduling else {}
    flags = ["--async-scheduling", "true"] if args.async_scheduling else []
    if args.served_worker_process:
        flags += ["--worker-process", "true"]
    if args.served_engine_process:
        flags += ["--engine-process", "true"]
    results = {
        "card": gss.detect_card("cuda"),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(sys.argv),
        "rows": [],
    }
    for c in (int(x) for x in args.concurrency.split(",")):
        prompts = gss.load_prompts(4 * c)
        off = offline(asyncspec, prompts, c, args.max_tokens, extra)
        srv = served(prompts, c, args.max_tokens, flags)
        row = {
            "concurrency": c,
            "num_prompts": len(prompts),
            "offline": off,
            "served": srv,
            "served_over_offline": srv["output_throughput"] / off["output_throughput"],
        }
        results["rows"].append(row)
        print(
            f"C={c}: offline {off['output_throughput']:.0f} tok/s, served {srv['output_throughput']:.0f} tok/s "
            f"({row['served_over_offline']:.2f}x); "
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
