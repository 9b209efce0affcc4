"""Soak: 2,000 short requests from 64 concurrent clients with random cancels and deadlines against one
server. Afterwards the KV pool is full again, every request that was not cancelled got its final
response (or DEADLINE_EXCEEDED when its deadline hit first), and the server's resident memory grew by
less than 100 MB."""

from __future__ import annotations

import asyncio
import random
import resource

import grpc
import pytest

from asyncspec.v1 import asyncspec_pb2 as pb
from asyncspec.v1 import asyncspec_pb2_grpc as pb_grpc
from tests.conftest import load_prompts
from tests.server.server_helpers import ServerThread
from tests.server.test_server import _wait_kv_free


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def _client(address: str, jobs: asyncio.Queue, outcomes: dict, rng: random.Random, prompts) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        while True:
            try:
                n = jobs.get_nowait()
            except asyncio.QueueEmpty:
                return
            kind = rng.choices(["full", "cancel", "deadline"], weights=[0.8, 0.1, 0.1])[0]
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompts[n % len(prompts)][: rng.randint(4, 24)]),
                sampling=pb.SamplingOptions(temperature=0.0),
                stopping=pb.StoppingOptions(max_tokens=rng.randint(1, 6), ignore_eos=True),
            )
            timeout = rng.uniform(0.001, 0.05) if kind == "deadline" else 120.0
            call = stub.Generate(request, timeout=timeout)
            try:
                finished = False
                async for response in call:
                    if kind == "cancel":
                        call.cancel()
                        break
                    finished = response.finished
                outcomes[n] = (kind, "finished" if finished else "cancelled")
            except grpc.aio.AioRpcError as e:
                outcomes[n] = (kind, e.code().name)


@pytest.mark.timeout(600)
def test_soak_2000_requests_64_clients():
    server = ServerThread({"max_num_seqs": 64, "num_kv_blocks": 128, "max_num_batched_tokens": 512})
    try:
        prompts = load_prompts(32)
        rng = random.Random(7)
        rss_before = _rss_mb()

        async def main():
            jobs: asyncio.Queue = asyncio.Queue()
            for n in range(2000):
                jobs.put_nowait(n)
            outcomes: dict = {}
            await asyncio.gather(*(_client(server.address, jobs, outcomes, rng, prompts) for _ in range(64)))
            return outcomes

        outcomes = asyncio.run(main())
        assert len(outcomes) == 2000
        for kind, result in outcomes.values():
            if kind == "full":
                assert result == "finished", result
            elif kind == "deadline":
                assert result in ("finished", "DEADLINE_EXCEEDED"), result
            else:
                assert result in ("finished", "cancelled", "CANCELLED"), result
        assert sum(1 for k, r in outcomes.values() if k == "deadline" and r == "DEADLINE_EXCEEDED") > 0
        _wait_kv_free(server, timeout=60)
        assert _rss_mb() - rss_before < 100
    finally:
        server.stop()
