"""Experiment (GPU only): prefetch a layer's next weights into L2 while its latency-bound kernels run.

A batch-1 Llama-1B layer reads 121 MB of weights in about 47 us, 1.6x their read time: DRAM idles through the
residual norms, the attention's split pass and combine, and each projection's ramp. Here one small kernel in the
layer's PDL chain issues L2 prefetches of weights a later kernel of the same layer reads (the o projection, the
first megabytes of gate|up or down), before its own PDL wait, since weights are constant through a step. If the
idle DRAM time fills with those reads, the later projections find part of their W in L2.

`install(spec)` patches `LlamaDecoderLayer.forward` for `benchmarks/graph_replay.py`'s `l2_prefetch` patch.
`spec` (the GRAPH_REPLAY_L2_PREFETCH variable) is key=value pairs separated by ';' (a graph_replay switch
cannot hold a comma or a '+'):
  point    norm1 (after the input norm, before q|k|v), attend (after q|k|v, before attention), norm2 (before
           gate|up)
  targets  o, gu, down joined by '/': the o projection's W whole, the first `mb` MB of gate|up's, of down's
  mb       megabytes of gate|up (or down) to prefetch
  mode     bulk (cp.async.bulk.prefetch.L2, one instruction a chunk) or line (prefetch.global.L2::evict_last,
           one a 128-byte line)
  chunk    bytes a bulk prefetch
  programs the prefetch kernel's grid
  rows     prefetch only in calls of at most this many rows (the decode graphs' batches)
The outputs do not change (a prefetch is a hint), so the engine's results stay checkable.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from asyncspec.kernels.pdl import pdl_enabled, pdl_launch_options, pdl_start

SPEC_ENV = "GRAPH_REPLAY_L2_PREFETCH"


@dataclasses.dataclass(frozen=True)
class PrefetchSpec:
    point: str = "norm1"
    """Where in the layer the prefetch kernel launches."""
    targets: tuple[str, ...] = ("o", "gu")
    """Which weights it prefetches."""
    mb: float = 16.0
    """Megabytes of gate|up and of down (whole o)."""
    mode: str = "bulk"
    """bulk or line prefetch instructions."""
    chunk: int = 16384
    """Bytes a bulk prefetch."""
    programs: int = 64
    """The prefetch kernel's programs."""
    rows: int = 32
    """Largest call (rows) that prefetches."""


def parse(spec: str) -> PrefetchSpec:
    fields: dict = {}
    for item in filter(None, spec.split(";")):
        key, value = item.split("=", 1)
        if key == "targets":
            fields[key] = tuple(value.split("/"))
        elif key in ("point", "mode"):
            fields[key] = value
        elif key == "mb":
            fields[key] = float(value)
        else:
            fields[key] = int(value)
    out = PrefetchSpec(**fields)
    if out.point not in ("norm1", "attend", "norm2") or out.mode not in ("bulk", "line"):
        raise ValueError(f"bad prefetch spec {spec!r}")
    if not set(out.targets) <= {"o", "gu", "down"} or out.chunk % 16:
        raise ValueError(f"bad prefetch spec {spec!r}")
    return out


@triton.jit
def _prefetch_bulk_kernel(
    base0, bytes0, base1, bytes1, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr, USE_PDL: tl.constexpr
):
    # Weights only, so before the PDL wait: the prefetches overlap the predecessor.
    pid = tl.program_id(0)
    idx = (pid * PER_PROGRAM + tl.arange(0, PER_PROGRAM)).to(tl.int64)
    n0 = tl.cdiv(bytes0, CHUNK)
    for region in tl.static_range(2):
        if region == 0:
            off = idx * CHUNK
            addr = tl.cast(base0, tl.int64) + off
            size = tl.minimum(bytes0 - off, CHUNK).to(tl.int32)
        else:
            off = (idx - n0) * CHUNK
            addr = tl.cast(base1, tl.int64) + off
            size = tl.where(idx >= n0, tl.minimum(bytes1 - off, CHUNK), 0).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r",
            [addr, size],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    pdl_start(USE_PDL)


@triton.jit
def _prefetch_line_kernel(base0, bytes0, base1, bytes1, LINES: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    lanes = tl.arange(0, LINES).to(tl.int64)
    total0 = tl.cdiv(bytes0, 128)
    total = total0 + tl.cdiv(bytes1, 128)
    start = pid * LINES
    while start < total:
        line = start + lanes
        in0 = line < total0
        addr = tl.where(in0, tl.cast(base0, tl.int64) + line * 128, tl.cast(base1, tl.int64) + (line - total0) * 128)
        live = (line < total).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
            "=r,l,r",
            [addr, live],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
        start += nprog * LINES
    pdl_start(USE_PDL)


def prefetch(regions: list[tuple[torch.Tensor, int]], spec: PrefetchSpec) -> None:
    """Prefetch the first `nbytes` of each (tensor, nbytes) of at most two regions into L2."""
    assert 1 <= len(regions) <= 2
    (t0, b0), (t1, b1) = regions[0], (regions[1] if len(regions) == 2 else regions[0])
    if len(regions) == 1:
        b1 = 0
    pdl = pdl_enabled(t0.device)
    if spec.mode == "bulk":
        chunks = triton.cdiv(b0, spec.chunk) + triton.cdiv(b1, spec.chunk)
        per_program = triton.next_power_of_2(max(triton.cdiv(chunks, spec.programs), 1))
        grid = (triton.cdiv(chunks, per_program),)
        _prefetch_bulk_kernel[grid](
            t0,
            b0,
            t1,
            b1,
            CHUNK=spec.chunk,
            PER_PROGRAM=per_program,
            USE_PDL=pdl,
            num_warps=max(1, min(4, per_program // 32)),
            **pdl_launch_options(pdl),
        )
    else:
        _prefetch_line_kernel[(spec.programs,)](
            t0, b0, t1, b1, LINES=512, USE_PDL=pdl, num_warps=4, **pdl_launch_options(pdl)
        )


def _regions(layer, spec: PrefetchSpec) -> list[tuple[torch.Tensor, int]]:
    out = []
    for target in spec.targets:
        weight = {
            "o": layer.self_attn.o_proj.weight,
            "gu": layer.mlp.gate_up_proj.weight,
            "down": layer.mlp.down_proj.weight,
        }[target]
        total = weight.numel() * weight.element_size()
        out.append((weight, total if target == "o" else min(total, int(spec.mb * 2**20)) // 16 * 16))
    return out


def install(spec_text: str) -> PrefetchSpec:
    from asyncspec.models import llama

    spec = parse(spec_text)

    def forward(self, h, residual, rope, kv_cache, attn_metadata):
        go = h.shape[0] <= spec.rows and h.is_cuda
        x, residual = self.input_layernorm.forward_residual(h, residual)
        if go and spec.point == "norm1":
            prefetch(_regions(self, spec), spec)
        if go and spec.point == "attend":
            attn = self.self_attn.attn
            attend = attn.attend

            def attend_after_prefetch(*args, **kwargs):
                prefetch(_regions(self, spec), spec)
                return attend(*args, **kwargs)

            attn.attend = attend_after_prefetch
            try:
                x = self.self_attn(x, rope, kv_cache, attn_metadata)
            finally:
                del attn.attend
        else:
            x = self.self_attn(x, rope, kv_cache, attn_metadata)
        x, residual = self.post_attention_layernorm.forward_residual(x, residual)
        if go and spec.point == "norm2":
            prefetch(_regions(self, spec), spec)
        return self.mlp(x), residual

    llama.LlamaDecoderLayer.forward = forward  # type: ignore[method-assign]
    return spec


def _check() -> None:
    """Does a prefetch land in L2? A 24 MiB read after an L2 flush, cold, after each prefetch mode, and warm."""
    import statistics

    w = torch.empty(12 * 2**20, dtype=torch.bfloat16, device="cuda").uniform_()
    flush = torch.empty(2**29, dtype=torch.bfloat16, device="cuda")
    nbytes = w.numel() * 2

    def timed(before) -> float:
        times = []
        for _ in range(12):
            flush.add_(1)
            before()
            torch.cuda._sleep(2_000_000)  # about 1 ms: the prefetches land
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            w.sum()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times[2:])

    rows = {
        "cold": timed(lambda: None),
        "bulk": timed(lambda: prefetch([(w, nbytes)], PrefetchSpec(mode="bulk"))),
        "line": timed(lambda: prefetch([(w, nbytes)], PrefetchSpec(mode="line", programs=132))),
        "warm": timed(lambda: w.sum()),
    }
    for name, us in rows.items():
        print(f"l2_prefetch check: 24 MiB sum after {name:5}: {us:7.1f} us")


if __name__ == "__main__":
    _check()
