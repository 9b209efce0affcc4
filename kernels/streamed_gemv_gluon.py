"""One row times a bias-free weight (x @ W^T) as a warp-specialised Gluon kernel (Hopper).

A loader warp streams the program's 16-row tiles of W by TMA into a ring of shared-memory slots from the kernel's
first instruction, before the PDL wait: weights are constant through a step, so while the predecessor kernel (the
attention, or the MLP's gate|up) still runs, this kernel's share of W is already on its way. With a ring as large
as a program's share, all of W can be in shared memory by the time the wait returns. The consumer warps stage x
after the wait and multiply it into each tile as it lands (`streamed_ring_gluon._tile`), fp32 sums, bf16 out.

It needs no grid barrier, so it cannot hang whatever else holds the GPU's SMs: a program that is not resident yet
simply starts later.

`StreamedGemv.add_norm` folds the residual add and the first half of the next RMSNorm into the epilogue, as
`skinny_linear_add_norm` does for 4 rows and more: each 16-row tile's h = round(round(x @ W^T) + residual) goes over
the residual, round(h * norm weight) is the output, and the tile's sum of h^2 goes to its column of the partials
[1, N / 16], whose sum the next projection's `row_scale=` turns into the row's factor. No norm kernel then runs
between a batch-1 layer's down projection and the next layer's q|k|v.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from asyncspec.kernels.pdl import WAIT_FIRST, pdl_launch_options, pdl_mode
from asyncspec.kernels.skinny_linear import FoldedNorm
from asyncspec.kernels.streamed_gemv import (
    SHARED_MEMORY_BYTES,
    StreamedGemvConfig,
    StreamedGemvError,
    gemv_shape_supported,
    gemv_stages_for,
    vector_rows,
)
from asyncspec.kernels.streamed_ring_gluon import LOADER_REGISTERS, SLOT_LAYOUT, _load_tiles, _pdl_start, _tile


@gluon.jit
def _gemv_loader(
    w_desc, ring, ready, empty, num_t, K: gl.constexpr, NUM_PROGS: gl.constexpr, STAGES: gl.constexpr, D: gl.constexpr
):
    """One warp: this program's 16-row tiles of W, D column boxes a slot, each as soon as its slot is free."""
    pid = gl.program_id(0)
    _load_tiles(w_desc, ring, ready, empty, pid * 0, pid * 0, num_t, K, NUM_PROGS, STAGES, D)


@gluon.jit
def _gemv_consumer(
    ring,
    ready,
    empty,
    x_smem,
    x_ptr,
    out_ptr,
    res_ptr,
    norm_w_ptr,
    sq_ptr,
    num_t,
    N: gl.constexpr,
    K: gl.constexpr,
    NUM_PROGS: gl.constexpr,
    STAGES: gl.constexpr,
    D: gl.constexpr,
    WARPS: gl.constexpr,
    USE_PDL: gl.constexpr,
    VR: gl.constexpr,
    ADD_NORM: gl.constexpr,
):
    pid = gl.program_id(0)
    w_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    r_layout: gl.constexpr = gl.SliceLayout(1, w_layout)
    offs_r = gl.arange(0, 16, layout=r_layout)
    at = (
        gl.arange(0, VR, layout=r_layout)[:, None] * 256
        + gl.arange(0, 256, layout=gl.SliceLayout(0, w_layout))[None, :]
    )
    if ADD_NORM:
        # The norm weight is constant through a step: the first tile's before the wait. The residual is the
        # predecessor's output: after it, before the K loop, so that neither load is the kernel's tail.
        first = 16 * pid + offs_r
        norm_w = gl.load(norm_w_ptr + first, mask=first < N, other=0.0).to(gl.float32)
    # x is the predecessor's output: read only after the wait, and from L2 (the previous launch's programs on this
    # SM may have read the same scratch).
    _pdl_start(pid, USE_PDL)
    if ADD_NORM:
        residual = gl.load(res_ptr + first, mask=first < N, other=0.0, cache_modifier=".cg").to(gl.float32)
    for c in gl.static_range(K // (256 * VR)):
        x_smem.index(c).store(gl.load(x_ptr + c * 256 * VR + at, cache_modifier=".cg"))
    gl.thread_barrier()
    s = pid * 0
    ph = pid * 0
    for i in range(num_t):
        tile = pid + i * NUM_PROGS
        out, s, ph = _tile(ring, ready, empty, x_smem, s, ph, K // (256 * D), STAGES, D, VR, w_layout)
        if ADD_NORM:
            rows = 16 * tile + offs_r
            h = (out.to(gl.bfloat16).to(gl.float32) + residual).to(gl.bfloat16)
            gl.store(res_ptr + rows, h)
            hf = h.to(gl.float32)
            gl.store(out_ptr + rows, (hf * norm_w).to(gl.bfloat16))
            squares = gl.sum(hf * hf, axis=0)
            gl.store(sq_ptr + tile + offs_r * 0, gl.zeros([16], gl.float32, r_layout) + squares, mask=offs_r == 0)
            # The next tile's operands (none past the last: masked).
            after = rows + 16 * NUM_PROGS
            norm_w = gl.load(norm_w_ptr + after, mask=after < N, other=0.0).to(gl.float32)
            residual = gl.load(res_ptr + after, mask=after < N, other=0.0, cache_modifier=".cg").to(gl.float32)
        else:
            gl.store(out_ptr + 16 * tile + offs_r, out.to(gl.bfloat16))


@gluon.jit
def _streamed_gemv_kernel(
    w_desc,  # [N, K] bf16, box [16, 256]
    x_ptr,  # [K] bf16
    out_ptr,  # [N] bf16 (ADD_NORM: h * norm weight)
    res_ptr,  # ADD_NORM: [N] bf16 residual stream, h written over it
    norm_w_ptr,  # ADD_NORM: [N] bf16 norm weight
    sq_ptr,  # ADD_NORM: [N // 16] fp32 sums of h^2, one a tile
    N: gl.constexpr,
    K: gl.constexpr,
    NUM_PROGS: gl.constexpr,
    STAGES: gl.constexpr,
    D: gl.constexpr,
    WARPS: gl.constexpr,
    USE_PDL: gl.constexpr,
    VR: gl.constexpr,  # rows of 256 a block of x moves in
    ADD_NORM: gl.constexpr = False,
):
    pid = gl.program_id(0)
    num_t = gl.maximum((N // 16 - pid + NUM_PROGS - 1) // NUM_PROGS, 0)
    rows: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES * D, 16, 256], SLOT_LAYOUT)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [K // (256 * VR), VR, 256], rows)
    for st in gl.static_range(STAGES):
        mbarrier.init(ready.index(st), count=1)
        mbarrier.init(empty.index(st), count=1)
    fence_async_shared()
    gl.warp_specialize(
        [
            (
                _gemv_consumer,
                (
                    ring,
                    ready,
                    empty,
                    x_smem,
                    x_ptr,
                    out_ptr,
                    res_ptr,
                    norm_w_ptr,
                    sq_ptr,
                    num_t,
                    N,
                    K,
                    NUM_PROGS,
                    STAGES,
                    D,
                    WARPS,
                    USE_PDL,
                    VR,
                    ADD_NORM,
                ),
            ),
            (_gemv_loader, (w_desc, ring, ready, empty, num_t, K, NUM_PROGS, STAGES, D)),
        ],
        [1],
        [LOADER_REGISTERS],
    )


def _constexprs(
    config: StreamedGemvConfig, n: int, k: int, num_progs: int, pdl: int, room: int, add_norm: bool = False
) -> dict:
    return {
        "ADD_NORM": add_norm,
        "N": n,
        "K": k,
        "NUM_PROGS": num_progs,
        "STAGES": gemv_stages_for(config, k, room),
        "D": config.boxes,
        "WARPS": config.warps,
        "USE_PDL": pdl,
        "VR": vector_rows(k),
    }


def compile_for_hopper(
    config: StreamedGemvConfig,
    n: int,
    k: int,
    num_progs: int = 132,
    room: int = SHARED_MEMORY_BYTES,
    pdl: int = WAIT_FIRST,
    add_norm: bool = False,
) -> Any:
    """The kernel compiled for sm_90 without a GPU (Triton's own ptxas): a start-up-free check of a config and a
    shape; the result's `metadata.shared` is the shared memory a program holds. `pdl`: a `pdl_mode`; `add_norm`:
    the residual add and norm epilogue (`StreamedGemv.add_norm`)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    if not gemv_shape_supported(config, n, k, room):
        raise StreamedGemvError(f"weight [{n}, {k}]: not a shape {config} takes within {room} bytes")
    signature = {
        "w_desc": f"tensordesc<bf16[16,256],{SLOT_LAYOUT!r}>",
        "x_ptr": "*bf16",
        "out_ptr": "*bf16",
        "res_ptr": "*bf16",
        "norm_w_ptr": "*bf16",
        "sq_ptr": "*fp32",
    }
    constexprs = _constexprs(config, n, k, num_progs, pdl, room, add_norm)
    names = _streamed_gemv_kernel.arg_names
    # The launcher's hints for 16-byte aligned pointers, so that this compiles the binary a launch would run.
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name, v in signature.items() if v.startswith("*")}
    source = GluonASTSource(
        _streamed_gemv_kernel, {**signature, **{name: "constexpr" for name in constexprs}}, constexprs, attrs
    )
    options = {"num_warps": config.warps, "maxnreg": config.registers}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


class StreamedGemv:
    """The kernel's descriptors and launch on one device for one-row calls of any weight it takes.

    `room` is the shared memory a program may hold: less than a whole SM's when a program of another kernel must
    fit beside it (the split MLP's gate|up kernel, still running while this one's loader streams)."""

    def __init__(self, device: torch.device, config: StreamedGemvConfig, room: int = SHARED_MEMORY_BYTES) -> None:
        if device.type != "cuda":
            raise StreamedGemvError(f"{device}: the streamed GEMV runs on CUDA devices only")
        if not 0 < room <= SHARED_MEMORY_BYTES:
            raise StreamedGemvError(f"room={room}: a program holds at most {SHARED_MEMORY_BYTES} bytes")
        # An index, so that it compares equal to a tensor's device ("cuda" does not equal "cuda:0").
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        self.config = config
        self.room = room
        self.num_progs = torch.cuda.get_device_properties(self.device).multi_processor_count
        self._descriptors: dict[tuple[int, int, int], Any] = {}

    def applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether this call is one the kernel serves: one contiguous bf16 row and a contiguous bf16 weight
        [N, K] of a shape it takes, both on this device."""
        if x.dim() != 2 or x.shape[0] != 1 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
            return False
        return (
            all(t.dtype == torch.bfloat16 and t.device == self.device and t.is_contiguous() for t in (x, weight))
            and x.data_ptr() % 16 == 0
            and weight.data_ptr() % 16 == 0  # a TMA descriptor's base
            and gemv_shape_supported(self.config, weight.shape[0], weight.shape[1], self.room)
        )

    def _descriptor_for(self, weight: torch.Tensor) -> Any:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        key = (weight.data_ptr(), weight.shape[0], weight.shape[1])
        if key not in self._descriptors:
            self._descriptors[key] = TensorDescriptor.from_tensor(weight, [16, 256], SLOT_LAYOUT)
        return self._descriptors[key]

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight^T [1, N] in bf16, as `streamed_gemv_ref`; the caller has checked `applies`."""
        n, k = weight.shape
        out = torch.empty(1, n, dtype=x.dtype, device=x.device)
        self._launch(x, weight, out, out, out, out, add_norm=False)
        return out

    def add_norm(
        self, x: torch.Tensor, weight: torch.Tensor, *, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
    ) -> FoldedNorm:
        """x @ weight^T added to `residual` (written over it) and weighted for the RMSNorm after it, as
        `skinny_linear_add_norm_ref` (bias-free): a `FoldedNorm` whose sum_squares holds one partial a 16-row tile
        [1, N / 16]. The caller has checked `applies`; `add_norm_applies` checks the residual and the weight."""
        n, k = weight.shape
        out = torch.empty(1, n, dtype=x.dtype, device=x.device)
        sum_squares = torch.empty(1, n // 16, dtype=torch.float32, device=x.device)
        self._launch(x, weight, out, residual, norm_weight, sum_squares, add_norm=True)
        return FoldedNorm(out, sum_squares, eps)

    def add_norm_applies(self, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor) -> bool:
        """Whether `add_norm` takes this residual stream [1, N] and norm weight [N] (bf16, contiguous, on this
        device) for a call that `applies` takes."""
        n = weight.shape[0]
        return (
            all(
                t.dtype == torch.bfloat16 and t.device == self.device and t.is_contiguous()
                for t in (residual, norm_weight)
            )
            and tuple(residual.shape) == (1, n)
            and tuple(norm_weight.shape) == (n,)
        )

    def _launch(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        out: torch.Tensor,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        sum_squares: torch.Tensor,
        *,
        add_norm: bool,
    ) -> None:
        n, k = weight.shape
        pdl = pdl_mode(x.device, 1)
        _streamed_gemv_kernel[(self.num_progs,)](
            self._descriptor_for(weight),
            x,
            out,
            residual,
            norm_weight,
            sum_squares,
            **_constexprs(self.config, n, k, self.num_progs, pdl, self.room, add_norm),
            num_warps=self.config.warps,
            maxnreg=self.config.registers,
            **pdl_launch_options(pdl),
        )
