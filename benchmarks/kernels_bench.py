"""Micro-benchmark: Triton kernels vs their torch references on a decode batch and a prefill batch (GPU).

python benchmarks/kernels_bench.py [out.json]      (default benchmarks/results/kernels.json)
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton

from asyncspec.kernels.kv_cache_write import write_kv_cache_ref
from asyncspec.kernels.kv_cache_write_triton import write_kv_cache
from asyncspec.kernels.paged_attention import paged_attention_ref
from asyncspec.kernels.paged_attention_triton import paged_attention
from asyncspec.kernels.slot_mapping import compute_slot_mapping_ref
from asyncspec.kernels.slot_mapping_triton import compute_slot_mapping

BLOCK_SIZE = 16
DEFAULT_OUT = Path(__file__).parent / "results" / "kernels.json"


def time_us(fn: Callable[[], object], iters: int = 20) -> float:
    """Median of CUDA-event timings after warm-up (compilation happens in the warm-up)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return sorted(times)[len(times) // 2]


def make_case(specs: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, gen: torch.Generator):
    """Inputs for (seq_len, q_len) per request; bf16 caches with a shuffled block pool."""
    dev, dt = "cuda", torch.bfloat16
    blocks = [-(-s // BLOCK_SIZE) for s, _ in specs]
    num_blocks = sum(blocks)
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(specs), max(blocks), dtype=torch.int32)
    used, positions = 0, []
    for b, ((s, q), n) in enumerate(zip(specs, blocks, strict=True)):
        block_tables[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
        positions += range(s - q, s)
    qsl = torch.zeros(len(specs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor([q for _, q in specs]), 0)
    t = len(positions)
    return dict(
        query=torch.randn(t, heads, head_dim, device=dev, dtype=dt),
        key=torch.randn(t, kv_heads, head_dim, device=dev, dtype=dt),
        value=torch.randn(t, kv_heads, head_dim, device=dev, dtype=dt),
        k_cache=torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, device=dev, dtype=dt),
        v_cache=torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, device=dev, dtype=dt),
        qsl=qsl.to(dev),
        seq_lens=torch.tensor([s for s, _ in specs], dtype=torch.int32, device=dev),
        block_tables=block_tables.to(dev),
        positions=torch.tensor(positions, dtype=torch.int64, device=dev),
        kv_tokens=sum(s for s, _ in specs),
        num_tokens=t,
    )


def bench_case(name: str, c: dict, head_dim: int) -> list[dict]:
    scale = 1 / math.sqrt(head_dim)
    attn_args = (c["query"], c["k_cache"], c["v_cache"], c["qsl"], c["seq_lens"], c["block_tables"], scale)
    got = paged_attention(*attn_args)
    err = (got.float() - paged_attention_ref(*attn_args).float()).abs().max().item()
    slot_args = (c["block_tables"], c["qsl"], c["positions"], BLOCK_SIZE)
    slots = compute_slot_mapping(*slot_args)
    kv_args = (c["key"], c["value"], c["k_cache"], c["v_cache"], slots)
    kv_bytes = 2 * c["kv_tokens"] * c["k_cache"].shape[2] * head_dim * c["k_cache"].element_size()
    rows = []
    for kernel, tri, ref in [
        ("paged_attention", lambda: paged_attention(*attn_args), lambda: paged_attention_ref(*attn_args)),
        ("slot_mapping", lambda: compute_slot_mapping(*slot_args), lambda: compute_slot_mapping_ref(*slot_args)),
        ("kv_cache_write", lambda: write_kv_cache(*kv_args), lambda: write_kv_cache_ref(*kv_args)),
    ]:
        t_us, r_us = time_us(tri), time_us(ref, iters=5)
        row = dict(
            case=name,
            kernel=kernel,
            num_tokens=c["num_tokens"],
            kv_tokens=c["kv_tokens"],
            triton_us=round(t_us, 1),
            torch_us=round(r_us, 1),
            speedup=round(r_us / t_us, 1),
        )
        if kernel == "paged_attention":
            row.update(max_abs_err=err, kv_read_gb_s=round(kv_bytes / t_us / 1e3, 1))
        rows.append(row)
    return rows


def main() -> None:
    out_path = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT
    gen = torch.Generator().manual_seed(0)
    lens = lambda n, lo, hi: torch.randint(lo, hi + 1, (n,), generator=gen).tolist()  # noqa: E731
    cases = {
        # 64 decoding requests, half verifying k=4 drafts (k+1 = 5 queries), 1-2k tokens of context.
        "decode_64x(1|5)_llama8b": ([(s, 1 + 4 * (i % 2)) for i, s in enumerate(lens(64, 1024, 2048))], 32, 8, 128),
        "decode_64x(1|5)_bundled": ([(s, 1 + 4 * (i % 2)) for i, s in enumerate(lens(64, 256, 1024))], 6, 2, 64),
        # 4 chunks of 512 with prefix hits + 2 full 1k prefills: 4096 query tokens.
        "prefill_4096_llama8b": ([(s, 512) for s in lens(4, 1024, 2048)] + [(1024, 1024)] * 2, 32, 8, 128),
    }
    rows = []
    for name, (specs, h, kvh, d) in cases.items():
        rows += bench_case(name, make_case(specs, h, kvh, d, gen), d)
    header = f"{'case':28} {'kernel':16} {'tokens':>6} {'triton us':>10} {'torch us':>10} {'speedup':>8}  extra"
    print(header)
    print("-" * len(header))
    for r in rows:
        extra = f"err {r['max_abs_err']:.1e}, KV {r['kv_read_gb_s']} GB/s" if "max_abs_err" in r else ""
        print(
            f"{r['case']:28} {r['kernel']:16} {r['num_tokens']:6} {r['triton_us']:10} {r['torch_us']:10} "
            f"{r['speedup']:8}  {extra}"
        )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        block_size=BLOCK_SIZE,
        dtype="bfloat16",
    )
    out_path.write_text(json.dumps(dict(meta=meta, results=rows), indent=2))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
