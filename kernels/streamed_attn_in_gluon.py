"""One row's residual add, RMSNorm, fused q|k|v projection, RoPE and paged KV-cache write as one warp-specialised
Gluon kernel (Hopper).

A batch-1 decode step reads every weight once, and on a chain of small kernels DRAM idles at every kernel boundary.
Here each program (one an SM) has a loader warp that streams the program's 16-row tiles of the q|k|v weight by TMA
into a ring of shared-memory slots from the kernel's first instruction, before the PDL wait (weights are constant
through a step), so the weight is on its way while the predecessor (the previous layer's MLP) still runs. A tile
is 8 rows of one head's first rotary half and the same 8 rows of its second half (two [8, 256] boxes a slot box,
as the MLP's gate|up tiles), so the program that computes an output also holds its rotary partner. The consumer
warps normalise the whole row after the wait (each program itself: no grid barrier), multiply their tiles, park
the bf16-rounded outputs in an fp32 scratch, then rotate q and k and store q, k and v, every intermediate rounded
as the engine's chain of kernels rounds it (`streamed_attn_in.streamed_attn_in_ref`).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from asyncspec.kernels.pdl import pdl_launch_options, pdl_mode
from asyncspec.kernels.streamed_attn_in import (
    StreamedAttnInConfig,
    StreamedAttnInError,
    qkv_tiles,
    shape_supported,
    stages_for,
)
from asyncspec.kernels.streamed_gemv import vector_rows
from asyncspec.kernels.streamed_ring_gluon import (
    LOADER_REGISTERS,
    SLOT_LAYOUT,
    _normalise_row,
    _pdl_start,
    _ring_next,
    _tile,
)


@gluon.jit
def _loader(
    w_desc,
    ring,
    ready,
    empty,
    num_t,
    H: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    NUM_PROGS: gl.constexpr,
    STAGES: gl.constexpr,
    BOXES: gl.constexpr,
):
    """One warp: this program's tiles (8 first-half and the matching 8 second-half rows of a head), each slot as
    soon as it is free."""
    pid = gl.program_id(0)
    s = pid * 0
    ph = pid * 0
    for i in range(num_t):
        tile = pid + i * NUM_PROGS
        row = (tile // (HEAD_DIM // 16)) * HEAD_DIM + (tile % (HEAD_DIM // 16)) * 8
        for kc in range(H // (256 * BOXES)):
            mbarrier.wait(empty.index(s), ph ^ 1)
            mbarrier.expect(ready.index(s), BOXES * 16 * 256 * 2)
            for d in gl.static_range(BOXES):
                box = ring.index(s * BOXES + d)
                col = (kc * BOXES + d) * 256
                tma.async_copy_global_to_shared(w_desc, [row, col], ready.index(s), box.slice(0, 8))
                tma.async_copy_global_to_shared(w_desc, [row + HEAD_DIM // 2, col], ready.index(s), box.slice(8, 8))
            s, ph = _ring_next(s, ph, STAGES)


@gluon.jit
def _rounded_product(a, b):
    """a * b rounded to bf16 (as a bf16 tensor op rounds it), kept in fp32: the cast also keeps the compiler from
    fusing the product into the following sum."""
    return (a * b).to(gl.bfloat16).to(gl.float32)


@gluon.jit
def _epilogue(
    qkv_ptr,
    q_ptr,
    kc_ptr,
    vc_ptr,
    cos_ptr,
    sin_ptr,
    tile,
    cols,
    pos,
    kc_off,
    vc_off,
    slot_ok,
    cos_stride,
    sin_stride,
    kc_stride_h,
    vc_stride_h,
    NUM_HEADS: gl.constexpr,
    NUM_KV_HEADS: gl.constexpr,
    HEAD_DIM: gl.constexpr,
):
    """One tile's 8 (first-half, second-half) pairs: rotated by RoPE as `rotary_kv_write.rotate_ref` rounds it
    (cos/sin cast to bf16, each product rounded, then their sum) for q and k heads; q to q_ptr, k and v (as
    projected) to the token's cache slot, where it has one."""
    HALF: gl.constexpr = HEAD_DIM // 2
    head = tile // (HEAD_DIM // 16)
    d = (tile % (HEAD_DIM // 16)) * 8 + cols
    lo = gl.load(qkv_ptr + tile * 16 + cols)
    hi = gl.load(qkv_ptr + tile * 16 + 8 + cols)
    if head < NUM_HEADS + NUM_KV_HEADS:
        c = gl.load(cos_ptr + pos * cos_stride + d).to(gl.bfloat16).to(gl.float32)
        sn = gl.load(sin_ptr + pos * sin_stride + d).to(gl.bfloat16).to(gl.float32)
        r_lo = (_rounded_product(lo, c) + _rounded_product(-hi, sn)).to(gl.bfloat16)
        r_hi = (_rounded_product(hi, c) + _rounded_product(lo, sn)).to(gl.bfloat16)
        if head < NUM_HEADS:
            q_ptrs = q_ptr + head * HEAD_DIM + d
            gl.store(q_ptrs, r_lo)
            gl.store(q_ptrs + HALF, r_hi)
        else:
            k_ptrs = kc_ptr + kc_off + (head - NUM_HEADS) * kc_stride_h + d
            gl.store(k_ptrs, r_lo, mask=slot_ok)
            gl.store(k_ptrs + HALF, r_hi, mask=slot_ok)
    else:
        v_ptrs = vc_ptr + vc_off + (head - NUM_HEADS - NUM_KV_HEADS) * vc_stride_h + d
        gl.store(v_ptrs, lo.to(gl.bfloat16), mask=slot_ok)
        gl.store(v_ptrs + HALF, hi.to(gl.bfloat16), mask=slot_ok)


@gluon.jit
def _consumer(
    ring,
    ready,
    empty,
    x_smem,
    x_ptr,
    res_ptr,
    nw_ptr,
    res_out_ptr,
    qkv_ptr,
    q_ptr,
    kc_ptr,
    vc_ptr,
    pos_ptr,
    slot_ptr,
    cos_ptr,
    sin_ptr,
    eps,
    cos_stride,
    sin_stride,
    max_position,
    block_size,
    kc_stride_b,
    kc_stride_s,
    kc_stride_h,
    vc_stride_b,
    vc_stride_s,
    vc_stride_h,
    num_t,
    H: gl.constexpr,
    NUM_HEADS: gl.constexpr,
    NUM_KV_HEADS: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    NUM_PROGS: gl.constexpr,
    STAGES: gl.constexpr,
    BOXES: gl.constexpr,
    WARPS: gl.constexpr,
    USE_PDL: gl.constexpr,
    VR: gl.constexpr,
    HAS_RESIDUAL: gl.constexpr,
):
    pid = gl.program_id(0)
    w_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    r_layout: gl.constexpr = gl.SliceLayout(1, w_layout)
    cols = gl.arange(0, 256, layout=gl.SliceLayout(0, w_layout))
    offs_r = gl.arange(0, 16, layout=r_layout)
    # The row moves in blocks of VR rows of 256 (a power of two dividing its width).
    at = gl.arange(0, VR, layout=r_layout)[:, None] * 256 + cols[None, :]
    pair_cols = gl.arange(0, 8, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
    _pdl_start(pid, USE_PDL)
    _normalise_row(x_smem, x_ptr, res_ptr, nw_ptr, res_out_ptr, eps, pid, at, H, VR, HAS_RESIDUAL, w_layout, r_layout)
    s = pid * 0
    ph = pid * 0
    for i in range(num_t):
        tile = pid + i * NUM_PROGS
        out, s, ph = _tile(ring, ready, empty, x_smem, s, ph, H // (256 * BOXES), STAGES, BOXES, VR, w_layout)
        # skinny_linear's rounding: each projected output to bf16, parked in fp32.
        gl.store(qkv_ptr + tile * 16 + offs_r, out.to(gl.bfloat16).to(gl.float32))
    gl.thread_barrier()
    # The token's position, clamped into the cos/sin caches (only a padding row's garbage lies beyond them), and
    # its slot: a slot < 0 (padding) is written nowhere, its address kept in bounds all the same.
    pos = gl.load(pos_ptr + pair_cols * 0).to(gl.int64)
    pos = gl.minimum(gl.maximum(pos, 0), max_position - 1)
    slot = gl.load(slot_ptr + pair_cols * 0).to(gl.int64)
    slot_ok = slot >= 0
    safe_slot = gl.maximum(slot, 0)
    blk = safe_slot // block_size
    in_blk = safe_slot % block_size
    kc_off = blk * kc_stride_b + in_blk * kc_stride_s
    vc_off = blk * vc_stride_b + in_blk * vc_stride_s
    for i in range(num_t):
        _epilogue(
            qkv_ptr,
            q_ptr,
            kc_ptr,
            vc_ptr,
            cos_ptr,
            sin_ptr,
            pid + i * NUM_PROGS,
            pair_cols,
            pos,
            kc_off,
            vc_off,
            slot_ok,
            cos_stride,
            sin_stride,
            kc_stride_h,
            vc_stride_h,
            NUM_HEADS,
            NUM_KV_HEADS,
            HEAD_DIM,
        )


@gluon.jit
def _streamed_attn_in_kernel(
    w_desc,  # [(NH + 2 KVH) HD, H] bf16 (q heads, then k heads, then v heads), box [8, 256]
    x_ptr,  # [H] bf16: the previous layer's output (the embedding for the first layer)
    res_ptr,  # [H] bf16: the residual stream before it (unread without HAS_RESIDUAL)
    nw_ptr,  # [H] bf16: the input norm's weight
    res_out_ptr,  # [H] bf16: x + residual (unwritten without HAS_RESIDUAL)
    qkv_ptr,  # [(NH + 2 KVH) HD] fp32 scratch: the projection, 8 first-half then 8 second-half outputs a tile
    q_ptr,  # [NH, HD] bf16: rotated q
    kc_ptr,  # [NB, BS, KVH, HD] bf16 (strided but for HD): the key cache
    vc_ptr,  # [NB, BS, KVH, HD] bf16 (strided but for HD): the value cache
    pos_ptr,  # [>= 1] int: the token's position
    slot_ptr,  # [>= 1] int: the token's flat cache slot, < 0 for none
    cos_ptr,  # [max_position, HD / 2] fp32 (rows strided)
    sin_ptr,  # [max_position, HD / 2] fp32 (rows strided)
    eps,
    cos_stride,
    sin_stride,
    max_position,
    block_size,
    kc_stride_b,
    kc_stride_s,
    kc_stride_h,
    vc_stride_b,
    vc_stride_s,
    vc_stride_h,
    H: gl.constexpr,
    NUM_HEADS: gl.constexpr,
    NUM_KV_HEADS: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    NUM_PROGS: gl.constexpr,
    STAGES: gl.constexpr,
    BOXES: gl.constexpr,
    WARPS: gl.constexpr,
    USE_PDL: gl.constexpr,
    VR: gl.constexpr,  # rows of 256 a block of the row moves in
    HAS_RESIDUAL: gl.constexpr,  # False: the first layer, whose sum is x itself
):
    pid = gl.program_id(0)
    TILES: gl.constexpr = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM // 16
    num_t = gl.maximum((TILES - pid + NUM_PROGS - 1) // NUM_PROGS, 0)
    rows: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES * BOXES, 16, 256], SLOT_LAYOUT)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # Blocks of VR rows of 256: a block's shape must be a power of two, their count need not.
    x_smem = gl.allocate_shared_memory(gl.float32, [H // (256 * VR), VR, 256], rows)
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
                    x_ptr,
                    res_ptr,
                    nw_ptr,
                    res_out_ptr,
                    qkv_ptr,
                    q_ptr,
                    kc_ptr,
                    vc_ptr,
                    pos_ptr,
                    slot_ptr,
                    cos_ptr,
                    sin_ptr,
                    eps,
                    cos_stride,
                    sin_stride,
                    max_position,
                    block_size,
                    kc_stride_b,
                    kc_stride_s,
                    kc_stride_h,
                    vc_stride_b,
                    vc_stride_s,
                    vc_stride_h,
                    num_t,
                    H,
                    NUM_HEADS,
                    NUM_KV_HEADS,
                    HEAD_DIM,
                    NUM_PROGS,
                    STAGES,
                    BOXES,
                    WARPS,
                    USE_PDL,
                    VR,
                    HAS_RESIDUAL,
                ),
            ),
            (_loader, (w_desc, ring, ready, empty, num_t, H, HEAD_DIM, NUM_PROGS, STAGES, BOXES)),
        ],
        [1],
        [LOADER_REGISTERS],
    )


def _constexprs(
    config: StreamedAttnInConfig,
    shape: tuple[int, int, int, int],
    num_progs: int,
    pdl: int,
    has_residual: bool,
) -> dict:
    hidden, num_heads, num_kv_heads, head_dim = shape
    return {
        "H": hidden,
        "NUM_HEADS": num_heads,
        "NUM_KV_HEADS": num_kv_heads,
        "HEAD_DIM": head_dim,
        "NUM_PROGS": num_progs,
        "STAGES": stages_for(config, hidden),
        "BOXES": config.boxes,
        "WARPS": config.warps,
        "USE_PDL": pdl,
        "VR": vector_rows(hidden),
        "HAS_RESIDUAL": has_residual,
    }


def _unsupported(config: StreamedAttnInConfig, shape: tuple[int, int, int, int]) -> StreamedAttnInError:
    hidden, num_heads, num_kv_heads, head_dim = shape
    return StreamedAttnInError(
        f"hidden={hidden}, num_heads={num_heads}, num_kv_heads={num_kv_heads}, head_dim={head_dim}: not a shape "
        f"{config} takes (head_dim a multiple of 16, hidden a multiple of {256 * config.boxes}, and room for a "
        "ring of 2 slots beside the row: fewer boxes a slot takes more widths)"
    )


def compile_for_hopper(
    config: StreamedAttnInConfig,
    hidden: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_progs: int = 132,
    *,
    residual: bool = True,
) -> Any:
    """The kernel compiled for sm_90 without a GPU (Triton's own ptxas): a start-up-free check of a config and a
    shape; the result's `metadata.shared` is the shared memory a program holds. `residual` False compiles the
    first layer's form (no residual to add)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    shape = (hidden, num_heads, num_kv_heads, head_dim)
    if not shape_supported(config, *shape):
        raise _unsupported(config, shape)
    signature = {
        "w_desc": f"tensordesc<bf16[8,256],{SLOT_LAYOUT!r}>",
        **{name: "*bf16" for name in ("x_ptr", "res_ptr", "nw_ptr", "res_out_ptr")},
        "qkv_ptr": "*fp32",
        **{name: "*bf16" for name in ("q_ptr", "kc_ptr", "vc_ptr")},
        "pos_ptr": "*i64",
        "slot_ptr": "*i64",
        "cos_ptr": "*fp32",
        "sin_ptr": "*fp32",
        "eps": "fp32",
        **{
            name: "i32"
            for name in (
                "cos_stride",
                "sin_stride",
                "max_position",
                "block_size",
                "kc_stride_b",
                "kc_stride_s",
                "kc_stride_h",
                "vc_stride_b",
                "vc_stride_s",
                "vc_stride_h",
            )
        },
    }
    constexprs = _constexprs(config, shape, num_progs, True, residual)
    names = _streamed_attn_in_kernel.arg_names
    # The launcher's hints for 16-byte aligned pointers, so that this compiles the binary a launch would run.
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, v in signature.items() if v.startswith("*")}
    source = GluonASTSource(
        _streamed_attn_in_kernel, {**signature, **{k: "constexpr" for k in constexprs}}, constexprs, attrs
    )
    options = {"num_warps": config.warps, "maxnreg": config.registers}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


class StreamedAttnIn:
    """The kernel's scratch, descriptors and launch on one device, for every layer of the shapes it was made for:
    (hidden, num_heads, num_kv_heads, head_dim) tuples. The layers share the scratch, so their launches must follow
    each other on one stream (the engine's forward pass runs on one)."""

    def __init__(
        self, device: torch.device, shapes: set[tuple[int, int, int, int]], config: StreamedAttnInConfig
    ) -> None:
        for shape in shapes:
            if not shape_supported(config, *shape):
                raise _unsupported(config, shape)
        if device.type != "cuda":
            raise StreamedAttnInError(f"{device}: the streamed attention input runs on CUDA devices only")
        # An index, so that it compares equal to a tensor's device ("cuda" does not equal "cuda:0").
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        self.config = config
        self.shapes = frozenset(shapes)
        self.num_progs = torch.cuda.get_device_properties(self.device).multi_processor_count
        widest = max((16 * qkv_tiles(*shape[1:]) for shape in shapes), default=0)
        self._qkv = torch.empty(widest, dtype=torch.float32, device=self.device)
        self._descriptors: dict[tuple[int, int, int], Any] = {}

    def _shape_of(
        self, x: torch.Tensor, qkv_weight: torch.Tensor, num_heads: int, num_kv_heads: int
    ) -> tuple[int, int, int, int] | None:
        """The served shape this call is of, or None."""
        if x.dim() != 2 or x.shape[0] != 1 or qkv_weight.dim() != 2 or num_heads <= 0 or num_kv_heads <= 0:
            return None
        rows, hidden = qkv_weight.shape
        if rows % (num_heads + 2 * num_kv_heads):
            return None
        shape = (hidden, num_heads, num_kv_heads, rows // (num_heads + 2 * num_kv_heads))
        return shape if shape in self.shapes else None

    def applies(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        qkv_weight: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        positions: torch.Tensor,
        cos_cache: torch.Tensor,
        sin_cache: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> bool:
        """Whether this call is one the kernel serves: one contiguous bf16 row (and its residual, if any) on this
        device, a contiguous bf16 q|k|v weight of a shape it was made for, fp32 cos/sin caches and bf16 KV caches
        [NB, BS, KVH, D] whose last dimension is contiguous, and integer positions and slots."""
        shape = self._shape_of(x, qkv_weight, num_heads, num_kv_heads)
        if shape is None:
            return False
        hidden, _, _, head_dim = shape
        rows = (x, norm_weight, qkv_weight) if residual is None else (x, residual, norm_weight, qkv_weight)
        cache_shape = (num_kv_heads, head_dim)
        indices = (positions, slot_mapping)
        return (
            all(t.dtype == torch.bfloat16 and t.device == self.device and t.is_contiguous() for t in rows)
            and tuple(x.shape) == (1, hidden)
            and (residual is None or tuple(residual.shape) == (1, hidden))
            and tuple(norm_weight.shape) == (hidden,)
            and qkv_weight.data_ptr() % 16 == 0  # a TMA descriptor's base
            and all(
                t.dtype == torch.float32
                and t.device == self.device
                and t.dim() == 2
                and t.shape[0] > 0
                and t.shape[1] == head_dim // 2
                and t.stride(1) == 1
                for t in (cos_cache, sin_cache)
            )
            and cos_cache.shape[0] == sin_cache.shape[0]
            and all(
                t.dtype == torch.bfloat16
                and t.device == self.device
                and t.dim() == 4
                and tuple(t.shape[2:]) == cache_shape
                and t.stride(3) == 1
                for t in (k_cache, v_cache)
            )
            and k_cache.shape[:2] == v_cache.shape[:2]
            and all(
                t.dtype in (torch.int32, torch.int64) and t.device == self.device and t.dim() == 1 and t.numel() > 0
                for t in indices
            )
        )

    def _descriptor_for(self, qkv_weight: torch.Tensor) -> Any:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        key = (qkv_weight.data_ptr(), qkv_weight.shape[0], qkv_weight.shape[1])
        if key not in self._descriptors:
            self._descriptors[key] = TensorDescriptor.from_tensor(qkv_weight, [8, 256], SLOT_LAYOUT)
        return self._descriptors[key]

    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        qkv_weight: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        positions: torch.Tensor,
        cos_cache: torch.Tensor,
        sin_cache: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_rot [1, H, D], x + residual [1, hidden]; x itself without a residual), k_rot and v written to the
        caches at slot_mapping[0], as `streamed_attn_in_ref`; the caller has checked `applies`."""
        hidden = qkv_weight.shape[1]
        head_dim = qkv_weight.shape[0] // (num_heads + 2 * num_kv_heads)
        shape = (hidden, num_heads, num_kv_heads, head_dim)
        q_rot = torch.empty(1, num_heads, head_dim, dtype=x.dtype, device=x.device)
        summed = x if residual is None else torch.empty_like(x)
        pdl = pdl_mode(x.device, 1)
        _streamed_attn_in_kernel[(self.num_progs,)](
            self._descriptor_for(qkv_weight),
            x,
            x if residual is None else residual,
            norm_weight,
            summed,
            self._qkv,
            q_rot,
            k_cache,
            v_cache,
            positions,
            slot_mapping,
            cos_cache,
            sin_cache,
            eps,
            cos_cache.stride(0),
            sin_cache.stride(0),
            cos_cache.shape[0],
            k_cache.shape[1],
            *k_cache.stride()[:3],
            *v_cache.stride()[:3],
            **_constexprs(self.config, shape, self.num_progs, pdl, residual is not None),
            num_warps=self.config.warps,
            maxnreg=self.config.registers,
            **pdl_launch_options(pdl),
        )
        return q_rot, summed
