"""Prompts that share a long prefix, arriving together (a burst with one system prompt), with the waiting requests
waiting for the prefix's blocks (`prefix_sharing_wait_tokens`, 256 by default) and without (0: each computes it).

Each trial sends `--requests` prompts at once: one `--prefix-tokens` prefix (dataset prompts joined, a new one each
trial, so that no trial hits what an earlier one cached), then a tail of `--tail-tokens` of its own, and
`--new-tokens` greedy tokens each. The engines' trials alternate in one process; each reports the wall time, the
prompt tokens the engine computed, the prefix-cache hits and the waits, and the time to first token (AsyncEngine,
one stream per request).

    python3 benchmarks/prefix_sharing.py --output $OUT/prefix_sharing.json   # GPU
    python3 benchmarks/prefix_sharing.py --cpu --requests 16 --prefix-tokens 512 --new-tokens 16 --trials 3
    python3 benchmarks/prefix_sharing.py --smoke                             # CPU: the script only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: asyncspec without an install
sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_trace import ENGINE_SETTINGS, TARGET, load_prompts  # noqa: E402


def workload(dataset: list[list[int]], trial: int, args: argparse.Namespace) -> list[list[int]]:
    """The trial's prompts: one prefix (dataset prompts from an offset of the trial's own), each with its tail."""
    prefix: list[int] = []
    index = trial * 7
    while len(prefix) < args.prefix_tokens:
        prefix += dataset[index % len(dataset)]
        index += 1
    prefix = prefix[: args.prefix_tokens]
    tails = [dataset[(trial * 131 + 1000 + i) % len(dataset)][: args.tail_tokens] for i in range(args.requests)]
    return [prefix + tail for tail in tails]


async def run_trial(engine: Any, prompts: list[list[int]], new_tokens: int, trial: int, asyncspec: Any) -> dict:
    params = asyncspec.SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    before = engine.stats()
    start = time.perf_counter()

    async def one(i: int, prompt: list[int]) -> tuple[float, int]:
        first, tokens = None, 0
        async for out in engine.generate(prompt, params, request_id=f"t{trial}-{i}"):
            if first is None and out.token_ids:
                first = time.perf_counter() - start
            tokens += len(out.token_ids)
        return first or 0.0, tokens

    results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - start
    after = engine.stats()
    ttfts = sorted(r[0] for r in results)
    return {
        "wall_ms": wall * 1e3,
        "tokens": sum(r[1] for r in results),
        "ttft_ms_p50": ttfts[len(ttfts) // 2] * 1e3,
        "ttft_ms_p90": ttfts[int(len(ttfts) * 0.9)] * 1e3,
        "ttft_ms_max": ttfts[-1] * 1e3,
        "prompt_tokens_computed": after["num_prompt_tokens_computed"] - before["num_prompt_tokens_computed"],
        "prefix_cache_hits": after["prefix_cache_hits"] - before["prefix_cache_hits"],
        "sharing_waits": after["num_prefix_sharing_waits"] - before["num_prefix_sharing_waits"],
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    import asyncspec
    from asyncspec.config import make_config

    base: dict[str, Any] = dict(
        ENGINE_SETTINGS, enable_prefix_caching=True, max_num_seqs=max(args.requests, 8), gpu_memory_utilization=0.4
    )
    if args.smoke or args.cpu:
        blocks = -(-(args.prefix_tokens + args.tail_tokens + args.new_tokens) // 16) * (args.requests + 1) * 2
        base.update(device="cpu", dtype="float32", num_kv_blocks=max(blocks, 256), max_model_len=2048)
        base.pop("gpu_memory_utilization")
    engines = {
        f"wait {w}": asyncspec.AsyncEngine(make_config(str(TARGET), **base, prefix_sharing_wait_tokens=w))
        for w in (0, args.wait_tokens)
    }
    dataset = load_prompts(500)
    results: dict[str, Any] = {"command": " ".join(sys.argv), "settings": vars(args) | {"output": None}, "rows": {}}
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    try:
        for engine in engines.values():  # untimed, a prefix of its own: shapes, graphs, the policies' estimates
            await run_trial(engine, workload(dataset, args.trials, args), args.new_tokens, -1, asyncspec)
        for trial in range(args.trials):
            for name, engine in engines.items():
                prompts = workload(dataset, trial, args)
                rows[name].append(await run_trial(engine, prompts, args.new_tokens, trial, asyncspec))
    finally:
        for engine in engines.values():
            await engine.shutdown()
    results["rows"] = rows
    keys = ("wall_ms", "ttft_ms_p50", "ttft_ms_p90", "prompt_tokens_computed", "prefix_cache_hits", "sharing_waits")
    results["median"] = {n: {k: statistics.median(r[k] for r in v) for k in keys} for n, v in rows.items()}
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--tail-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--wait-tokens", type=int, default=256, help="prefix_sharing_wait_tokens of the engine that waits")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny settings: checks the script")
    ap.add_argument("--cpu", action="store_true", help="on the CPU (fp32), with the sizes given")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    if args.smoke:
        args.requests, args.prefix_tokens, args.tail_tokens, args.new_tokens, args.trials = 6, 96, 8, 4, 1
        args.wait_tokens = 32
    if args.trials * 7 >= 500:
        ap.error("at most 71 trials (each takes a prefix of its own from the dataset)")
    if min(args.requests, args.prefix_tokens, args.tail_tokens, args.new_tokens, args.trials, args.wait_tokens) < 1:
        ap.error("every count is at least 1")
    results = asyncio.run(main_async(args))
    print(f"{args.requests} requests, a {args.prefix_tokens}-token prefix, {args.tail_tokens}-token tails:")
    for name, med in results["median"].items():
        print(
            f"  {name:8s} wall {med['wall_ms']:8.1f} ms, TTFT p50 {med['ttft_ms_p50']:7.1f}"
            f" p90 {med['ttft_ms_p90']:7.1f} ms, prompt tokens computed {med['prompt_tokens_computed']:7.0f},"
            f" hits {med['prefix_cache_hits']:7.0f}, waits {med['sharing_waits']:4.0f}"
        )
    if args.output:
        args.output.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
