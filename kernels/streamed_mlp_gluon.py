"""One row's post-attention residual add, RMSNorm and SwiGLU MLP as one warp-specialised Gluon kernel (Hopper).

A batch-1 decode step reads every weight once, and on a chain of small kernels DRAM idles at every kernel boundary:
a kernel's loads can only start after its predecessor completes. Here each program (one an SM) has a loader warp
that streams the program's share of the weights by TMA into a ring of shared-memory slots, from the kernel's
first instruction: before the PDL wait (weights are constant through a step) and through the kernel's one grid
barrier, so DRAM keeps streaming while the consumer warps wait. The consumer warps normalise the whole row (each
program itself, so the norm needs no barrier), multiply their gate|up tiles (8 gate rows and the same columns' 8 up
rows a tile), write the activations, meet every program at the barrier, then multiply their down tiles. Every
intermediate is rounded as the engine's chain of kernels rounds it (`streamed_mlp.streamed_mlp_ref`).

The grid barrier needs every program resident at once: one program an SM, as many as the device has SMs. It holds
as long as nothing keeps an SM's shared memory forever (under MPS, an active-thread percentage below 100 would
break it). Its flags need no reset between launches or graph replays: a program reads its own flag, the epoch all
programs last reached, and waits until every flag is one past it, compared wrap-safe.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from asyncspec.kernels.pdl import pdl_launch_options, pdl_mode
from asyncspec.kernels.skinny_linear import FoldedNorm
from asyncspec.kernels.streamed_gemv import StreamedGemvConfig
from asyncspec.kernels.streamed_gemv_gluon import StreamedGemv
from asyncspec.kernels.streamed_mlp import (
    StreamedMLPConfig,
    StreamedMLPError,
    down_stages_for,
    shape_supported,
    split_down_room,
    stages_for,
    vector_rows,
)
from asyncspec.kernels.streamed_ring_gluon import (
    LOADER_REGISTERS,
    SLOT_LAYOUT,
    _grid_barrier,
    _load_tiles,
    _normalise_row,
    _pdl_start,
    _ring_next,
    _tile,
)


@gluon.jit
def _loader(
    wgu_desc,
    wd_desc,
    ring,
    ready,
    empty,
    num_a,
    num_b,
    H: gl.constexpr,
    INTER: gl.constexpr,
    NUM_PROGS: gl.constexpr,
    STAGES: gl.constexpr,
    D: gl.constexpr,
):
    """One warp: this program's gate|up slots, then its down slots, each as soon as its slot is free."""
    pid = gl.program_id(0)
    s = pid * 0
    ph = pid * 0
    for i in range(num_a):
        row = (pid + i * NUM_PROGS) * 8
        for kc in range(H // (256 * D)):
            mbarrier.wait(empty.index(s), ph ^ 1)
            mbarrier.expect(ready.index(s), D * 16 * 256 * 2)
            for d in gl.static_range(D):
                box = ring.index(s * D + d)
                col = (kc * D + d) * 256
                tma.async_copy_global_to_shared(wgu_desc, [row, col], ready.index(s), box.slice(0, 8))
                tma.async_copy_global_to_shared(wgu_desc, [INTER + row, col], ready.index(s), box.slice(8, 8))
            s, ph = _ring_next(s, ph, STAGES)
    _load_tiles(wd_desc, ring, ready, empty, s, ph, num_b, INTER, NUM_PROGS, STAGES, D)


@gluon.jit
def _consumer(
    ring,
    ready,
    empty,
    x_smem,
    a_smem,
    x_ptr,
    res_ptr,
    nw_ptr,
    out_ptr,
    res_out_ptr,
    gu_ptr,
    act_ptr,
    flags_ptr,
    eps,
    num_a,
    num_b,
    H: gl.constexpr,
    INTER: gl.constexpr,
    NUM_PROGS: gl.constexpr,
    NP2: gl.constexpr,
    STAGES: gl.constexpr,
    D: gl.constexpr,
    WARPS: gl.constexpr,
    USE_PDL: gl.constexpr,
    VR: gl.constexpr,
    SPLIT: gl.constexpr,
):
    pid = gl.program_id(0)
    w_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    r_layout: gl.constexpr = gl.SliceLayout(1, w_layout)
    cols = gl.arange(0, 256, layout=gl.SliceLayout(0, w_layout))
    offs_r = gl.arange(0, 16, layout=r_layout)
    # The vectors move in blocks of VR rows of 256 (a power of two dividing both widths).
    at = gl.arange(0, VR, layout=r_layout)[:, None] * 256 + cols[None, :]
    act_cols = gl.arange(0, 8, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
    _pdl_start(pid, USE_PDL)
    _normalise_row(x_smem, x_ptr, res_ptr, nw_ptr, res_out_ptr, eps, pid, at, H, VR, True, w_layout, r_layout)
    s = pid * 0
    ph = pid * 0
    for i in range(num_a):
        tile = pid + i * NUM_PROGS
        out, s, ph = _tile(ring, ready, empty, x_smem, s, ph, H // (256 * D), STAGES, D, VR, w_layout)
        gl.store(gu_ptr + tile * 16 + offs_r, out.to(gl.bfloat16).to(gl.float32))
    gl.thread_barrier()
    for i in range(num_a):
        tile = pid + i * NUM_PROGS
        gate = gl.load(gu_ptr + tile * 16 + act_cols)
        up = gl.load(gu_ptr + tile * 16 + 8 + act_cols)
        silu = (gate / (1.0 + gl.exp(-gate))).to(gl.bfloat16).to(gl.float32)
        gl.store(act_ptr + tile * 8 + act_cols, (silu * up).to(gl.bfloat16))
    if not SPLIT:  # split: the down projection is the next kernel, a streamed GEMV over act_ptr
        _grid_barrier(flags_ptr, pid, NUM_PROGS, NP2, WARPS)
        for c in gl.static_range(INTER // (256 * VR)):
            a_smem.index(c).store(gl.load(act_ptr + c * 256 * VR + at, cache_modifier=".cg"))
        gl.thread_barrier()
        for i in range(num_b):
            tile = pid + i * NUM_PROGS
            out, s, ph = _tile(ring, ready, empty, a_smem, s, ph, INTER // (256 * D), STAGES, D, VR, w_layout)
            gl.store(out_ptr + 16 * tile + offs_r, out.to(gl.bfloat16))


@gluon.jit
def _streamed_mlp_kernel(
    wgu_desc,  # [2 I, H] bf16 (gate rows, then up rows), box [8, 256]
    wd_desc,  # [H, I] bf16, box [16, 256]
    x_ptr,  # [H] bf16: the attention block's output
    res_ptr,  # [H] bf16: the residual stream before it
    nw_ptr,  # [H] bf16: the post-attention norm's weight
    out_ptr,  # [H] bf16: the MLP's output
    res_out_ptr,  # [H] bf16: x + residual
    gu_ptr,  # [2 I] fp32 scratch: gate|up outputs, 8 gate then 8 up a tile
    act_ptr,  # [I] bf16 scratch: the activations
    flags_ptr,  # [NUM_PROGS] int32: the grid barrier's epochs (all equal between launches)
    eps,
    H: gl.constexpr,
    INTER: gl.constexpr,
    NUM_PROGS: gl.constexpr,
    NP2: gl.constexpr,
    STAGES: gl.constexpr,
    D: gl.constexpr,
    WARPS: gl.constexpr,
    USE_PDL: gl.constexpr,
    VR: gl.constexpr,  # rows of 256 a block of the vectors moves in
    SPLIT: gl.constexpr,  # gate|up and the activations only: the down projection is a kernel of its own
):
    pid = gl.program_id(0)
    num_a = gl.maximum((INTER // 8 - pid + NUM_PROGS - 1) // NUM_PROGS, 0)
    num_b = gl.maximum((H // 16 - pid + NUM_PROGS - 1) // NUM_PROGS, 0)
    if SPLIT:
        num_b = 0
    rows: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES * D, 16, 256], SLOT_LAYOUT)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # Blocks of VR rows of 256: a block's shape must be a power of two, their count need not.
    x_smem = gl.allocate_shared_memory(gl.float32, [H // (256 * VR), VR, 256], rows)
    A_BLOCKS: gl.constexpr = 1 if SPLIT else INTER // (256 * VR)
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [A_BLOCKS, VR, 256], rows)
    for st in gl.static_range(STAGES):
        mbarrier.init(ready.index(st), count=1)
        mbarrier.init(empty.index(st), count=1)
    fence_async_shared()
    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    ring,
                    ready,
                    empty,
                    x_smem,
                    a_smem,
                    x_ptr,
                    res_ptr,
                    nw_ptr,
                    out_ptr,
                    res_out_ptr,
                    gu_ptr,
                    act_ptr,
                    flags_ptr,
                    eps,
                    num_a,
                    num_b,
                    H,
                    INTER,
                    NUM_PROGS,
                    NP2,
                    STAGES,
                    D,
                    WARPS,
                    USE_PDL,
                    VR,
                    SPLIT,
                ),
            ),
            (_loader, (wgu_desc, wd_desc, ring, ready, empty, num_a, num_b, H, INTER, NUM_PROGS, STAGES, D)),
        ],
        [1],
        [LOADER_REGISTERS],
    )


def _constexprs(config: StreamedMLPConfig, hidden: int, intermediate: int, num_progs: int, pdl: int) -> dict:
    return {
        "H": hidden,
        "INTER": intermediate,
        "NUM_PROGS": num_progs,
        "NP2": triton.next_power_of_2(num_progs),
        "STAGES": stages_for(config, hidden, intermediate),
        "D": config.boxes,
        "WARPS": config.warps,
        "USE_PDL": pdl,
        "VR": vector_rows(hidden, intermediate),
        "SPLIT": not config.grid_barrier,
    }


def compile_for_hopper(config: StreamedMLPConfig, hidden: int, intermediate: int, num_progs: int = 132) -> Any:
    """The kernel compiled for sm_90 without a GPU (Triton's own ptxas): a start-up-free check of a config and a
    shape; the result's `metadata.shared` is the shared memory a program holds."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    if not shape_supported(config, hidden, intermediate):
        raise StreamedMLPError(f"hidden={hidden}, intermediate={intermediate}: not a shape {config} takes")
    wgu = f"tensordesc<bf16[8,256],{SLOT_LAYOUT!r}>"
    wd = f"tensordesc<bf16[16,256],{SLOT_LAYOUT!r}>"
    signature = {
        "wgu_desc": wgu,
        "wd_desc": wd,
        **{name: "*bf16" for name in ("x_ptr", "res_ptr", "nw_ptr", "out_ptr", "res_out_ptr")},
        "gu_ptr": "*fp32",
        "act_ptr": "*bf16",
        "flags_ptr": "*i32",
        "eps": "fp32",
    }
    constexprs = _constexprs(config, hidden, intermediate, num_progs, True)
    names = _streamed_mlp_kernel.arg_names
    # The launcher's hints for 16-byte aligned pointers, so that this compiles the binary a launch would run.
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, v in signature.items() if v.startswith("*")}
    source = GluonASTSource(
        _streamed_mlp_kernel, {**signature, **{k: "constexpr" for k in constexprs}}, constexprs, attrs
    )
    options = {"num_warps": config.warps, "maxnreg": config.registers}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


class StreamedMLP:
    """The kernel's scratch, descriptors and launch on one device, for every layer of the shapes it was made for
    (split: the gate|up kernel, then the down projection's `StreamedGemv` over the activations' scratch). The
    layers share the scratch and the barrier's flags, so their launches must follow each other on one stream (the
    engine's forward pass runs on one)."""

    def __init__(
        self,
        device: torch.device,
        shapes: set[tuple[int, int]],
        config: StreamedMLPConfig,
        fold_next_norm: bool = False,
    ) -> None:
        for hidden, intermediate in shapes:
            if not shape_supported(config, hidden, intermediate):
                raise StreamedMLPError(f"hidden={hidden}, intermediate={intermediate}: not a shape {config} takes")
        if device.type != "cuda":
            raise StreamedMLPError(f"{device}: the streamed MLP runs on CUDA devices only")
        # An index, so that it compares equal to a tensor's device ("cuda" does not equal "cuda:0").
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        self.config = config
        self.shapes = frozenset(shapes)
        self.fold_next_norm = fold_next_norm and not config.grid_barrier
        """Whether a call given the next layer's norm folds it into the down projection (`StreamedGemv.add_norm`;
        the split forms only: the barrier form's down projection is inside its one kernel)."""
        self.num_progs = torch.cuda.get_device_properties(self.device).multi_processor_count
        widest = max((i for _, i in shapes), default=0)
        self._gate_up = torch.empty(2 * widest, dtype=torch.float32, device=self.device)
        self._act = torch.empty(widest, dtype=torch.bfloat16, device=self.device)
        self._flags = torch.zeros(self.num_progs, dtype=torch.int32, device=self.device)
        self._descriptors: dict[tuple[int, int], tuple[Any, Any]] = {}
        self._down: dict[tuple[int, int], StreamedGemv] = {}
        if not config.grid_barrier:
            for hidden, intermediate in shapes:
                down_config = StreamedGemvConfig(
                    down_stages_for(config, hidden, intermediate), config.boxes, config.warps, config.registers
                )
                room = split_down_room(config, hidden, intermediate)
                self._down[(hidden, intermediate)] = StreamedGemv(self.device, down_config, room)

    def applies(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        gate_up_weight: torch.Tensor,
        down_weight: torch.Tensor,
    ) -> bool:
        """Whether this call is one the kernel serves: one contiguous bf16 row and its residual on this device,
        contiguous bf16 weights of a shape it was made for."""
        if x.dim() != 2 or x.shape[0] != 1 or tuple(down_weight.shape) not in self.shapes:
            return False
        hidden, intermediate = down_weight.shape
        tensors = (x, residual, norm_weight, gate_up_weight, down_weight)
        return (
            all(t.dtype == torch.bfloat16 and t.device == self.device and t.is_contiguous() for t in tensors)
            and tuple(x.shape) == tuple(residual.shape) == (1, hidden)
            and tuple(norm_weight.shape) == (hidden,)
            and tuple(gate_up_weight.shape) == (2 * intermediate, hidden)
        )

    def _descriptors_for(self, gate_up_weight: torch.Tensor, down_weight: torch.Tensor) -> tuple[Any, Any]:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        key = (gate_up_weight.data_ptr(), down_weight.data_ptr())
        if key not in self._descriptors:
            self._descriptors[key] = (
                TensorDescriptor.from_tensor(gate_up_weight, [8, 256], SLOT_LAYOUT),
                TensorDescriptor.from_tensor(down_weight, [16, 256], SLOT_LAYOUT),
            )
        return self._descriptors[key]

    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        gate_up_weight: torch.Tensor,
        down_weight: torch.Tensor,
        next_norm: tuple[torch.Tensor, float] | None = None,
    ) -> tuple[torch.Tensor | FoldedNorm, torch.Tensor]:
        """(MLP output, x + residual), as `streamed_mlp_ref`; the caller has checked `applies`. With `next_norm`
        (the next layer's input norm: weight, eps) and `fold_next_norm`: (that norm folded, as
        `skinny_linear_add_norm_ref` gives it, the residual stream after the block), the MLP output added to the
        second tensor in place."""
        hidden, intermediate = down_weight.shape
        wgu_desc, wd_desc = self._descriptors_for(gate_up_weight, down_weight)
        out = torch.empty_like(x)
        residual_out = torch.empty_like(x)
        pdl = pdl_mode(x.device, 1)
        _streamed_mlp_kernel[(self.num_progs,)](
            wgu_desc,
            wd_desc,
            x,
            residual,
            norm_weight,
            out,
            residual_out,
            self._gate_up,
            self._act,
            self._flags,
            eps,
            **_constexprs(self.config, hidden, intermediate, self.num_progs, pdl),
            num_warps=self.config.warps,
            maxnreg=self.config.registers,
            **pdl_launch_options(pdl),
        )
        if not self.config.grid_barrier:
            act, down = self._act[:intermediate].view(1, intermediate), self._down[(hidden, intermediate)]
            if (
                next_norm is not None
                and self.fold_next_norm
                and down.add_norm_applies(down_weight, residual_out, next_norm[0])
            ):
                norm_weight, norm_eps = next_norm
                folded = down.add_norm(act, down_weight, residual=residual_out, norm_weight=norm_weight, eps=norm_eps)
                return folded, residual_out
            out = down(act, down_weight)
        return out, residual_out
