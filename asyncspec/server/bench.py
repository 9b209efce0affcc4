"""`asyncspec bench`: a load generator against a running server (like `vllm bench serve`).

Fixed concurrency (`--concurrency`) or a Poisson arrival rate (`--request-rate`), prompts (token ids)
from a JSONL file, a progress line on stderr, and a report of request and token throughput and the
TTFT, TPOT, ITL and E2EL mean / median / std / p99 (ms), plus the speculative acceptance, printed as a
table and written as JSON with vLLM's field names.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from asyncspec.errors import ConfigError
from asyncspec.server.client_channel import ChannelSecurity
from asyncspec.v1 import asyncspec_pb2 as pb
from asyncspec.v1 import asyncspec_pb2_grpc as pb_grpc


@dataclass
class BenchConfig:
    address: str = "127.0.0.1:50051"
    dataset: str = ""
    num_prompts: int = 100
    max_tokens: int = 128
    concurrency: int | None = 32
    request_rate: float | None = None
    seed: int = 0
    token: str | None = None
    timeout_s: float = 600.0
    security: ChannelSecurity = field(default_factory=ChannelSecurity)
    """Plaintext, or TLS as the server serves it."""


@dataclass
class RequestResult:
    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itls: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    drafts: int = 0
    error: str = ""


def load_dataset(path: str, n: int, seed: int) -> list[list[int]]:
    """n prompts (token ids) from a JSONL file of {"prompt_token_ids": [...]}, cycled when shorter."""
    prompts = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ids = json.loads(line)["prompt_token_ids"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConfigError(
                    f'{path}:{number}: not a JSON object with "prompt_token_ids" ({type(e).__name__}: {e})'
                ) from None
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
                raise ConfigError(f"{path}:{number}: prompt_token_ids must be a non-empty list of ints")
            prompts.append(ids)
    if not prompts:
        raise ConfigError(f"{path} holds no prompts")
    random.Random(seed).shuffle(prompts)
    return [prompts[i % len(prompts)] for i in range(n)]


async def _one(stub: pb_grpc.GenerationStub, prompt: list[int], cfg: BenchConfig, metadata) -> RequestResult:
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingOptions(temperature=0.0),
        stopping=pb.StoppingOptions(max_tokens=cfg.max_tokens, ignore_eos=True),
    )
    result = RequestResult(prompt_tokens=len(prompt))
    start = last = time.perf_counter()
    try:
        async for response in stub.Generate(request, timeout=cfg.timeout_s, metadata=metadata):
            now = time.perf_counter()
            n = len(response.token_ids)
            if n:
                if result.output_tokens == 0:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
                result.output_tokens += n
            if response.finished:
                result.drafted = response.usage.drafted_tokens
                result.accepted = response.usage.accepted_tokens
                result.drafts = response.usage.num_drafts
                result.ok = response.finish_reason != pb.FINISH_REASON_ERROR
                result.error = response.error
        result.e2el = time.perf_counter() - start
    except grpc.aio.AioRpcError as e:
        result.error = f"{e.code().name}: {e.details()}"
    return result


async def run_bench(cfg: BenchConfig, prompts: list[list[int]], progress: bool = True) -> dict[str, Any]:
    metadata = [("authorization", f"Bearer {cfg.token}")] if cfg.token else None
    results: list[RequestResult] = []
    async with cfg.security.aio_channel(cfg.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        limit = asyncio.Semaphore(cfg.concurrency or len(prompts) or 1)
        rng = random.Random(cfg.seed)

        async def task(prompt: list[int]) -> None:
            async with limit:
                results.append(await _one(stub, prompt, cfg, metadata))
            if progress:
                sys.stderr.write(f"\rbench: {len(results)}/{len(prompts)} requests")
                sys.stderr.flush()

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(task(prompt)))
            if cfg.request_rate:
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    if progress:
        sys.stderr.write("\n")
    return report(results, duration, cfg)


def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    ms = [v * 1e3 for v in values_s] or [0.0]
    ordered = sorted(ms)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {
        f"mean_{name}_ms": statistics.fmean(ms),
        f"median_{name}_ms": statistics.median(ms),
        f"std_{name}_ms": statistics.pstdev(ms),
        f"p99_{name}_ms": p99,
    }


def report(results: list[RequestResult], duration: float, cfg: BenchConfig) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens for r in done)
    drafted = sum(r.drafted for r in done)
    accepted = sum(r.accepted for r in done)
    drafts = sum(r.drafts for r in done)
    tpots = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
        "max_concurrency": cfg.concurrency,
        "request_rate": cfg.request_rate if cfg.request_rate else "inf",
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_throughput": output / duration if duration else 0.0,
        "total_token_throughput": (prompt + output) / duration if duration else 0.0,
        **_stats("ttft", [r.ttft for r in done]),
        **_stats("tpot", tpots),
        **_stats("itl", [x for r in done for x in r.itls]),
        **_stats("e2el", [r.e2el for r in done]),
        "spec_decode_acceptance_rate": accepted / drafted if drafted else None,
        "spec_decode_acceptance_length": 1.0 + accepted / drafts if drafts else None,
        "spec_decode_num_drafts": drafts,
        "spec_decode_num_draft_tokens": drafted,
        "spec_decode_num_accepted_tokens": accepted,
    }
    return out


def print_report(out: dict[str, Any]) -> None:
    rows = [
        ("Successful requests", out["completed"]),
        ("Failed requests", out["failed"]),
        ("Benchmark duration (s)", f"{out['duration']:.2f}"),
        ("Request throughput (req/s)", f"{out['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{out['output_throughput']:.1f}"),
        ("Total token throughput (tok/s)", f"{out['total_token_throughput']:.1f}"),
    ]
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {name.upper()} (ms)", f"{out[f'{stat}_{name}_ms']:.2f}"))
    if out["spec_decode_acceptance_rate"] is not None:
        rows.append(("Draft acceptance rate", f"{out['spec_decode_acceptance_rate']:.3f}"))
        rows.append(("Mean acceptance length", f"{out['spec_decode_acceptance_length']:.2f}"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    for error in out["errors"]:
        print(f"error: {error}")


def main(cfg: BenchConfig, output: str | None) -> int:
    prompts = load_dataset(cfg.dataset, cfg.num_prompts, cfg.seed)
    out = asyncio.run(run_bench(cfg, prompts))
    print_report(out)
    if output:
        Path(output).write_text(json.dumps(out, indent=1))
    return 0 if out["failed"] == 0 else 1
