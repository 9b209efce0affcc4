"""Decode attention time against the number of KV splits: the Triton paged attention (`paged_attention`) at
decode and verification shapes of the Llama-1B, Llama-8B and bundled models' layers, timed inside a CUDA graph as
the engine runs it (PDL on where the engine uses it), for each forced `num_splits` and for the one
`choose_num_splits` picks.

    python3 benchmarks/attention_splits.py --output $OUT/attention_splits.json     # GPU, ~1 min
    python3 benchmarks/attention_splits.py --shapes bundled --batches 32,128 --query-lens 1,5   # k = 4 verification
    # where a 32-stream call's time goes: its fixed cost (the time at few keys), its read rate (the slope over
    # contexts), and the block table's scatter (the pool's blocks in request order against shuffled)
    python3 benchmarks/attention_splits.py --shapes llama-1b --batches 32 --contexts 16,64,315,1000,2000 \
        --splits 1,2,4 --block-order random,sorted

Each case is (model shape, batch of decodes, context per request); a row's time is the median over 10 replays of
a graph of 20 calls, per call (skinny_linear.py's `graph_us`).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from skinny_linear import graph_us  # noqa: E402

from asyncspec.kernels.paged_attention_triton import _num_sms, _tile_sizes, choose_num_splits, paged_attention  # noqa: E402

SHAPES = {"llama-1b": (32, 8, 64), "llama-8b": (32, 8, 128), "bundled": (6, 2, 64)}  # query heads, KV heads, head dim
BLOCK_SIZE = 16
MAX_MODEL_LEN = 2048
BLOCK_ORDERS = ("random", "sorted")


def make_inputs(
    batch: int,
    context: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    gen: torch.Generator,
    query_len: int = 1,
    block_order: str = "random",
    spread: float = 0.0,
) -> dict:
    """A batch of `batch` requests of `query_len` queries each (1: decodes; k + 1: verifying k drafts) at
    `context` tokens. `block_order`: "random" scatters the requests' blocks over the pool (a long-running engine's
    pool), "sorted" gives each request consecutive blocks. `spread` s in [0, 1) spreads the contexts evenly over
    context * [1 - s, 1 + s], in a shuffled order (the benchmark prompts' 32 lie between 0.34 and 1.6 of their mean,
    294 tokens: s = 0.6), so that a split's longest walk is that of the longest request, as in the engine."""
    if block_order not in BLOCK_ORDERS:
        raise ValueError(f"block_order must be one of {BLOCK_ORDERS}, got {block_order!r}")
    if not 0.0 <= spread < 1.0:
        raise ValueError(f"spread must be in [0, 1), got {spread}")
    dev, dt = "cuda", torch.bfloat16
    offsets = torch.zeros(batch)
    if spread > 0 and batch > 1:  # no draw from gen otherwise: equal contexts get the pools of earlier runs
        offsets = torch.linspace(-spread, spread, batch)[torch.randperm(batch, generator=gen)]
    lens = (context * (1 + offsets)).round().clamp(min=query_len).to(torch.int32)
    if int(lens.max()) > MAX_MODEL_LEN:
        raise ValueError(f"the longest context, {int(lens.max())}, is past {MAX_MODEL_LEN} tokens")
    blocks = -(-lens // BLOCK_SIZE)
    num_blocks = int(blocks.sum())
    if block_order == "random":
        perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    else:
        perm = torch.arange(num_blocks, dtype=torch.int32)
    table = torch.zeros(batch, MAX_MODEL_LEN // BLOCK_SIZE, dtype=torch.int32)
    for b, first in enumerate(torch.cumsum(blocks, 0) - blocks):
        table[b, : blocks[b]] = perm[first : first + blocks[b]]
    return dict(
        query=torch.randn(batch * query_len, heads, head_dim, device=dev, dtype=dt),
        k_cache=torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, device=dev, dtype=dt),
        v_cache=torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, device=dev, dtype=dt),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev) * query_len,
        seq_lens=lens.to(dev),
        block_tables=table.to(dev),
        scale=1 / math.sqrt(head_dim),
    )


def cases(args: argparse.Namespace) -> list[tuple[str, int, int, int]]:
    """(shape, batch, context, queries per request) of every case the comma lists `shapes`, `query_lens`,
    `batches` and `contexts` name (shared with attention_tiles.py)."""
    return [
        (shape, batch, context, q)
        for shape in args.shapes.split(",")
        for q in [int(x) for x in args.query_lens.split(",")]
        for batch in [int(x) for x in args.batches.split(",")]
        for context in [int(x) for x in args.contexts.split(",")]
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--contexts", default="315,1000")
    ap.add_argument("--splits", default="1,2,4,8,16")
    ap.add_argument("--shapes", default="llama-1b,llama-8b", help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--query-lens", default="1", help="queries per request: 1 decodes, k + 1 verifies k drafts")
    ap.add_argument("--block-order", default="random", help="random, sorted or both (comma list): the pool's blocks")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    orders = args.block_order.split(",")
    if set(orders) - set(BLOCK_ORDERS):
        ap.error(f"--block-order takes {', '.join(BLOCK_ORDERS)}, got {args.block_order!r}")
    gen = torch.Generator().manual_seed(0)
    sms = _num_sms(torch.device("cuda"))
    rows = []
    print(f"{torch.cuda.get_device_name()}, {sms} SMs; us per call (auto = choose_num_splits)")
    split_list = [int(x) for x in args.splits.split(",")]
    print(
        f"{'shape':9} {'batch':>5} {'ctx':>5} {'order':>6} {'auto':>4} "
        + " ".join(f"{'s=' + str(s):>7}" for s in split_list)
    )
    for (shape, batch, context, query_len), order in itertools.product(cases(args), orders):
        heads, kv_heads, head_dim = SHAPES[shape]
        inputs = make_inputs(batch, context, heads, kv_heads, head_dim, gen, query_len, order)
        out = torch.empty_like(inputs["query"])
        tokens = batch * query_len
        block_m = _tile_sizes(tokens, batch, heads // kv_heads, head_dim, 2).block_m
        auto = choose_num_splits(batch, tokens, kv_heads, block_m // (heads // kv_heads), MAX_MODEL_LEN, sms)
        times = {}
        for s in split_list:
            call = functools.partial(paged_attention, **inputs, out=out, num_splits=s)
            times[s] = graph_us([call] * 20)
        kv_bytes = 2 * batch * context * kv_heads * head_dim * 2
        best = min(times, key=times.get)
        rows.append(
            {
                "shape": shape,
                "batch": batch,
                "context": context,
                "query_len": query_len,
                "block_order": order,
                "auto_splits": auto,
                "us_by_splits": times,
                "best_splits": best,
                "kv_bytes": kv_bytes,
            }
        )
        print(
            f"{shape:9} {batch:5d}x{query_len} {context:5d} {order:>6} {auto:4d} "
            + " ".join(f"{times[s]:7.2f}" for s in split_list)
            + f"   best {best}, KV {kv_bytes / 1e6:.1f} MB at {kv_bytes / times[best] / 1e6:.2f} TB/s",
            flush=True,
        )
    if args.output:
        args.output.write_text(json.dumps({"card": torch.cuda.get_device_name(), "sms": sms, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
