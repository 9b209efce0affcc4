"""The push all-reduce kernel (kernels/push_all_reduce_triton.py) under TRITON_INTERPRET=1, with every rank
simulated in one process: the ranks run one after another, and a rank that has not run yet has its part
placed in the receive buffers as its push would (a rank that has run pushed for real). Outputs are compared
with the rank-order fp32 sum rounded to the dtype, bit for bit and across ranks; the receive buffers must
hold nothing but the last call's parts afterwards (each slot is set back to the sentinel in time).

The same kernel across two GPUs: tests/worker/test_symm_all_reduce_gpu.py.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1" and isinstance(triton.language.zeros, InterpretedFunction)
MIN_INTERPRETED_TESTS = 5


@pytest.mark.skipif(INTERPRETING, reason="TestInterpreted runs in this process")
def test_interpreter_suite(interpreted_suites) -> None:
    interpreted_suites.check(__file__, MIN_INTERPRETED_TESTS)


class Ranks:
    """World-size ranks' receive buffers, call counts and buffer-pointer tables, as the worker sets them up."""

    def __init__(self, world: int, max_numel: int) -> None:
        from asyncspec.kernels import push_all_reduce_triton as k

        self.k, self.world, self.max_numel = k, world, max_numel
        self.buffers = [
            torch.full((k.receive_buffer_numel(max_numel, world),), k.SENTINEL, dtype=torch.int16) for _ in range(world)
        ]
        self.counts = [torch.zeros(k.num_programs(max_numel), dtype=torch.int32) for _ in range(world)]
        self.ptrs = torch.tensor([b.data_ptr() for b in self.buffers], dtype=torch.int64)
        self.last_numel = [0] * k.num_programs(max_numel)

    def slots(self, rank: int) -> torch.Tensor:
        return self.buffers[rank].view(3, self.world, self.max_numel)

    def all_reduce(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """One call on every rank, rank 0 first."""
        k, block = self.k, self.k.BLOCK
        n = parts[0].numel()
        programs = triton.cdiv(n, block)
        outs = []
        for rank in range(self.world):
            slot = self.counts[rank][:programs] % 3
            for later in range(rank + 1, self.world):  # their pushes, already landed
                sent = torch.where(parts[later] == 0, torch.zeros_like(parts[later]), parts[later]).reshape(-1)
                for b in range(programs):
                    lo, hi = b * block, min(n, (b + 1) * block)
                    self.slots(rank)[int(slot[b]), later, lo:hi] = sent[lo:hi].view(torch.int16)
            outs.append(k.push_all_reduce(parts[rank], self.ptrs, self.counts[rank], self.max_numel, rank, self.world))
        for b in range(programs):
            self.last_numel[b] = min(n, (b + 1) * block) - b * block
        return outs

    def stale_entries(self, rank: int) -> int:
        """Non-sentinel entries beyond the last call's parts: what a missed reset would leave behind."""
        live = int((self.buffers[rank] != self.k.SENTINEL).sum())
        return live - (self.world - 1) * sum(self.last_numel)


def reference(parts: list[torch.Tensor]) -> torch.Tensor:
    acc = torch.zeros(parts[0].shape, dtype=torch.float32)
    for p in parts:
        acc = acc + p.float()
    return acc.to(parts[0].dtype)


class TestInterpreted:
    # Collected only where triton interprets; elsewhere test_interpreter_suite runs it in a child process.
    __test__ = INTERPRETING

    @pytest.mark.parametrize("world", [2, 3, 4])
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_sum_over_calls_of_changing_sizes(self, world: int, dtype: torch.dtype) -> None:
        from asyncspec.kernels import push_all_reduce_triton

        assert isinstance(push_all_reduce_triton._push_all_reduce_kernel, InterpretedFunction)
        ranks = Ranks(world, max_numel=3 * 1024)
        gen = torch.Generator().manual_seed(world)
        # Partial, whole and growing blocks: each program's slots turn over at its own pace.
        for call, shape in enumerate([(1, 1000), (2, 1024), (3, 7), (1, 3072), (3, 1000), (1, 64), (2, 1500), (1, 5)]):
            parts = [(torch.randn(shape, generator=gen) * 4).to(dtype) for _ in range(world)]
            parts[call % world].view(-1)[:3] = -0.0  # the sentinel's value, sent as +0.0
            outs = ranks.all_reduce(parts)
            expected = reference(parts)
            for rank, out in enumerate(outs):
                assert out.shape == shape and out.dtype == dtype
                assert torch.equal(out, expected), f"call {call}, rank {rank}"
                assert torch.equal(out.view(torch.int16), outs[0].view(torch.int16)), "ranks disagree on the bits"
                assert ranks.stale_entries(rank) == 0, f"call {call}: rank {rank}'s buffer kept old parts"

    def test_inputs_are_left_untouched(self) -> None:
        ranks = Ranks(2, max_numel=2048)
        parts = [torch.full((1, 2048), -0.0, dtype=torch.bfloat16), torch.ones(1, 2048, dtype=torch.bfloat16)]
        before = [p.clone() for p in parts]
        outs = ranks.all_reduce(parts)
        assert all(torch.equal(p.view(torch.int16), b.view(torch.int16)) for p, b in zip(parts, before, strict=True))
        assert all(torch.equal(o, parts[1]) for o in outs)

    def test_refuses_what_it_cannot_sum(self) -> None:
        from asyncspec.kernels.push_all_reduce_triton import push_all_reduce

        ranks = Ranks(2, max_numel=1024)
        with pytest.raises(ValueError, match="takes"):
            push_all_reduce(torch.ones(8), ranks.ptrs, ranks.counts[0], 1024, 0, 2)
        with pytest.raises(ValueError, match="exceed"):
            push_all_reduce(torch.ones(1025, dtype=torch.bfloat16), ranks.ptrs, ranks.counts[0], 1024, 0, 2)
        assert int(ranks.counts[0].sum()) == 0 and bool((ranks.buffers[1] == -32768).all()), "a refused call wrote"
