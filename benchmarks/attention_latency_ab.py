"""A/B of the decode attention's latency hiding (`ASYNCSPEC_ATTN_HIDE_LATENCY`): the owner request found by one
wide load instead of a binary search, and the block table read a key step ahead. The kernel alone in a CUDA graph
of 20 calls (PDL as the engine runs it), both settings alternated in one process, outputs compared bit for bit.

    python3 benchmarks/attention_latency_ab.py --output $OUT/attention_latency_ab.json     # GPU, ~1 min
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from attention_splits import SHAPES, cases, make_inputs  # noqa: E402
from skinny_linear import graph_us  # noqa: E402

from asyncspec.kernels.paged_attention_triton import HIDE_LATENCY_ENV, paged_attention  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama-1b,llama-8b")
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--contexts", default="315,1000")
    ap.add_argument("--query-lens", default="1")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"{torch.cuda.get_device_name()}; us per call, {HIDE_LATENCY_ENV}=0 / =1 by round")
    for shape, batch, context, query_len in cases(args):
        heads, kv_heads, head_dim = SHAPES[shape]
        inputs = make_inputs(batch, context, heads, kv_heads, head_dim, gen, query_len)
        outs = {}
        for value in ("0", "1"):
            os.environ[HIDE_LATENCY_ENV] = value
            outs[value] = paged_attention(**inputs)
        torch.cuda.synchronize()
        equal = torch.equal(outs["0"], outs["1"])
        times: dict[str, list[float]] = {"0": [], "1": []}
        out = torch.empty_like(inputs["query"])
        for _ in range(args.rounds):
            for value in ("0", "1"):
                os.environ[HIDE_LATENCY_ENV] = value
                times[value].append(graph_us([functools.partial(paged_attention, **inputs, out=out)] * 20))
        kv_bytes = 2 * batch * context * kv_heads * head_dim * 2
        best = {v: min(t) for v, t in times.items()}
        rows.append(
            {
                "shape": shape,
                "batch": batch,
                "context": context,
                "query_len": query_len,
                "us": times,
                "equal": equal,
                "kv_bytes": kv_bytes,
            }
        )
        print(
            f"{shape:9} {batch:4d}x{query_len} {context:5d}  off "
            + " ".join(f"{t:6.2f}" for t in times["0"])
            + "  on "
            + " ".join(f"{t:6.2f}" for t in times["1"])
            + f"  on/off {best['1'] / best['0']:.3f}  KV {kv_bytes / 1e6:5.1f} MB"
            + f" at {kv_bytes / best['1'] / 1e3:.0f} GB/s  {'equal' if equal else 'DIFFERENT'}",
            flush=True,
        )
    os.environ.pop(HIDE_LATENCY_ENV, None)
    if args.output:
        args.output.write_text(json.dumps({"card": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
