"""Micro-benchmark: skinny_linear (Triton) against F.linear (cuBLAS) at decode batch sizes on Llama shapes (GPU).

python3 benchmarks/skinny_linear.py --output out.json            the table (every shape, M = 1..32)
python3 benchmarks/skinny_linear.py --sweep --output sweep.json  times candidate configs per shape (tuning;
    --focus split: split-K factors of the best tiles; --focus fma --ms 1,2: the one- and two-row FMA tiles;
    --layers qkv,o,down and --ms 4,8 narrow it)

Shapes: Llama-3.2-1B and Llama-3.1-8B projections, and the 8B's tensor-parallel shards at TP = 2 and 4 (qkv,
gate_up and the vocab-parallel lm_head split N, o and down split K). Each shape is first checked against the fp32
reference (`skinny_linear_error_bound`, and how many elements differ), for every M. Timing: ~50 back-to-back calls
captured in one CUDA graph, the median replay over CUDA events divided by the calls; weights smaller than a few
L2s rotate through copies so that every call streams its weight from HBM as a decode step does. Reference
bandwidths: a torch sum over a 1 GiB tensor (read only) and a 1 GiB device-to-device copy (read + write).
The repo is not installed on the GPU machine: run `ln -sfn ../kernels asyncspec/kernels` first.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from asyncspec.kernels.silu_and_mul_triton import silu_and_mul  # noqa: E402
from asyncspec.kernels.skinny_linear import skinny_linear_error_bound, skinny_linear_ref  # noqa: E402
from asyncspec.kernels.skinny_linear_triton import (  # noqa: E402
    SkinnyConfig,
    choose_config,
    make_split_counters,
    num_sms,
    skinny_linear,
    skinny_linear_silu,
)

MS = (1, 2, 4, 8, 16, 32)
SWEEP_MS = (1, 2, 4, 8, 16, 32)
CALLS = 50  # per graph
DTYPE = torch.bfloat16
DEVICE = "cuda"
MAX_MISMATCH = 0.02  # fraction of outputs allowed to differ from the reference (one-ulp rounding flips)


@dataclass(frozen=True)
class Shape:
    name: str  # e.g. "8B-tp2 gate_up"
    n: int
    k: int


def llama_shapes(name: str, hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, tp: int = 1):
    """A decoder layer's projections and the lm_head, sharded as Megatron-style tensor parallelism does."""
    tag = name if tp == 1 else f"{name}-tp{tp}"
    return [
        Shape(f"{tag} qkv", (heads + 2 * kv_heads) * head_dim // tp, hidden),
        Shape(f"{tag} o", hidden, heads * head_dim // tp),
        Shape(f"{tag} gate_up", 2 * inter // tp, hidden),
        Shape(f"{tag} down", hidden, inter // tp),
        Shape(f"{tag} lm_head", -(-128256 // tp), hidden),
    ]


SHAPES = [
    *llama_shapes("1B", 2048, 8192, 32, 8, 64),
    *llama_shapes("8B", 4096, 14336, 32, 8, 128),
    *llama_shapes("8B", 4096, 14336, 32, 8, 128, tp=2),
    *llama_shapes("8B", 4096, 14336, 32, 8, 128, tp=4),
]


# ------------------------------------------------------------------------------------------------ timing


def graph_us(calls: list[Callable[[], object]], reps: int = 10) -> float:
    """Median microseconds per call over `reps` replays of one CUDA graph holding all `calls` in order."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(calls))
    del graph
    return statistics.median(times)


def reference_bandwidths() -> dict[str, float]:
    """GB/s of a 1 GiB read (torch sum) and a 1 GiB device-to-device copy (bytes read + written)."""
    big = torch.randn(2**29, device=DEVICE, dtype=DTYPE)  # 1 GiB
    dst = torch.empty_like(big)
    nbytes = big.numel() * big.element_size()
    read_us = graph_us([lambda: big.sum()] * 5, reps=10)
    copy_us = graph_us([lambda: dst.copy_(big)] * 5, reps=10)
    return {"read_GBps": nbytes / read_us / 1e3, "copy_GBps": 2 * nbytes / copy_us / 1e3}


def weight_copies(shape: Shape, calls: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Enough copies of a [N, K] weight that `calls` rotating reads overflow L2 three times over."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    nbytes = shape.n * shape.k * DTYPE.itemsize
    count = min(calls, math.ceil(3 * l2 / nbytes))
    base = (torch.randn(shape.n, shape.k, generator=gen, device=DEVICE) * 0.05).to(DTYPE)
    return [base] + [base.clone() for _ in range(count - 1)]


def rotating(fn: Callable[..., object], x: torch.Tensor, weights: list[torch.Tensor], calls: int, **kwargs):
    """`calls` closures fn(x, weight, **kwargs) over the weight copies in turn."""
    return [functools.partial(fn, x, weights[i % len(weights)], **kwargs) for i in range(calls)]


def silu_then_linear(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The unfused down_proj: the activation kernel, then cuBLAS."""
    return F.linear(silu_and_mul(x2), weight)


# ------------------------------------------------------------------------------------------- correctness


def check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, gated: bool = False) -> dict[str, float]:
    """Errors of `got` against the fp32 reference; raises if any element breaks the bound or too many differ."""
    if gated:
        from asyncspec.kernels.silu_and_mul import silu_and_mul_ref

        x = silu_and_mul_ref(x)
    ref = skinny_linear_ref(x, w)
    err = (got.float() - ref.float()).abs()
    bound = skinny_linear_error_bound(x, w)
    mismatch = (got != ref).float().mean().item()
    worst = (err / bound).max().item()
    if not (worst <= 1.0 and mismatch <= MAX_MISMATCH) or got.isnan().any():
        raise AssertionError(f"wrong result: error / bound {worst:.3g}, {mismatch:.2%} of outputs differ")
    return {"max_err_over_bound": worst, "mismatch_fraction": mismatch}


# ------------------------------------------------------------------------------------------------ table


def bench_shape(shape: Shape, x: torch.Tensor, gen: torch.Generator) -> list[dict]:
    weights = weight_copies(shape, CALLS, gen)
    nbytes = shape.n * shape.k * DTYPE.itemsize
    rows = []
    gated = shape.name.endswith(" down")
    x2 = torch.randn(x.shape[0], 2 * shape.k, generator=gen, device=DEVICE).to(DTYPE) if gated else None
    xs = x[:, : shape.k].contiguous()
    counters = make_split_counters(x.device)  # as the engine's layers pass them
    for m in MS:
        xm = xs[:m]
        row: dict = {"shape": shape.name, "n": shape.n, "k": shape.k, "m": m}
        row["config"] = asdict(choose_config(m, shape.n, shape.k, num_sms(x.device)))
        row["check"] = check(skinny_linear(xm, weights[0]), xm, weights[0])
        row["cublas_us"] = graph_us(rotating(F.linear, xm, weights, CALLS))
        row["triton_us"] = graph_us(rotating(skinny_linear, xm, weights, CALLS, counters=counters))
        moved = nbytes + 2 * m * (shape.k + shape.n) * DTYPE.itemsize
        row["cublas_GBps"] = moved / row["cublas_us"] / 1e3
        row["triton_GBps"] = moved / row["triton_us"] / 1e3
        row["speedup"] = row["cublas_us"] / row["triton_us"]
        if x2 is not None:  # the MLP's down_proj: activation kernel + GEMM against the fused kernel
            x2m = x2[:m]
            row["silu_check"] = check(skinny_linear_silu(x2m, weights[0]), x2m, weights[0], gated=True)
            row["silu_cublas_us"] = graph_us(rotating(silu_then_linear, x2m, weights, CALLS))
            row["silu_triton_us"] = graph_us(rotating(skinny_linear_silu, x2m, weights, CALLS, counters=counters))
            check(skinny_linear_silu(x2m, weights[0], fused=True), x2m, weights[0], gated=True)
            row["silu_fused_us"] = graph_us(
                rotating(skinny_linear_silu, x2m, weights, CALLS, fused=True, counters=counters)
            )
        rows.append(row)
        print(
            f"{shape.name:<18} {shape.n:>6}x{shape.k:<6} M={m:<3} cuBLAS {row['cublas_us']:8.2f} us "
            f"{row['cublas_GBps']:6.0f} GB/s | triton {row['triton_us']:8.2f} us {row['triton_GBps']:6.0f} GB/s "
            f"| x{row['speedup']:.2f}"
            + (
                f" | +silu: {row['silu_cublas_us']:.2f} vs {row['silu_triton_us']:.2f} us"
                f" (fused {row['silu_fused_us']:.2f})"
                if "silu_triton_us" in row
                else ""
            ),
            flush=True,
        )
    return rows


# ------------------------------------------------------------------------------------------------ sweep


def candidates(m: int, n: int, k: int, sms: int, focus: str = "tiles") -> list[SkinnyConfig]:
    """Configs worth timing for one (M, N, K).

    focus "fma" (M = 1, 2): FMA tiles from 2 x 1024 to 16 x 256, 4 or 8 warps, each with every power-of-two split of
    K up to 8 (the sweep behind the 4 x 1024 one-row tiles, on an H200).
    focus "tiles": FMA tiles (M <= 8) whose per-thread accumulators (BLOCK_M rows times the W tile's share of a
    thread) stay at 32..64 fp32 registers, unrolled once or twice, and tensor-core tiles; each with no split and
    with the smallest split of K that gives two waves of programs. focus "split": the few good tiles of a
    "tiles" sweep, each with every power-of-two split of K up to 8. focus "deep" (M > 4): tensor-core tiles with
    deeper pipelines, 96-192 KiB of shared memory a program (the bytes a program keeps in flight set a streamed
    GEMV's rate: 0.80 of the card's read at 64 KiB, 0.965 at 208 KiB on an H100, 2026-12-05), each with no split,
    the default's split and twice it.
    """
    tiles: list[tuple[int, int, int, int, bool, int]] = []  # block_n, block_k, warps, stages, dot, unroll
    if focus == "fma":
        # bn, bk, unroll, warps: narrow-and-deep to wide-and-shallow FMA tiles, 4 or 8 warps (M = 1, 2 only)
        fma = {
            1: [(8, 512, 2, 4), (8, 256, 2, 4), (4, 512, 2, 4), (4, 256, 2, 4), (16, 256, 1, 4), (16, 512, 1, 8)]
            + [(8, 512, 2, 8), (8, 1024, 1, 8), (4, 1024, 1, 4), (2, 1024, 1, 4)],
            2: [(4, 512, 1, 4), (4, 256, 2, 4), (8, 256, 1, 4), (4, 512, 2, 4), (8, 512, 1, 8), (4, 1024, 1, 8)]
            + [(2, 1024, 1, 4)],
        }.get(m, [])
        return [
            SkinnyConfig(bn, bk, split, warps, 1, False, unroll)
            for bn, bk, unroll, warps in fma
            for split in (1, 2, 4, 8)
            if split == 1 or k >= 2 * split * bk
        ]
    if focus == "deep":
        default_split = choose_config(m, n, k, sms).split_k
        deep = [(64, 128, 6), (64, 128, 8), (32, 256, 5), (32, 256, 6), (64, 256, 4), (32, 128, 8), (64, 64, 12)]
        deep += [(128, 128, 4), (16, 256, 8)]
        return [
            SkinnyConfig(bn, bk, split, 4, stages, True, 1)
            for bn, bk, stages in deep
            for split in sorted({1, default_split, 2 * default_split})
            if split == 1 or k >= 2 * split * bk
        ]
    if focus == "split":
        if m <= 4:
            tiles += [(8, 256, 4, 1, False, 2), (4, 512, 4, 1, False, 1), (4, 512, 4, 1, False, 2)]
        tiles += [(bn, bk, 4, st, True, 1) for bn, bk, st in [(64, 256, 3), (64, 128, 4), (32, 256, 3), (32, 128, 4)]]
        tiles += [(16, 256, 4, 4, True, 1)]
        return [
            SkinnyConfig(bn, bk, split, warps, stages, dot, unroll)
            for bn, bk, warps, stages, dot, unroll in tiles
            for split in (1, 2, 4, 8)
            if split == 1 or k >= 2 * split * bk
        ]
    if m <= 8:
        block_m = 1 << (m - 1).bit_length()
        for bn in (4, 8, 16, 32):
            for bk in (128, 256, 512):
                per_thread = bn * bk // 128
                if per_thread >= 8 and 32 <= block_m * per_thread <= 64:
                    tiles += [(bn, bk, 4, 1, False, 1), (bn, bk, 4, 1, False, 2)]
    dot_tiles = [(16, 256, 4), (32, 128, 4), (32, 256, 3), (64, 128, 4), (64, 256, 3), (128, 128, 3), (64, 64, 6)]
    tiles += [(bn, bk, 4, stages, True, 1) for bn, bk, stages in dot_tiles]
    configs = []
    for bn, bk, warps, stages, dot, unroll in tiles:
        columns = -(-n // bn)
        split = 1
        while columns * split < 2 * sms and split < 16 and k >= 4 * split * bk:
            split *= 2
        configs += [SkinnyConfig(bn, bk, s, warps, stages, dot, unroll) for s in sorted({1, split})]
    return configs


def sweep_shape(
    shape: Shape, x: torch.Tensor, gen: torch.Generator, deadline: float, ms: tuple[int, ...], focus: str
) -> list[dict]:
    calls = 20
    weights = weight_copies(shape, max(calls, 60), gen)
    calls = max(calls, len(weights))
    out = []
    xs = x[:, : shape.k].contiguous()
    counters = make_split_counters(x.device)
    for m in ms:
        if time.monotonic() > deadline:
            break
        xm = xs[:m]
        sms = num_sms(x.device)
        entry: dict = {"shape": shape.name, "n": shape.n, "k": shape.k, "m": m}
        entry["cublas_us"] = graph_us(rotating(F.linear, xm, weights, calls), reps=5)
        default = choose_config(m, shape.n, shape.k, sms)
        results: list[dict] = []
        for cfg in [default, *candidates(m, shape.n, shape.k, sms, focus)]:
            try:
                check(skinny_linear(xm, weights[0], config=cfg), xm, weights[0])
                us = graph_us(rotating(skinny_linear, xm, weights, calls, config=cfg, counters=counters), reps=5)
            except Exception as exc:  # a config that fails to compile or is wrong is reported, not fatal
                results.append({"config": asdict(cfg), "error": repr(exc)[:200]})
                continue
            results.append({"config": asdict(cfg), "us": us})
        timed = [r for r in results if "us" in r]
        entry["default"] = results[0]
        entry["best"] = min(timed, key=lambda r: r["us"]) if timed else None
        entry["results"] = results
        out.append(entry)
        best = entry["best"]
        print(
            f"{shape.name:<18} M={m:<3} cuBLAS {entry['cublas_us']:8.2f} us | default "
            f"{results[0].get('us', float('nan')):8.2f} | best {best['us'] if best else float('nan'):8.2f} "
            f"{best['config'] if best else ''}",
            flush=True,
        )
    return out


# ------------------------------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--sweep", action="store_true", help="time candidate configs instead of the table")
    parser.add_argument("--budget-s", type=float, default=1e9, help="stop starting new shapes after this long")
    parser.add_argument("--layers", default="", help="comma-separated layers to keep (qkv, o, gate_up, ...)")
    parser.add_argument("--ms", default="", help="comma-separated M values for the sweep (default: 1,2,4,8,16,32)")
    parser.add_argument("--focus", default="tiles", choices=["tiles", "split", "fma", "deep"], help="sweep candidates")
    parser.add_argument("--models", default="", help="comma-separated shape families to keep (1B, 8B, 8B-tp2, ...)")
    args = parser.parse_args()
    start = time.monotonic()
    deadline = start + args.budget_s
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    import triton

    report: dict = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "l2_bytes": props.L2_cache_size,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(DTYPE),
        "calls_per_graph": CALLS,
    }
    report.update(reference_bandwidths())
    torch.cuda.empty_cache()
    print(f"{props.name}: read {report['read_GBps']:.0f} GB/s, copy {report['copy_GBps']:.0f} GB/s", flush=True)
    layers = {layer for layer in args.layers.split(",") if layer}
    models = {model for model in args.models.split(",") if model}
    unknown = models - {s.name.split()[0] for s in SHAPES}
    if unknown:
        parser.error(f"unknown --models {sorted(unknown)}: use {sorted({s.name.split()[0] for s in SHAPES})}")
    shapes = [s for s in SHAPES if not layers or s.name.split()[-1] in layers]
    shapes = [s for s in shapes if not models or s.name.split()[0] in models]
    ms = tuple(int(m) for m in args.ms.split(",")) if args.ms else SWEEP_MS
    if args.sweep:  # the small TP shards first: the budget may stop the sweep before the end
        shapes.sort(key=lambda s: ("-tp4" not in s.name, "-tp2" in s.name))
    x = (torch.randn(max(MS), max(s.k for s in SHAPES), generator=gen, device=DEVICE)).to(DTYPE)
    rows: list[dict] = []
    failed = []
    for shape in shapes:
        if time.monotonic() > deadline:
            report["stopped_early"] = True
            break
        try:
            if args.sweep:
                rows += sweep_shape(shape, x, gen, deadline, ms, args.focus)
            else:
                rows += bench_shape(shape, x, gen)
        except AssertionError as exc:
            failed.append(f"{shape.name}: {exc}")
            print(f"FAILED {shape.name}: {exc}", flush=True)
        torch.cuda.empty_cache()
        report["rows"], report["failed"] = rows, failed
        report["elapsed_s"] = time.monotonic() - start
        args.output.write_text(json.dumps(report, indent=1))
    report["rows"], report["failed"] = rows, failed
    args.output.write_text(json.dumps(report, indent=1))
    if not args.sweep:
        print_summary(rows)
    return 1 if failed else 0


def print_summary(rows: list[dict]) -> None:
    """Where Triton wins, per M: the count of shapes and the geometric-mean speedup."""
    for m in MS:
        sel = [r["speedup"] for r in rows if r["m"] == m]
        if sel:
            geo = math.exp(sum(math.log(s) for s in sel) / len(sel))
            wins = sum(s > 1.0 for s in sel)
            print(f"M={m:<3} triton faster on {wins}/{len(sel)} shapes, geomean speedup x{geo:.3f}")


if __name__ == "__main__":
    sys.exit(main())
