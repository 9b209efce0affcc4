"""How deep Triton pipelines a kernel's main loop, read off an sm_90 compile on this host (no GPU needed): for the paged
attention's KV walk (split and single pass) at the decode tile of the given heads, and for `skinny_linear` at the
projections' `choose_config` tiles, the asynchronous copies the prologue asks for before the loop, the copy groups
the loop's first wait leaves in flight (0: each step waits for everything it asked for), and the shared memory a
program holds.

    python3 benchmarks/kernel_pipelining.py                      # the 1B and 8B heads, 2 to 7 stages; M = 1, 16, 32
    python3 benchmarks/kernel_pipelining.py --shapes llama-1b --stages 2,5 --ms 32 --output $OUT/pipelining.json

Compiled with the divisibility a real launch has (pointers, strides, head_dim and block_size multiples of 16):
without it Triton cannot vectorise the loads and makes them synchronous, which is not what a GPU runs. The attention
walk's loads are indirect (block ids, then K and V), and Triton 3.6 spends two stages a level on them: at 2 to 4
stages its wait leaves nothing in flight (docs/benchmarks.md, 2026-12-06).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import triton  # noqa: E402
from attention_splits import SHAPES  # noqa: E402  (query heads, KV heads, head dim)
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import asyncspec.kernels.paged_attention_triton as attn  # noqa: E402
import asyncspec.kernels.skinny_linear_triton as skinny  # noqa: E402

# The projections' (N, K).
PROJECTIONS = {
    "llama-1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)},
    "llama-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
}
TARGET = GPUTarget("cuda", 90, 32)
# Runtime ints that are not multiples of 16 at every launch (or are floats): no divisibility hint.
_ATTENTION_UNHINTED = {"num_reqs", "num_tokens", "bt_stride", "num_splits", "qk_scale", "sliding_window"}
_SKINNY_HINTED = ("N", "K", "stride_xm", "stride_wn", "stride_om", "k_per_split")


def loop_depth(ttgir: str) -> dict[str, int]:
    """The first loop's pipelining in TTGIR: copies asked for before it, the groups its first wait leaves in flight
    (-1: the loop waits on no asynchronous copy)."""
    if "scf.for" not in ttgir:
        return {"prologue_copies": 0, "groups_in_flight": -1}
    prologue, loop = ttgir.split("scf.for", 1)
    waits = re.findall(r"async_wait[^\n]*num = (\d+)", loop)
    return {
        "prologue_copies": prologue.count("async_copy_global_to_local"),
        "groups_in_flight": int(waits[0]) if waits else -1,
    }


def compile_attention(kernel_name: str, shape: str, block_n: int, stages: int, warps: int) -> dict:
    """One attention kernel at the decode tile's rows for `shape`'s heads (bf16), `block_n` keys a step."""
    heads, kv_heads, head_dim = SHAPES[shape]
    group = heads // kv_heads
    fn = getattr(attn, kernel_name)
    block_m = attn._tile_sizes(1, 1, group, head_dim, 2).block_m
    constexprs = {
        "GROUP": group,
        "BLOCK_Q": block_m // group,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
        "DOT_PRECISION": "tf32",
        "EARLY_KV": False,
        "USE_PDL": True,
    }
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list] = {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if name.endswith("_part_ptr"):
            signature[name] = "*fp32"
        elif name in ("qsl_ptr", "seq_lens_ptr", "block_tables_ptr", "counters_ptr"):
            signature[name] = "*i32"
        elif name.endswith("_ptr"):
            signature[name] = "*bf16"
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
        if name not in _ATTENTION_UNHINTED:
            attrs[(i,)] = [["tt.divisibility", 16]]
    values = {(fn.arg_names.index(n),): v for n, v in constexprs.items() if n in fn.arg_names}
    source = ASTSource(fn=fn, signature=signature, constexprs=values, attrs=attrs)
    compiled = triton.compile(source, target=TARGET, options={"num_warps": warps, "num_stages": stages})
    return {**loop_depth(compiled.asm["ttgir"]), "shared_bytes": compiled.metadata.shared}


def compile_skinny(m: int, n: int, k: int) -> dict:
    """`_skinny_linear_kernel` at `choose_config(m, n, k)`'s tile, bf16, no epilogue, PDL on."""
    config = skinny.choose_config(m, n, k)
    fn = skinny._skinny_linear_kernel
    pointers = dict(x_ptr="*bf16", w_ptr="*bf16", bias_ptr="*bf16", out_ptr="*bf16", ws_ptr="*fp32", counter_ptr="*i32")
    signature: dict[str, object] = dict(pointers)
    signature.update(dict.fromkeys(("M", "N", "K", "stride_xm", "stride_wn", "stride_om", "k_per_split"), "i32"))
    rope = fn.arg_names.index("rope")
    signature["rope"] = ("*bf16",) * 6 + ("constexpr",) * 13  # as launched without it: 13 ints equal to 1
    values: dict[tuple[int, ...], object] = {(rope, i): 1 for i in range(6, 19)}
    signature["fold"] = ("*bf16", "*bf16", "*fp32", "i32", "*fp32", "i32", "fp32", "fp32")
    for name in fn.arg_names:
        signature.setdefault(name, "constexpr")
    # As `_skinny_linear_launch` sets them, with the engine's split counters (a split is summed in-kernel: mode 2).
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    split = triton.cdiv(k, k_per_split)
    fma_m = min(triton.next_power_of_2(m), skinny._MAX_FMA_M)
    constexprs = dict(
        BLOCK_M=max(16, triton.next_power_of_2(m)) if config.use_dot else fma_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        SPLIT=2 if split > 1 else 0,
        USE_DOT=config.use_dot,
        HAS_BIAS=False,
        EVEN_K=k % config.block_k == 0,
        SILU=False,
        UNROLL=config.unroll,
        USE_PDL=True,
        PRELOAD=1 if config.use_dot else 2,
        GATED=False,
        ROPE_HALF=0,
        ADD_NORM=False,
        ROW_SCALE=False,
        SCALE_BLOCKS=1,
    )
    values.update({(fn.arg_names.index(n),): v for n, v in constexprs.items() if n in fn.arg_names})
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in (*pointers, *_SKINNY_HINTED)}
    source = ASTSource(fn=fn, signature=signature, constexprs=values, attrs=attrs)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    compiled = triton.compile(source, target=TARGET, options=options)
    tile = f"{'dot' if config.use_dot else 'fma'} {config.block_n}x{config.block_k}/s{config.num_stages}/split{split}"
    return {"tile": tile, **loop_depth(compiled.asm["ttgir"]), "shared_bytes": compiled.metadata.shared}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama-1b,llama-8b", help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--block-n", default="64,128", help="the attention walk's keys a step")
    ap.add_argument("--stages", default="2,3,4,5,7", help="the attention walk's pipeline depths")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--ms", default="1,16,32", help="skinny_linear's rows; empty: no projections")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    rows = []
    print(f"{'kernel':32} {'shape':9} {'tile':22} {'prologue':>8} {'in flight':>9} {'smem KB':>8}")
    for shape in args.shapes.split(","):
        for kernel in ("_paged_attention_split_kernel", "_paged_attention_kernel"):
            for block_n in (int(x) for x in args.block_n.split(",")):
                for stages in (int(x) for x in args.stages.split(",")):
                    row = {"kernel": kernel, "shape": shape, "tile": f"n{block_n}/s{stages}/w{args.warps}"}
                    row |= compile_attention(kernel, shape, block_n, stages, args.warps)
                    rows.append(row)
        for m in (int(x) for x in args.ms.split(",") if x):
            for name, (n, k) in PROJECTIONS.get(shape, {}).items():
                row = {"kernel": f"skinny_linear {name} M={m}", "shape": shape, **compile_skinny(m, n, k)}
                rows.append(row)
    for row in rows:
        print(
            f"{row['kernel']:32} {row['shape']:9} {row['tile']:22} {row['prologue_copies']:8d} "
            f"{row['groups_in_flight']:9d} {row['shared_bytes'] / 1024:8.1f}"
        )
    if args.output:
        args.output.write_text(json.dumps({"target": "sm_90", "triton": triton.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
