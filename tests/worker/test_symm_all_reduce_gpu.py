"""The push all-reduce (the default on CUDA) across two GPUs, and four where the host has them: the worker
sets the path up (its self-check against NCCL passes), and every sum, eager or replayed from a CUDA graph
with new inputs, equals the rank-order fp32 sum of all ranks' parts rounded to bf16, with the same bits on
every rank; NCCL's large messages in between do not disturb it. End to end (tokens against NCCL's):
tests/worker/test_tensor_parallel_gpu.py."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

HIDDEN = 4096


def _expected(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's part gathered, summed in rank order in fp32, rounded once."""
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for p in parts:
        acc += p.float()
    return acc.to(x.dtype)


def _same_on_every_rank(y: torch.Tensor, group: Any) -> bool:
    import torch.distributed as dist

    bits = y.contiguous().view(torch.int16).to(torch.int32)
    low, high = bits.clone(), bits.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    return bool(torch.equal(low, high))


def _rank(rank: int, world: int, init: str, queue: Any) -> None:
    try:
        import torch.distributed as dist

        from asyncspec.worker.symm_all_reduce import make_small_all_reduce

        os.environ["ASYNCSPEC_TP_ALL_REDUCE"] = "push"
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
        group = dist.group.WORLD
        reduce = make_small_all_reduce(group, torch.device("cuda", rank), torch.bfloat16)
        failures: list[str] = []
        if reduce is None:
            failures.append("the push path was not set up")
            queue.put((rank, failures, 0))
            return
        gen = torch.Generator(device="cuda").manual_seed(100 + rank)
        checked = 0

        def check(name: str, x: torch.Tensor, y: torch.Tensor | None) -> None:
            nonlocal checked
            checked += 1
            if y is None:
                failures.append(f"{name}: not taken")
            elif not torch.equal(y, _expected(x, group)):
                failures.append(f"{name}: differs from the rank-order sum")
            elif not _same_on_every_rank(y, group):
                failures.append(f"{name}: ranks disagree")

        # Eager, every decode-sized shape, with a large NCCL all-reduce in between.
        for rows in (1, 2, 3, 8, 32, 64):
            x = torch.randn(rows, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
            x[0, :5] = -0.0
            check(f"eager rows={rows}", x, reduce(x))
            big = torch.ones(1024, HIDDEN, device="cuda")
            dist.all_reduce(big, group=group)
        # A graph of three chained sums (as in a decode step's layers), replayed with new inputs.
        static_x = torch.zeros(4, HIDDEN, dtype=torch.bfloat16, device="cuda")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            reduce(static_x)  # warm: compiled before the capture
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            a = reduce(static_x)
            b = reduce(a * 0.5) if a is not None else None
            c = reduce(b[:1] + 1.0) if b is not None else None
        for replay in range(40):
            static_x.copy_(torch.randn(4, HIDDEN, generator=gen, device="cuda"))
            graph.replay()
            if a is None or b is None or c is None:
                failures.append("a captured sum was not taken")
                break
            ea = _expected(static_x, group)
            eb = _expected(ea * 0.5, group)
            ec = _expected(eb[:1] + 1.0, group)
            if not (torch.equal(a, ea) and torch.equal(b, eb) and torch.equal(c, ec)):
                failures.append(f"graph replay {replay}: differs from the rank-order sums")
            checked += 1
        torch.cuda.synchronize()
        queue.put((rank, failures, checked))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # reported, not hung on
        queue.put((rank, [f"{type(e).__name__}: {e}"], 0))


@pytest.mark.parametrize("world", [2, 4])
def test_push_all_reduce_sums_exactly_and_alike_on_every_rank(world: int) -> None:
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = f"file://{tempfile.mkdtemp(prefix='push-ar-')}/store"
    procs = [ctx.Process(target=_rank, args=(r, world, init, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = sorted(queue.get(timeout=240) for _ in range(world))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for rank, failures, checked in results:
        assert not failures, f"rank {rank}: {failures}"
        assert checked == 6 + 40, f"rank {rank} checked {checked} sums"
