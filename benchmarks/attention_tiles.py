"""Decode attention time against its tile schedule: the Triton paged attention (`paged_attention`) at decode shapes of
the Llama-1B and 8B layers, timed inside a CUDA graph as the engine runs it (PDL where the engine uses it, the split
count `choose_num_splits` picks), for every (keys per step, warps, pipeline stages) of a grid against the shipped
`_tile_sizes`. Each configuration's output is checked against the shipped one's first.

    python3 benchmarks/attention_tiles.py --output $OUT/attention_tiles.json     # GPU, ~2 min
    # the bundled model's verification at k = 4, also over tile heights and forced split counts:
    python3 benchmarks/attention_tiles.py --shapes bundled --batches 32,128 --contexts 600 --query-lens 1,5 \
        --block-m 16,32 --splits auto,1,2,4

A row's time is the median over 10 replays of a graph of 20 calls, per call (skinny_linear.py's `graph_us`).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from attention_splits import SHAPES, cases, make_inputs  # noqa: E402
from skinny_linear import graph_us  # noqa: E402

import asyncspec.kernels.paged_attention_triton as attn  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--contexts", default="315,1000")
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--stages", default="1,2,3,4")
    ap.add_argument("--shapes", default="llama-1b,llama-8b", help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--query-lens", default="1", help="queries per request: 1 decodes, k + 1 verifies k drafts")
    ap.add_argument("--block-m", default="", help="tile heights (rows) to sweep; empty: the shipped one's")
    ap.add_argument("--splits", default="auto", help="KV split counts to sweep; auto: choose_num_splits's")
    ap.add_argument(
        "--spread", type=float, default=0.0, help="contexts spread over context * [1 - s, 1 + s] (make_inputs)"
    )
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    shipped = attn._tile_sizes
    grid = list(
        itertools.product(
            [int(x) for x in args.block_n.split(",")],
            [int(x) for x in args.warps.split(",")],
            [int(x) for x in args.stages.split(",")],
        )
    )
    rows = []
    print(f"{torch.cuda.get_device_name()}; us per call; shipped = _tile_sizes as committed")
    splits = [None if x == "auto" else int(x) for x in args.splits.split(",")]
    for shape, batch, context, query_len in cases(args):
        heads, kv_heads, head_dim = SHAPES[shape]
        inputs = make_inputs(batch, context, heads, kv_heads, head_dim, gen, query_len, spread=args.spread)
        out = torch.empty_like(inputs["query"])
        base = shipped(batch * query_len, batch, heads // kv_heads, head_dim, 2)
        reference = attn.paged_attention(**inputs).float()
        call = functools.partial(attn.paged_attention, **inputs, out=out)
        times: dict[str, float] = {"shipped": graph_us([call] * 20)}
        heights = [int(x) for x in args.block_m.split(",")] if args.block_m else [base.block_m]
        for block_m, (block_n, warps, stages), split in itertools.product(heights, grid, splits):
            tile = attn.TileConfig(block_m, block_n, warps, stages)
            name = f"{block_m}/{block_n}/{warps}/{stages}/s{'auto' if split is None else split}"
            attn._tile_sizes = lambda *_a, _t=tile: _t  # type: ignore[assignment]
            try:
                got = attn.paged_attention(**inputs, num_splits=split).float()
                if not torch.allclose(got, reference, atol=2e-2, rtol=2e-2):
                    raise AssertionError(f"max err {(got - reference).abs().max().item():.3g}")
                forced = functools.partial(call, num_splits=split)
                times[name] = graph_us([forced] * 20)
            except Exception as exc:  # an unlaunchable config (shared memory) or a wrong one: record it
                times[name] = float("nan")
                print(f"  {name}: {type(exc).__name__}: {str(exc)[:120]}")
            finally:
                attn._tile_sizes = shipped
        valid = {k: v for k, v in times.items() if v == v}
        best = min(valid, key=valid.get)
        rows.append(
            {
                "shape": shape,
                "batch": batch,
                "context": context,
                "query_len": query_len,
                "spread": args.spread,
                "shipped": base._asdict(),
                "us": times,
                "best": best,
            }
        )
        print(
            f"{shape:9} b{batch:<4d}x{query_len} ctx {context:5d}  shipped {base.block_m}/{base.block_n}/"
            f"{base.num_warps}/{base.num_stages} {times['shipped']:7.2f}  "
            f"best {best} {valid[best]:7.2f}  ({valid[best] / times['shipped']:.2f}x)",
            flush=True,
        )
    if args.output:
        args.output.write_text(json.dumps({"card": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
