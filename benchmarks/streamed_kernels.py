"""Streaming rate of the product's streamed kernels against the engine's chain of Triton kernels, alone (Hopper).

On an H100 (2026-12-05) the streamed MLP made the Llama-8B batch-1 step 6.7 % (barrier form) and 13.7 % (split
form) slower, and the 1B's no faster. From the totals, the barrier kernel streams about 9 % slower than the skinny
kernels at the 8B's MLP shape. This times each kernel alone, in a CUDA graph over distinct weights per layer (more
bytes than L2 holds), so the rates can be compared directly:

- the post-attention half layer (residual add + RMSNorm, gate|up with the activation, down): the chain (also with
  the down projection's deep-ring GEMV), the streamed MLP's barrier form, its split form and its split form with a
  whole SM's ring for each kernel (split-deep);
- one-row projections: `skinny_linear` against the streamed GEMV with a whole SM's room, and the down projection
  with the room the split form leaves it beside gate|up.

    python3 benchmarks/streamed_kernels.py --output $OUT/streamed_kernels.json     # GPU, about 1 min
    python3 benchmarks/streamed_kernels.py --deep --output $OUT/deep.json     # the deep ring on every projection
    python3 benchmarks/streamed_kernels.py --models llama-1b --sweep --output $OUT/sweep.json
        # the barrier MLP and the GEMV over ring depths, boxes a slot and warps (2026-12-05: the GEMV's rate is set
        # by the bytes in flight a program, 0.80 of the card's read at 64 KiB, 0.965 at 208 KiB)

Each row: µs a call (median of the graph's replays, per call) and the weight bytes over that time in GB/s,
beside the read bandwidth measured here. Checks each form against the chain first (relative L2 error).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
for path in (str(REPO), str(REPO / "benchmarks")):
    if path not in sys.path:
        sys.path.insert(0, path)

SHAPES = {"llama-1b": (2048, 8192, 16), "llama-8b": (4096, 14336, 8)}  # hidden, intermediate, layers timed
QKV_ROWS = {"llama-1b": (32 + 2 * 8) * 64, "llama-8b": (32 + 2 * 8) * 128}
EPS = 1e-5


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def _rand(gen: torch.Generator, *shape: int, scale: float) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)


def _row(name: str, model: str, us: float, nbytes: int, read_gbps: float, **extra: object) -> dict:
    gbps = nbytes / us / 1e3
    row = {"model": model, "kernel": name, "us": us, "GBps": gbps, "of_read": gbps / read_gbps}
    row.update(extra)
    print(f"{model:9s} {name:34s} {us:9.2f} us {row['GBps']:7.0f} GB/s {row['of_read']:6.3f} of read")
    return row


MLP_SWEEP = [(12, 2, 8), (12, 2, 4), (6, 4, 8), (24, 1, 8), (8, 2, 8)]  # stages, boxes, warps
GEMV_SWEEP = [(8, 1, 4), (16, 1, 4), (24, 1, 4), (8, 2, 4), (12, 2, 8), (16, 2, 8), (24, 1, 8)]


def mlp_rows(model: str, read_gbps: float, gen: torch.Generator, sweep: bool = False) -> list[dict]:
    from skinny_linear import graph_us

    from asyncspec.kernels.fused_add_rms_norm_triton import fused_add_rms_norm
    from asyncspec.kernels.skinny_linear_triton import make_split_counters, skinny_linear, skinny_linear_gated
    from asyncspec.kernels.streamed_gemv import StreamedGemvConfig
    from asyncspec.kernels.streamed_gemv_gluon import StreamedGemv
    from asyncspec.kernels.streamed_mlp import StreamedMLPConfig
    from asyncspec.kernels.streamed_mlp_gluon import StreamedMLP

    hidden, inter, layers = SHAPES[model]
    wgu = [_rand(gen, 2 * inter, hidden, scale=hidden**-0.5) for _ in range(layers)]
    wd = [_rand(gen, hidden, inter, scale=inter**-0.5) for _ in range(layers)]
    nw = [(1.0 + 0.1 * torch.randn(hidden, generator=gen, device="cuda")).to(torch.bfloat16) for _ in range(layers)]
    x0, r0 = _rand(gen, 1, hidden, scale=1.0), _rand(gen, 1, hidden, scale=1.0)
    counters = make_split_counters("cuda")

    def chain(x, r, n, a, b):
        normed, res_out = fused_add_rms_norm(x, r, n, EPS)
        return skinny_linear(skinny_linear_gated(normed, a, counters=counters), b, counters=counters), res_out

    # The engine's default where the down projection's tiles fill the SMs one a program (the 1B's): its deep ring.
    deep_down = StreamedGemv(torch.device("cuda"), StreamedGemvConfig(stages=16, boxes=2, warps=8))

    def chain_deep_down(x, r, n, a, b):
        normed, res_out = fused_add_rms_norm(x, r, n, EPS)
        return deep_down(skinny_linear_gated(normed, a, counters=counters), b), res_out

    forms: dict[str, Callable] = {
        "mlp chain (norm, gate|up, down)": chain,
        "mlp chain, down deep GEMV": chain_deep_down,
    }
    configs = [
        ("barrier", StreamedMLPConfig()),
        ("split", StreamedMLPConfig(grid_barrier=False)),
        ("split-deep", StreamedMLPConfig(stages=16, grid_barrier=False, co_resident=False)),
    ]
    if sweep:
        configs = [(f"barrier {st}x{b} w{w}", StreamedMLPConfig(st, b, w)) for st, b, w in MLP_SWEEP]
    for label, config in configs:
        mlp = StreamedMLP(torch.device("cuda"), {(hidden, inter)}, config)
        forms[f"mlp streamed {label}"] = lambda x, r, n, a, b, mlp=mlp: mlp(x, r, n, EPS, a, b)

    def layer_calls(form: Callable) -> list[Callable]:
        # Each call feeds the next, as layers do: the output is the next x, the sum the next residual.
        state = {"x": x0, "r": r0}

        def call(layer: int) -> None:
            state["x"], state["r"] = form(state["x"], state["r"], nw[layer], wgu[layer], wd[layer])

        def first() -> None:
            state["x"], state["r"] = x0, r0
            call(0)

        return [first] + [lambda layer=layer: call(layer) for layer in range(1, layers)]

    want = chain(x0, r0, nw[0], wgu[0], wd[0])
    nbytes = 3 * hidden * inter * 2
    rows = []
    for name, form in forms.items():
        got = form(x0, r0, nw[0], wgu[0], wd[0])
        err = _rel_err(got[0], want[0])
        rows.append(_row(name, model, graph_us(layer_calls(form)), nbytes, read_gbps, rel_err_vs_chain=err))
    return rows


def gemv_rows(
    model: str, read_gbps: float, gen: torch.Generator, sweep: bool = False, deep: bool = False
) -> list[dict]:
    from skinny_linear import graph_us

    from asyncspec.kernels.skinny_linear_triton import make_split_counters, skinny_linear
    from asyncspec.kernels.streamed_gemv import StreamedGemvConfig
    from asyncspec.kernels.streamed_gemv_gluon import StreamedGemv
    from asyncspec.kernels.streamed_mlp import StreamedMLPConfig, down_stages_for, split_down_room

    hidden, inter, layers = SHAPES[model]
    counters = make_split_counters("cuda")
    split = StreamedMLPConfig(grid_barrier=False)
    split_down = StreamedGemvConfig(down_stages_for(split, hidden, inter), split.boxes, split.warps, split.registers)
    cases = [
        ("o", hidden, hidden, StreamedGemvConfig(), None),
        ("down", hidden, inter, StreamedGemvConfig(), None),
        ("down, split form's room", hidden, inter, split_down, split_down_room(split, hidden, inter)),
    ]
    if sweep:
        cases = [
            (f"{name} {st}x{b} w{w}", n, k, StreamedGemvConfig(st, b, w), None)
            for st, b, w in GEMV_SWEEP
            for name, n, k in (("o", hidden, hidden), ("down", hidden, inter))
        ]
    if deep:
        # The down projection's deep ring on every one-row projection's shape (gate|up without its activation):
        # where else the bytes in flight set the rate.
        deep_ring = StreamedGemvConfig(16, 2, 8)
        shapes = (("qkv", QKV_ROWS[model], hidden), ("o", hidden, hidden), ("gate|up", 2 * inter, hidden))
        cases = [(f"{name} deep", n, k, deep_ring, None) for name, n, k in (*shapes, ("down", hidden, inter))]
    rows = []
    for label, n, k, config, room in cases:
        count = 4 * layers if n * k < 64 << 20 else layers  # distinct weights, more bytes than L2 holds
        weights = [_rand(gen, n, k, scale=k**-0.5) for _ in range(count)]
        x = _rand(gen, 1, k, scale=1.0)
        gemv = StreamedGemv(torch.device("cuda"), config, *(() if room is None else (room,)))
        forms = {
            f"{label} skinny_linear": lambda w, x=x: skinny_linear(x, w, counters=counters),
            f"{label} streamed GEMV": lambda w, x=x, gemv=gemv: gemv(x, w),
        }
        want = skinny_linear(x, weights[0], counters=counters)
        for name, form in forms.items():
            err = _rel_err(form(weights[0]), want)
            us = graph_us([lambda w=w, form=form: form(w) for w in weights])
            rows.append(_row(name, model, us, n * k * 2, read_gbps, rel_err_vs_skinny=err))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama-1b,llama-8b", help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--output", default="")
    parser.add_argument("--sweep", action="store_true", help="the barrier MLP and the GEMV over ring configs")
    parser.add_argument("--deep", action="store_true", help="the GEMV with the deep ring on every projection's shape")
    args = parser.parse_args()
    models = args.models.split(",")
    unknown = [m for m in models if m not in SHAPES]
    if unknown:
        parser.error(f"unknown model shapes {unknown}: use {', '.join(SHAPES)}")
    os.environ.setdefault("ASYNCSPEC_PDL", "1")
    from skinny_linear import reference_bandwidths

    gen = torch.Generator(device="cuda").manual_seed(0)
    result: dict = {"device": torch.cuda.get_device_name(), "read_GBps": reference_bandwidths()["read_GBps"]}
    print(f"{result['device']}, read {result['read_GBps']:.0f} GB/s, PDL {os.environ['ASYNCSPEC_PDL']}")
    rows = []
    for model in models:
        if not args.deep:
            rows += mlp_rows(model, result["read_GBps"], gen, args.sweep)
        rows += gemv_rows(model, result["read_GBps"], gen, args.sweep, args.deep)
        torch.cuda.empty_cache()
    result["rows"] = rows
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
