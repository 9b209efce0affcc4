"""Device time of the captured decode graphs, timed with CUDA events (no profiler: kernels launched with
programmatic dependent launch overlap, so a trace's summed kernel times would overcount), with and
without environment switches, each configuration in its own process, all in one call on one card.

python benchmarks/graph_replay.py --models llama-1b,llama-8b --switches ASYNCSPEC_PDL=0,ASYNCSPEC_PDL=1 \
    --output results.json

Prints one table: per model and switch, the ms of one replay of the (batch, 1) decode graph (forward pass
only; the sampling tail apart), the ratio to the first switch, and the batch-1 time over the roofline
(weight bytes, and with --context the batch-1 KV read, over the read bandwidth measured here).

The graphs replay over their static inputs. As captured those hold one request of one key each, so attention is
timed at a context of one; `--context N` rewrites them first so that every request decodes its N-th token over N - 1
earlier keys in blocks of its own (their K/V are whatever the pool holds: timing only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from gpu_step_speed import model_dir  # noqa: E402

BATCHES = (1, 2, 4, 8, 32)


PATCH_ENV = "GRAPH_REPLAY_PATCH"
"""Benchmark-only patches, separated by commas or colons (a switch of --switches cannot hold a comma), applied in the
child before the engine starts (what a switch cannot reach): `m1_as_m2` gives the skinny kernel's one-row calls its
two-row launch config; `no_gated` runs the MLP's activation as its own kernel after the gate|up projection instead
of in the projection's epilogue; `m1_wide` gives every one-row call the 8 x 512 tiles it took before 2026-11-29;
`skinny_m2` captures the graphs with the skinny kernel taking calls of at most 2 rows (cuBLAS above), as before
2026-11-28; `gated_fma_only` runs a gate|up call whose config takes tensor-core tiles as the plain projection then
the activation kernel, as before 2026-12-03; `rowpar_16` gives the row-parallel shapes at M = 16, 32 the 16 x 256
tensor-core tiles they took before 2026-12-03. Timing only (the outputs are wrong; they bound what fusing a kernel
away could give): `no_combine` launches no split-KV combine kernel, `no_norm` no residual-add + RMSNorm kernel (each
returns its input), `no_rotary` no RoPE + KV-write kernel (q passes through unrotated; with
ASYNCSPEC_ROTARY_IN_LINEAR=0, since the default does that work in the q|k|v projection), `no_attention` no attention
kernels (the output is q), `no_small` the first three together (what fusing every small kernel of a layer away could
give). `l2_prefetch` launches an L2 prefetch of later weights in each layer (benchmarks/l2_prefetch.py, whose
GRAPH_REPLAY_L2_PREFETCH says what and where; the outputs do not change). `gluon_mlp` runs each one-row layer's
post-attention norm and MLP as one warp-specialised Gluon kernel (benchmarks/gluon_layer_mlp.py, configured by
GRAPH_REPLAY_GLUON_MLP, e.g. `s12/d2/w8/pdl1`); `gluon_o` runs one-row o projections as a warp-specialised Gluon
GEMV whose loader streams the weights from its start, before the PDL wait (GRAPH_REPLAY_GLUON_O).
`pdl_early_attention` makes the attention's captured kernels (passes and combine) let their successor launch before
their own PDL wait at every batch size; `attention_wait_first` keeps them waiting first whatever the engine's
ASYNCSPEC_PDL_EARLY_TRIGGER_ROWS (kernels/pdl.py: captured launches of at most that many rows trigger first; the
session-37 `pdl_early_all` patch is that setting at a large row count). The trigger's place cannot change the
numbers: a successor still waits for its predecessor's completion in its own `griddepcontrol.wait`."""


def _apply_patches(patches: set[str]) -> None:
    import dataclasses

    from asyncspec.kernels import skinny_linear_triton
    from asyncspec.worker import model_runner

    if "m1_as_m2" in patches:
        choose = skinny_linear_triton.choose_config
        skinny_linear_triton.choose_config = lambda m, n, k, sms=132: choose(max(m, 2), n, k, sms)  # type: ignore[assignment]
    if "m1_wide" in patches:
        choose1 = skinny_linear_triton.choose_config

        def _m1_wide(m, n, k, sms=132):
            cfg = choose1(m, n, k, sms)
            if m != 1 or cfg.use_dot:
                return cfg
            split = skinny_linear_triton._split_for(-(-n // 8), k, 512, sms)
            return dataclasses.replace(cfg, block_n=8, block_k=512, unroll=2, split_k=split)

        skinny_linear_triton.choose_config = _m1_wide  # type: ignore[assignment]
    if "rowpar_16" in patches:
        choose16 = skinny_linear_triton.choose_config

        def _rowpar_16(m, n, k, sms=132):
            cfg = choose16(m, n, k, sms)
            if cfg.use_dot and (cfg.block_n, cfg.block_k, cfg.num_stages) == (32, 256, 3):
                return dataclasses.replace(cfg, block_n=16, block_k=256, num_stages=4)
            return cfg

        skinny_linear_triton.choose_config = _rowpar_16  # type: ignore[assignment]
    if "gated_fma_only" in patches:
        from asyncspec.kernels.silu_and_mul_triton import silu_and_mul

        gated = skinny_linear_triton.skinny_linear_gated

        def _gated_fma_only(x, weight, bias=None, *, out=None, config=None, counters=None):
            cfg = config or skinny_linear_triton.choose_config(x.shape[0], weight.shape[0], weight.shape[1])
            if not cfg.use_dot:
                return gated(x, weight, bias, out=out, config=config, counters=counters)
            plain = skinny_linear_triton.skinny_linear(x, weight, bias, config=cfg, counters=counters)
            return silu_and_mul(plain, out=out)

        skinny_linear_triton.skinny_linear_gated = _gated_fma_only  # type: ignore[assignment]
    if "no_small" in patches:
        patches = patches | {"no_combine", "no_norm", "no_rotary"}
    if "no_rotary" in patches:
        from asyncspec.kernels import rotary_kv_write_triton

        rotary_kv_write_triton.rotary_kv_write = lambda q, *args, **kwargs: q  # type: ignore[assignment]
    if "no_attention" in patches:
        from asyncspec.kernels import paged_attention_triton

        paged_attention_triton.paged_attention = lambda query, *args, **kwargs: query  # type: ignore[assignment]
    if "no_combine" in patches:
        from asyncspec.kernels import paged_attention_triton

        class _NoLaunch:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: None

            def warmup(self, *args, **kwargs):  # the start-up precompile of the combine's variants
                return None

        paged_attention_triton._combine_splits_kernel = _NoLaunch()  # type: ignore[assignment]
    if "no_norm" in patches:
        from asyncspec.kernels import fused_add_rms_norm_triton

        def _no_norm(x, residual, weight, eps, **kwargs):
            return x, (x if residual is None else residual)

        fused_add_rms_norm_triton.fused_add_rms_norm = _no_norm  # type: ignore[assignment]
    if "l2_prefetch" in patches:
        import l2_prefetch

        l2_prefetch.install(os.environ.get(l2_prefetch.SPEC_ENV, ""))
    if "gluon_mlp" in patches:
        import gluon_layer_mlp

        gluon_layer_mlp.install(os.environ.get(gluon_layer_mlp.SPEC_ENV, ""))
    if "gluon_o" in patches:
        import gluon_layer_mlp

        gluon_layer_mlp.install_o_proj(os.environ.get(gluon_layer_mlp.O_SPEC_ENV, ""))
    if "pdl_early_attention" in patches:
        import torch

        from asyncspec.kernels import paged_attention_triton
        from asyncspec.kernels.pdl import TRIGGER_FIRST

        early = paged_attention_triton.pdl_mode

        def _attention_trigger_first(device, rows):
            mode = early(device, rows)
            return TRIGGER_FIRST if mode and torch.cuda.is_current_stream_capturing() else mode

        paged_attention_triton.pdl_mode = _attention_trigger_first  # type: ignore[assignment]
    if "skinny_m2" in patches:
        make2 = model_runner.make_skinny_linear
        model_runner.make_skinny_linear = lambda device, max_rows=None: make2(device, 2)  # type: ignore[assignment]
    if "no_gated" in patches:
        make = model_runner.make_skinny_linear
        model_runner.make_skinny_linear = lambda device, max_rows=None: dataclasses.replace(  # type: ignore[assignment]
            make(device, max_rows), gated_kernel=None
        )
    if "attention_wait_first" in patches:
        from asyncspec.kernels import paged_attention_triton
        from asyncspec.kernels.pdl import WAIT_FIRST

        mode = paged_attention_triton.pdl_mode
        paged_attention_triton.pdl_mode = lambda device, rows: min(mode(device, rows), WAIT_FIRST)  # type: ignore[assignment]


def _time(fns: list, repeats: int) -> float:
    """Median ms of one call of each of `fns` in turn, over `repeats` batches of 10, with CUDA events."""
    import torch

    for _ in range(5):
        for fn in fns:
            fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            for fn in fns:
                fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 10)
    return statistics.median(times)


def _set_context(runner, context: int, num_reqs: int) -> int:
    """Rewrites the graphs' static inputs so that each of the largest batch's requests decodes position
    `context` - 1 over its own blocks (the first `num_reqs`); returns the KV bytes one request's step reads."""
    import torch

    static, block_size = runner.cuda_graphs.static, runner.cuda_graphs.block_size
    blocks_per_req = -(-context // block_size)
    if blocks_per_req > static.block_tables.shape[1]:
        raise SystemExit(
            f"--context {context} is past the graphs' block tables ({static.block_tables.shape[1]} blocks)"
        )
    num_blocks = runner.kv_caches[0][0].shape[0]
    if num_reqs * blocks_per_req > num_blocks:
        raise SystemExit(f"--context {context} needs {num_reqs * blocks_per_req} KV blocks; the pool has {num_blocks}")
    dev = static.seq_lens.device
    rows = torch.arange(num_reqs, device=dev)
    static.query_start_loc[: num_reqs + 1] = torch.arange(num_reqs + 1, dtype=torch.int32, device=dev)
    static.seq_lens[:num_reqs] = context
    static.block_tables.zero_()
    static.block_tables[:num_reqs, :blocks_per_req] = (
        rows[:, None] * blocks_per_req + torch.arange(blocks_per_req, device=dev)
    ).to(torch.int32)
    pos = context - 1
    static.positions[:num_reqs] = pos
    static.slot_mapping[:num_reqs] = static.block_tables[rows, pos // block_size].long() * block_size + pos % block_size
    torch.cuda.synchronize()
    return sum(k[0, 0].numel() * k.element_size() + v[0, 0].numel() * v.element_size() for k, v in runner.kv_caches) * (
        context
    )


def _one(model: str, repeats: int, context: int = 1, batches: tuple[int, ...] = BATCHES) -> dict:
    """In a child process: capture the model's graphs, time each (batch, 1) replay `repeats` times, alone
    and followed by its greedy tail (the logits and the argmax: a whole greedy decode step's GPU work), at
    `context` keys (1: the inputs as captured)."""
    import torch

    _apply_patches({p for p in os.environ.get(PATCH_ENV, "").replace(":", ",").split(",") if p})
    from asyncspec import LLM

    llm = LLM(
        model_dir(model),
        device="cuda",
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=2048,
        max_num_seqs=max(batches),
        enable_prefix_caching=False,
        gpu_memory_utilization=0.5,
    )
    runner = llm.engine.engine_core.runner
    graphs = runner.cuda_graphs
    # What a decode step reads: every weight, but of an untied embedding only the looked-up rows.
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    if runner.model.lm_head is not None:
        embed = runner.model.model.embed_tokens.weight
        weight_bytes -= embed.numel() * embed.element_size()
    kv_bytes = _set_context(runner, context, max(batches)) if context > 1 else 0
    out: dict = {"weight_bytes": weight_bytes, "kv_bytes_b1": kv_bytes, "context": context, "ms": {}, "step_ms": {}}
    for batch in batches:
        if (batch, 1) not in graphs._graphs:
            raise SystemExit(f"--batches {batch}: no graph of that size; captured {sorted(graphs._graphs)}")
        graph, _ = graphs._graphs[(batch, 1)]
        out["ms"][batch] = _time([graph.replay], repeats)
        if (batch, 1) in graphs._tails:
            tail, _ = graphs._tails[(batch, 1)]
            out["step_ms"][batch] = _time([graph.replay, tail.replay], repeats)
    x = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    bw = []
    for _ in range(8):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.sum(x)
        end.record()
        end.synchronize()
        bw.append(x.numel() * 2 / (start.elapsed_time(end) / 1e3))
    out["read_bytes_per_s"] = statistics.median(bw[2:])
    out["card"] = torch.cuda.get_device_name()
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="llama-1b")
    parser.add_argument("--switches", default="ASYNCSPEC_PDL=0,ASYNCSPEC_PDL=1", help="NAME=VALUE[+NAME=VALUE],...")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=1, help="the switches in turn, this many times")
    parser.add_argument("--context", type=int, default=1, help="keys each request attends to (1: as captured)")
    parser.add_argument(
        "--batches", default=",".join(map(str, BATCHES)), help="captured batch sizes to time, comma-separated"
    )
    parser.add_argument("--output")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.context < 1:
        parser.error("--context must be at least 1")
    try:
        batches = tuple(sorted({int(b) for b in args.batches.split(",")}))
    except ValueError:
        parser.error(f"--batches {args.batches!r}: give batch sizes as integers, comma-separated")
    if batches[0] < 1:
        parser.error("--batches: every batch size must be at least 1")
    if args.one:
        print(json.dumps(_one(args.one, args.repeats, args.context, batches)))
        return 0
    results = []
    for model in args.models.split(","):
        for round_ in range(args.rounds):
            for switch in args.switches.split(","):
                env = dict(os.environ)
                env.update(kv.split("=", 1) for kv in switch.split("+"))
                proc = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--one",
                        model,
                        "--repeats",
                        str(args.repeats),
                        "--context",
                        str(args.context),
                        "--batches",
                        args.batches,
                    ],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if proc.returncode != 0:
                    print(proc.stderr[-3000:], file=sys.stderr)
                    return 1
                row = json.loads(proc.stdout.strip().splitlines()[-1])
                for key in ("ms", "step_ms"):
                    row[key] = {int(b): ms for b, ms in row[key].items()}
                results.append({"model": model, "switch": switch, "round": round_, **row})
    # Forward-pass graph alone per batch, then the whole greedy step (forward + tail) at batch 1, its ratio to
    # the first switch, and over the roofline: the weight bytes a step reads (lm_head included, an untied
    # embedding not) over the bandwidth measured in the same process.
    head = " ".join(f"{'b' + str(b) + ' fwd':>8}" for b in batches)
    first = batches[0]  # the step's columns: the smallest batch timed (1 unless --batches leaves it out)
    print(f"{'model':9} {'switch':52} {head}  {'step b' + str(first):>7}  ratio  b{first}/RL")
    base: dict[str, float] = {}
    for r in results:
        step = r["step_ms"].get(first, float("nan"))
        base.setdefault(r["model"], step)
        roofline_ms = (r["weight_bytes"] + first * r.get("kv_bytes_b1", 0)) / r["read_bytes_per_s"] * 1e3
        cells = " ".join(f"{r['ms'][b]:8.3f}" for b in batches)
        print(
            f"{r['model']:9} {r['switch']:52} {cells}  {step:7.3f}  {step / base[r['model']]:5.3f}  "
            f"{step / roofline_ms:5.2f}"
        )
    if args.output:
        Path(args.output).write_text(json.dumps({"benchmark": "graph_replay", "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
