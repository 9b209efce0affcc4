"""An alternative all-reduce for the small messages of decode steps, opt-in with
ASYNCSPEC_TP_ALL_REDUCE=symm_mem: torch's symmetric memory (torch.distributed._symmetric_memory)
one-shot all-reduce, where each rank reads every peer's buffer over NVLink and sums in one kernel,
with a device-side barrier before and after (no NCCL launch, no NVLink multicast). NCCL keeps the
large messages (prefill chunks).

NCCL is the default: inside a CUDA graph on two H100s it measured 7.7 us per decode-sized all-reduce
against 9.5 us for this path, and the same TPOT end to end (docs/benchmarks.md, tensor parallelism).
The path is used only where every rank set it up and a self-check against NCCL passed on every
rank; otherwise all ranks use NCCL."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

MAX_BYTES = 512 * 1024
"""Largest message sent through symmetric memory; one-shot beats NCCL's ring below roughly this size
on NVLink (every rank reads all of every peer's buffer)."""

SmallAllReduce = Callable[[torch.Tensor], "torch.Tensor | None"]


def make_small_all_reduce(group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype) -> SmallAllReduce | None:
    """The one-shot all-reduce for messages up to MAX_BYTES of `dtype`, or None (use NCCL). A
    collective: every rank of `group` must call it."""
    wanted = os.environ.get("ASYNCSPEC_TP_ALL_REDUCE", "nccl")
    if wanted != "symm_mem" or device.type != "cuda":
        return None
    ok, reduce, error = False, None, ""
    try:
        reduce = _SymmetricAllReduce(group, device, dtype)
        ok = True
    except Exception as e:  # an older torch, or no peer access: NCCL it is
        error = f"{type(e).__name__}: {e}"
    # Every rank must take the same path, or a collective would wait for ever: agree before the
    # rendezvous (itself a collective), and again on the self-check.
    if reduce is not None and _all_agree(ok, group, device):
        try:
            reduce.rendezvous()
            ok = reduce.self_check()
        except Exception as e:
            ok, error = False, f"{type(e).__name__}: {e}"
        if _all_agree(ok, group, device):
            logger.info(
                "tensor-parallel all-reduce: symmetric-memory one-shot up to %d KiB, NCCL above", MAX_BYTES // 1024
            )
            return reduce
        error = error or "the self-check against NCCL failed on a rank"
    elif reduce is None:
        _all_agree(False, group, device)
    logger.warning(
        "ASYNCSPEC_TP_ALL_REDUCE=symm_mem: using NCCL only (%s)", error or "another rank could not set it up"
    )
    return None


def _all_agree(ok: bool, group: dist.ProcessGroup, device: torch.device) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return int(flag.item()) == 1


class _SymmetricAllReduce:
    def __init__(self, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group = group
        self.group_name = group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:
            enable(self.group_name)
        self.max_numel = MAX_BYTES // torch.empty((), dtype=dtype).element_size()
        self.buffer = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
        self._rendezvous = symm_mem.rendezvous
        ops = torch.ops.symm_mem
        self._copy_reduce = getattr(ops, "one_shot_all_reduce_copy", None)
        self._reduce = ops.one_shot_all_reduce

    def rendezvous(self) -> None:
        """Exchanges the buffers' handles with the peers (a collective)."""
        self._rendezvous(self.buffer, self.group_name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        n = x.numel()
        if n > self.max_numel or x.dtype != self.buffer.dtype or n % 8:
            return None
        x = x.contiguous()
        staged = self.buffer[:n].view(x.shape)
        if self._copy_reduce is not None:
            return self._copy_reduce(staged, x, "sum", self.group_name)
        staged.copy_(x)
        return self._reduce(staged, "sum", self.group_name)

    def self_check(self) -> bool:
        """Sums a rank-dependent tensor both ways and compares."""
        rank = dist.get_rank(self.group)
        x = torch.arange(4096, device=self.buffer.device).to(self.buffer.dtype).mul_(rank + 1).remainder_(17)
        expected = x.clone()
        dist.all_reduce(expected, group=self.group)
        got = self(x)
        return got is not None and bool(torch.equal(got, expected))
