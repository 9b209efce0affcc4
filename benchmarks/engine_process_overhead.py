"""Where a served engine's throughput goes: the same load offline (`LLM.generate`), through the engine process's
client without gRPC (`EngineProcessClient`), and served over gRPC with the engine in its own process, each with
the host CPU its engine spent and the engine steps it took. `--spy-dir` samples the engine's process with py-spy
(raw collapsed stacks, one file per mode) during the timed run.

    python3 benchmarks/engine_process_overhead.py --modes offline,engine_process,served --output $OUT/epo.json
    python3 benchmarks/engine_process_overhead.py --device cpu --num-prompts 8 --max-tokens 8   # the script only

The bundled pair with its draft (k = 4) and the asynchronous loop; prompts from the benchmark JSONL (shuffled and
cycled, so later cycles hit the prefix cache); one warm-up of `concurrency` prompts before each timed run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from serve_helpers import cpu_seconds, running_server, spawned_children  # noqa: E402

DATASET = REPO / "benchmarks" / "data" / "prompts-code.jsonl"
MODEL = REPO / "models" / "stdlib-coder-target"
METRICS_PORT = 9411
_COUNTERS = {"num_steps": "num_steps_total", "spec_num_accepted_tokens": "spec_decode_num_accepted_tokens_total"}


def spy(pid: int, spy_dir: str | None, name: str, seconds: float) -> subprocess.Popen | None:
    if not spy_dir:
        return None
    command = ["py-spy", "record", "--pid", str(pid), "--format", "raw", "--rate", "500", "--nonblocking"]
    command += ["-o", f"{spy_dir}/{name}.txt", "--duration", str(max(1, int(seconds)))]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = dict(max_num_seqs=args.concurrency, async_scheduling=True, device=args.device)
    kwargs |= dict(speculative_method="draft_model", num_speculative_tokens=4)
    return kwargs | ({"dtype": "float32", "max_model_len": 1024} if args.device == "cpu" else {})


def row(mode: str, tokens: int, wall: float, cpu: float, before: dict, after: dict) -> dict:
    return {
        "mode": mode,
        "output_tokens": tokens,
        "output_throughput": tokens / wall,
        "engine_cpu_busy": cpu / wall,
        "engine_cpu_us_per_token": 1e6 * cpu / tokens,
        **{key: after[key] - before[key] for key in _COUNTERS},
    }


def offline(args: argparse.Namespace, prompts: list[list[int]], params) -> dict:
    import torch

    import asyncspec

    llm = asyncspec.LLM(str(MODEL), **engine_kwargs(args))
    llm.generate(prompts[: args.concurrency], params)
    before = llm.stats()
    sampler = spy(os.getpid(), args.spy_dir, "offline", args.spy_seconds)
    cpu, start = time.process_time(), time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    result = row("offline", sum(len(o.token_ids) for o in outputs), wall, cpu, before, llm.stats())
    if sampler:
        sampler.wait()
    llm.shutdown()
    del llm, outputs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


async def _engine_process(args: argparse.Namespace, prompts: list[list[int]], params) -> dict:
    from asyncspec.config import make_config
    from asyncspec.engine.engine_process import EngineProcessClient

    client = await EngineProcessClient.launch(make_config(str(MODEL), **engine_kwargs(args)))
    limit = asyncio.Semaphore(args.concurrency)

    async def one(request_id: str, prompt: list[int]) -> int:
        async with limit:
            return sum([len(d.token_ids) async for d in client.generate(prompt, params, request_id, coalesce=True)])

    await asyncio.gather(*(one(f"warm-{i}", p) for i, p in enumerate(prompts[: args.concurrency])))
    pid = client.pid
    assert pid is not None
    before, cpu = client.stats(), cpu_seconds(pid)
    sampler = spy(pid, args.spy_dir, "engine_process", args.spy_seconds)
    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(f"timed-{i}", p) for i, p in enumerate(prompts))))
    wall, cpu = time.perf_counter() - start, cpu_seconds(pid) - cpu
    result = row("engine_process", tokens, wall, cpu, before, client.stats())
    if sampler:
        sampler.wait()
    await client.shutdown()
    return result


def _scrape() -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics").read().decode()
    return {key: float(re.search(rf"^asyncspec:{name} (\S+)$", text, re.M).group(1)) for key, name in _COUNTERS.items()}


def served(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    from asyncspec.server import bench

    flags = ["--max-num-seqs", str(args.concurrency), "--async-scheduling", "true", "--engine-process", "true"]
    flags += ["--device", args.device, "--metrics-port", str(METRICS_PORT)]
    if args.device == "cpu":
        flags += ["--dtype", "float32", "--max-model-len", "1024"]
    with running_server(flags) as server:
        cfg = bench.BenchConfig(address=server.address, max_tokens=args.max_tokens, concurrency=args.concurrency)
        asyncio.run(bench.run_bench(cfg, prompts[: args.concurrency], progress=False))
        pid = spawned_children(server.proc.pid)[0]
        before, cpu = _scrape(), cpu_seconds(pid)
        sampler = spy(pid, args.spy_dir, "served", args.spy_seconds)
        start = time.perf_counter()
        report = asyncio.run(bench.run_bench(cfg, prompts, progress=False))
        wall, cpu = time.perf_counter() - start, cpu_seconds(pid) - cpu
        result = row("served", report["total_output_tokens"], wall, cpu, before, _scrape())
        if sampler:
            sampler.wait()
    result["failed"] = report["failed"]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--modes", default="offline,engine_process,served", help="in this order, repeats allowed")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--spy-dir", default=None, help="sample each mode's engine with py-spy, files here")
    parser.add_argument("--spy-seconds", type=float, default=3.0)
    args = parser.parse_args()
    import asyncspec
    from asyncspec.server import bench

    prompts = bench.load_dataset(str(DATASET), args.num_prompts, seed=0)
    params = asyncspec.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    runs = {
        "offline": lambda: offline(args, prompts, params),
        "engine_process": lambda: asyncio.run(_engine_process(args, prompts, params)),
        "served": lambda: served(args, prompts),
    }
    rows = []
    for mode in args.modes.split(","):
        rows.append(runs[mode]())
        r = rows[-1]
        print(
            f"{mode:<15}{r['output_throughput']:>9.0f} tok/s  engine CPU {r['engine_cpu_us_per_token']:5.1f} us/token "
            f"(busy {r['engine_cpu_busy']:.2f})  {r['num_steps']:.0f} steps",
            flush=True,
        )
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        result = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        args.output.write_text(
            json.dumps(result | {"settings": vars(args) | {"output": str(args.output)}, "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
