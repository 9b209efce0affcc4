"""Alternative all-reduces for the small messages of decode steps, chosen with ASYNCSPEC_TP_ALL_REDUCE:

- `push` (the default): each rank stores its part straight into every peer's receive buffer over NVLink and
  polls its own until all parts have landed: one Triton kernel, launched with PDL like the step's other
  kernels, no barrier (kernels/push_all_reduce_triton.py). Receive buffers are torch symmetric memory, mapped
  on every rank. Inside a CUDA graph on two H100s: 4.4 us per decode-sized message against NCCL's 7.6 us,
  and the Llama-8B shape's batch-1 TPOT at TP=2 3.52 -> 3.11 ms. bf16 and fp16 models only.
- `symm_mem`: torch's own symmetric-memory one-shot all-reduce (device-side barriers before and after).
  Inside a CUDA graph on two H100s it measured 9.5 us per decode-sized message against NCCL's 7.7 us.
- `nccl`: NCCL for every message.

NCCL always keeps the large messages (prefill chunks). Another path is used only where every rank set it up
and a self-check against NCCL passed on every rank; otherwise all ranks use NCCL. docs/benchmarks.md (tensor
parallelism) has the measurements behind the default."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

MODE_ENV = "ASYNCSPEC_TP_ALL_REDUCE"
MODES = ("nccl", "symm_mem", "push")
DEFAULT_MODE = "push"

MAX_BYTES = 512 * 1024
"""Largest message sent the other way; one-shot beats NCCL's ring below roughly this size on NVLink (every
rank reads all of every peer's part)."""

SmallAllReduce = Callable[[torch.Tensor], "torch.Tensor | None"]


class _Reducer(Protocol):
    def rendezvous(self) -> None: ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None: ...


def all_reduce_mode() -> str:
    """The path ASYNCSPEC_TP_ALL_REDUCE asks for (DEFAULT_MODE when unset or unknown, with a warning)."""
    wanted = os.environ.get(MODE_ENV, DEFAULT_MODE)
    if wanted not in MODES:
        logger.warning("%s=%s is not one of %s: using %s", MODE_ENV, wanted, ", ".join(MODES), DEFAULT_MODE)
        return DEFAULT_MODE
    return wanted


def make_small_all_reduce(group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype) -> SmallAllReduce | None:
    """The all-reduce ASYNCSPEC_TP_ALL_REDUCE chose for messages up to MAX_BYTES of `dtype`, or None (use
    NCCL). A collective: every rank of `group` must call it."""
    wanted = all_reduce_mode()
    if wanted == "nccl" or device.type != "cuda":
        return None
    if wanted == "push":
        from asyncspec.kernels.push_all_reduce_triton import DTYPES

        if dtype not in DTYPES:
            # The same on every rank (one model dtype): no agreement needed.
            logger.info("tensor-parallel all-reduce: NCCL (the push path takes %s, the model runs %s)", DTYPES, dtype)
            return None
    ok, reduce, error = False, None, ""
    try:
        reduce = _PushAllReduce(group, device, dtype) if wanted == "push" else _SymmetricAllReduce(group, device, dtype)
        ok = True
    except Exception as e:  # an older torch, no peer access: NCCL it is
        error = f"{type(e).__name__}: {e}"
    # Every rank must take the same path, or a collective would wait for ever: agree before the
    # rendezvous (itself a collective), and again on the self-check.
    if reduce is not None and _all_agree(ok, group, device):
        try:
            reduce.rendezvous()
            ok = _self_check(reduce, group, dtype)
        except Exception as e:
            ok, error = False, f"{type(e).__name__}: {e}"
        if _all_agree(ok, group, device):
            logger.info("tensor-parallel all-reduce: %s up to %d KiB, NCCL above", wanted, MAX_BYTES // 1024)
            return reduce
        error = error or "the self-check against NCCL failed on a rank"
    elif reduce is None:
        _all_agree(False, group, device)
    logger.warning("%s=%s: using NCCL only (%s)", MODE_ENV, wanted, error or "another rank could not set it up")
    return None


def _all_agree(ok: bool, group: dist.ProcessGroup, device: torch.device) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return int(flag.item()) == 1


def _self_check(reduce: _Reducer, group: dist.ProcessGroup, dtype: torch.dtype) -> bool:
    """Sums rank-dependent small integers (exact in any order) both ways and compares, over several calls
    and sizes (whole and partial blocks, so that any per-call state turns over)."""
    rank = dist.get_rank(group)
    device = torch.device("cuda", torch.cuda.current_device())
    for i, numel in enumerate((4096, 4096 + 1000, 8, 4096, 2048 * 3)):
        x = torch.arange(numel, device=device).add_(i).to(dtype).mul_(rank + 1).remainder_(17)
        expected = x.clone()
        dist.all_reduce(expected, group=group)
        got = reduce(x)
        if got is None or not bool(torch.equal(got, expected)):
            return False
    return True


class _PushAllReduce:
    """Receive buffers in symmetric memory, the sum by kernels/push_all_reduce_triton.py."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        from asyncspec.kernels import push_all_reduce_triton as kernel

        self._kernel = kernel
        self._symm_mem = symm_mem
        self.group_name = group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:
            enable(self.group_name)
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.dtype = dtype
        self.device = device
        self.max_numel = MAX_BYTES // dtype.itemsize
        self.buffer = symm_mem.empty(
            kernel.receive_buffer_numel(self.max_numel, self.world), dtype=torch.int16, device=device
        )
        self.buffer.fill_(kernel.SENTINEL)
        self.counts = torch.zeros(kernel.num_programs(self.max_numel), dtype=torch.int32, device=device)
        self.buffer_ptrs: torch.Tensor | None = None

    def rendezvous(self) -> None:
        """Exchanges the buffers' handles with the peers (a collective)."""
        # A peer pushes as soon as the rendezvous returns: this rank's sentinel fill must have landed.
        torch.cuda.synchronize(self.device)
        handle = self._symm_mem.rendezvous(self.buffer, self.group_name)
        ptrs = list(handle.buffer_ptrs)
        # The tensor's place in its allocation, the same on every rank.
        offset = self.buffer.data_ptr() - ptrs[self.rank]
        self.buffer_ptrs = torch.tensor([p + offset for p in ptrs], dtype=torch.int64, device=self.device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.buffer_ptrs is None or x.numel() > self.max_numel or x.dtype != self.dtype:
            return None
        return self._kernel.push_all_reduce(x, self.buffer_ptrs, self.counts, self.max_numel, self.rank, self.world)


class _SymmetricAllReduce:
    def __init__(self, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype) -> None:
        import torch.distributed._symmetric_memory as symm_mem

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
