"""Tensor parallelism on one host: batch-1 TPOT and 32/128-stream throughput at tensor_parallel_size
1, 2 (and 4 where the host has four GPUs), the Llama-8B shape with random weights, in one call on one
host. Each size runs in a fresh process; the same call measures the read bandwidth of one GPU and the
all-reduce of one decode step's hidden state alone (NCCL, CUDA graph), so that each TPOT is reported
against its roofline: the weights one GPU reads per step over the bandwidth, plus the step's
all-reduces.

    python3 benchmarks/tensor_parallel.py --sizes 1,2 --output $OUT/tensor_parallel.json
    python3 benchmarks/tensor_parallel.py --smoke     # CPU, gloo, tiny shape: checks the script only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_step_speed import LLAMA_8B, TINY_DUMMY, _import_asyncspec, load_prompts, read_params, shape_of  # noqa: E402

SCHEMA = "asyncspec.tensor_parallel/1"


def _model_dir(cfg: dict[str, Any]) -> str:
    path = tempfile.mkdtemp(prefix="tp-bench-")
    (Path(path) / "config.json").write_text(json.dumps(cfg))
    return path


def _median_time(fn: Any, trials: int) -> float:
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_size(size: int, s: dict[str, Any]) -> dict[str, Any]:
    """One tensor_parallel_size: start-up, batch-1 TPOT by subtraction, throughput per concurrency."""
    asyncspec = _import_asyncspec()
    cfg = TINY_DUMMY if s["smoke"] else LLAMA_8B
    kwargs: dict[str, Any] = dict(
        device="cpu" if s["smoke"] else "cuda",
        dtype="float32" if s["smoke"] else "bfloat16",
        load_format="dummy",
        tensor_parallel_size=size,
        async_scheduling=s["async_scheduling"],
        max_model_len=2048,
        max_num_seqs=max(s["concurrency"]),
        max_num_batched_tokens=max(2048, max(s["concurrency"])),
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
        gpu_memory_utilization=s["gpu_memory_utilization"],
    )
    if s["smoke"]:
        kwargs["num_kv_blocks"] = 256
    t0 = time.perf_counter()
    llm = asyncspec.LLM(_model_dir(cfg), **kwargs)
    row: dict[str, Any] = {"size": size, "engine_kwargs": kwargs, "startup_s": time.perf_counter() - t0}
    from asyncspec.worker.symm_all_reduce import all_reduce_mode

    row["all_reduce_mode"] = all_reduce_mode()  # what the ranks were asked for (they inherit this environment)
    n = s["new_tokens"]
    full = asyncspec.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    one = asyncspec.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompts = load_prompts(max(s["concurrency"]))
    llm.generate([prompts[0]], full)
    t_full = _median_time(lambda: llm.generate([prompts[0]], full), s["trials"])
    t_one = _median_time(lambda: llm.generate([prompts[0]], one), s["trials"])
    row["tpot_ms"] = (t_full - t_one) / (n - 1) * 1e3
    row["throughput"] = {}
    for c in s["concurrency"]:
        if c == 1:
            continue
        batch = prompts[:c]
        llm.generate(batch, full)  # warm: this batch's shapes
        outs: list[Any] = []

        def timed(b: list[list[int]] = batch, outs: list[Any] = outs) -> None:
            outs[:] = llm.generate(b, full)

        t = _median_time(timed, s["trials"])
        row["throughput"][str(c)] = {"streams": c, "e2e_tok_s": sum(len(o.token_ids) for o in outs) / t}
    row["stats"] = {k: v for k, v in llm.stats().items() if k.startswith(("cuda_graph", "num_steps"))}
    if s.get("profile_dir"):
        row["profile"] = profile_batch1(llm, prompts[0], s, size)
    llm.shutdown()
    return row


# Kernel name fragments -> what the time went to (first match wins; names lower-cased).
KERNEL_CATEGORIES = [
    ("all-reduce / all-gather (NCCL)", ("nccl",)),
    ("all-reduce (symmetric memory)", ("one_shot", "two_shot", "symm", "push_all_reduce")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "splitk", "sm90_", "cublas")),
    ("attention", ("paged_attention", "combine_splits")),
    ("residual add + RMSNorm", ("rms_norm",)),
    ("RoPE + KV write", ("rotary", "kv_cache_write")),
    ("SiLU-and-mul", ("silu",)),
    (
        "step inputs and sampling",
        ("prepare_inputs", "resolve_computed", "slot_mapping", "rejection", "argmax", "maxops"),
    ),
    ("copies and fills", ("memcpy", "memset")),
]


def categorize(name: str) -> str:
    lower = name.lower()
    for category, fragments in KERNEL_CATEGORIES:
        if any(f in lower for f in fragments):
            return category
    return "other"


def profile_batch1(llm: Any, prompt: list[int], s: dict[str, Any], size: int) -> dict[str, Any]:
    """Decode steps of one request under torch.profiler (the prefill and the first decode run
    before it starts): each rank's device time per decode step, by kind of kernel, and the
    device's idle share of the window."""
    asyncspec = _import_asyncspec()
    engine = llm.engine
    params = asyncspec.SamplingParams(temperature=0.0, max_tokens=s["profile_tokens"] + 2, ignore_eos=True)
    engine.add_request(engine.make_request(prompt, params, f"profile-{size}"), stream_deltas=False)
    for _ in range(2):
        engine.step()
    steps_before = llm.stats()["num_steps"]
    path = Path(s["profile_dir"]) / f"tp{size}-{os.environ.get('ASYNCSPEC_TP_ALL_REDUCE', 'nccl')}"
    llm.start_profile(path, with_cpu=False)  # the host at its own pace
    while engine.has_unfinished_requests():
        engine.step()
    summaries = llm.stop_profile()
    n = max(1, int(llm.stats()["num_steps"] - steps_before))
    ranks = []
    for summary in summaries:
        per_step: dict[str, float] = {}
        for k in summary.top_kernels:
            per_step[categorize(k.name)] = per_step.get(categorize(k.name), 0.0) + k.total_seconds * 1e3 / n
        ranks.append(
            {
                "process": summary.process,
                "trace": summary.trace_path,
                "steps": n,
                "device_busy_ms_per_step": summary.device_busy_seconds * 1e3 / n,
                "device_span_ms_per_step": summary.device_span_seconds * 1e3 / n,
                "ms_per_step_by_kind": dict(sorted(per_step.items(), key=lambda kv: -kv[1])),
                "idle_gaps": [
                    {"before": g.before, "after": g.after, "count": g.count, "ms_per_step": g.total_seconds * 1e3 / n}
                    for g in summary.idle_gaps[:10]
                ],
                "top_kernels": [
                    {"name": k.name[:120], "count": k.count, "ms_per_step": k.total_seconds * 1e3 / n}
                    for k in summary.top_kernels[:15]
                ],
            }
        )
    return {"ranks": ranks}


def bench_bandwidth(s: dict[str, Any]) -> dict[str, Any]:
    import torch

    x = torch.empty(s["bandwidth_bytes"] // 2, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    times = []
    for i in range(8):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.sum(x)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    gb_s = x.numel() * 2 / (statistics.median(times) / 1e3) / 1e9
    return {"GB_s": gb_s, "card": torch.cuda.get_device_name()}


def _allreduce_rank(rank: int, size: int, hidden: int, init: str, out: Any) -> None:
    """One rank of the all-reduce measurement: NCCL, torch's symmetric-memory one-shot and the push
    kernel, each as 200 all-reduces of a [1, hidden] bf16 tensor captured in a CUDA graph."""
    try:
        import torch
        import torch.distributed as dist

        _import_asyncspec()
        from asyncspec.layers.tensor_parallel import TensorParallel as tp
        from asyncspec.worker.symm_all_reduce import make_small_all_reduce

        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=size)
        group = dist.group.WORLD
        paths: dict[str, Any] = {"nccl": tp(rank, size, group)}
        for mode in ("symm_mem", "push"):  # this process measures every path
            os.environ["ASYNCSPEC_TP_ALL_REDUCE"] = mode
            small = make_small_all_reduce(group, torch.device("cuda", rank), torch.bfloat16)
            paths[mode] = tp(rank, size, group, small) if small else None
        result: dict[str, Any] = {}
        for name, par in paths.items():
            if par is None:
                result[name] = None
                continue
            x = torch.ones(1, hidden, dtype=torch.bfloat16, device="cuda")
            reps = 200
            for _ in range(3):
                par.all_reduce(x.clone())
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = x
                for _ in range(reps):
                    y = par.all_reduce(y.clone())
            graph.replay()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                graph.replay()
            end.record()
            end.synchronize()
            result[name] = start.elapsed_time(end) / (5 * reps) * 1e3
        if rank == 0:
            out.put(result)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # reported, not hung on
        out.put({"error": f"rank {rank}: {type(e).__name__}: {e}"})


def bench_allreduce(size: int, hidden: int) -> dict[str, Any]:
    """Microseconds of one all-reduce of a [1, hidden] bf16 tensor (the batch-1 decode step's) inside
    a CUDA graph, with nothing else running, through NCCL, torch's symmetric-memory one-shot and the push
    kernel. (Each graph node also holds the clone that feeds it: a copy kernel of 8 KiB, a microsecond or
    two.)"""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = f"file://{tempfile.mkdtemp(prefix='tp-ar-')}/store"
    procs = [ctx.Process(target=_allreduce_rank, args=(r, size, hidden, init, queue), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    result: dict[str, Any] = queue.get(timeout=150)
    for p in procs:
        p.join(20)
        if p.is_alive():
            p.kill()
    return {"size": size, **result}


def parse_env_variants(specs: list[str]) -> list[tuple[str, dict[str, str]]]:
    """["nomix:NCCL_GRAPH_MIXING_SUPPORT=0,NCCL_PROTO=LL"] -> [("nomix", {...})]; SystemExit on a
    malformed one."""
    variants = []
    for spec in specs:
        name, _, assignments = spec.partition(":")
        env = dict(a.split("=", 1) for a in assignments.split(",") if "=" in a)
        if not name or not env or len(env) != len(assignments.split(",")):
            raise SystemExit(f"--env-variant {spec!r}: expected NAME:KEY=VALUE[,KEY=VALUE]")
        variants.append((name, env))
    return variants


def run_child(kind: str, arg: int, s: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", kind, "--child-arg", str(arg), "--settings", json.dumps(s)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr or proc.stdout)[-3000:]}
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result


def derive(results: dict[str, Any], s: dict[str, Any]) -> None:
    """Roofline per size: weights per GPU over the bandwidth, plus one step's all-reduces."""
    cfg = TINY_DUMMY if s["smoke"] else LLAMA_8B
    shape = shape_of(cfg)
    weight_bytes = read_params(shape) * (4 if s["smoke"] else 2)
    gb_s = results.get("bandwidth", {}).get("GB_s")
    allreduces_per_step = 2 * shape["num_hidden_layers"] + 1  # o_proj, down_proj per layer; the embedding
    base = results["sizes"].get("1", {}).get("tpot_ms")
    for key, row in results["sizes"].items():
        if "error" in row:
            continue
        size = int(key.split("-")[0])
        measured = results.get("allreduce", {}).get(str(size), {})
        ar = measured.get(row.get("all_reduce_mode", "nccl")) or measured.get("nccl") or 0.0
        ar = ar if size > 1 else 0.0
        if gb_s:
            weights_ms = weight_bytes / size / (gb_s * 1e9) * 1e3
            row["roofline_ms"] = weights_ms + allreduces_per_step * ar / 1e3
            row["weights_roofline_ms"] = weights_ms
            row["allreduce_ms_per_step"] = allreduces_per_step * ar / 1e3
            row["tpot_over_roofline"] = row["tpot_ms"] / row["roofline_ms"]
        if base:
            row["tpot_vs_tp1"] = row["tpot_ms"] / base


def print_table(results: dict[str, Any]) -> None:
    print(
        f"card: {results.get('bandwidth', {}).get('card', '?')}, bandwidth {results.get('bandwidth', {}).get('GB_s')}"
    )
    print(
        "| TP | TPOT ms | vs TP=1 | roofline ms (weights + all-reduce) | TPOT / roofline "
        "| 32 streams tok/s | 128 streams tok/s | start-up s |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for key, row in sorted(results["sizes"].items()):
        if "error" in row:
            print(f"| {key} | error: {row['error'][-300:]!r} |")
            continue
        tp = row.get("throughput", {})

        def f(x: Any, spec: str = ".2f") -> str:
            return "-" if x is None else format(x, spec)

        print(
            f"| {key} | {f(row['tpot_ms'])} | {f(row.get('tpot_vs_tp1'))} | {f(row.get('roofline_ms'))} "
            f"({f(row.get('weights_roofline_ms'))} + {f(row.get('allreduce_ms_per_step'))}) | "
            f"{f(row.get('tpot_over_roofline'))} | {f(tp.get('32', {}).get('e2e_tok_s'), '.0f')} | "
            f"{f(tp.get('128', {}).get('e2e_tok_s'), '.0f')} | {f(row['startup_s'], '.1f')} |"
        )
    for key, row in results.get("allreduce", {}).items():
        print(f"all-reduce alone, TP={key}, us per [1, hidden] bf16 in a CUDA graph: {row}")
    for key, row in sorted(results["sizes"].items()):
        for rank in row.get("profile", {}).get("ranks", []):
            kinds = ", ".join(f"{k} {v:.3f}" for k, v in rank["ms_per_step_by_kind"].items())
            print(
                f"profile TP={key} {rank['process']}: device busy {rank['device_busy_ms_per_step']:.3f} of "
                f"{rank['device_span_ms_per_step']:.3f} ms per step; by kind (ms per step): {kinds}"
            )
            for g in rank["idle_gaps"][:5]:
                print(
                    f"    idle {g['ms_per_step']:.3f} ms per step ({g['count']}x): "
                    f"{g['before'][:50]} -> {g['after'][:50]}"
                )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,2", help="tensor_parallel_size values")
    ap.add_argument("--concurrency", default="1,32,128")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--sync", action="store_true", help="the synchronous loop (default: asynchronous)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per size")
    ap.add_argument("--smoke", action="store_true", help="CPU (gloo), a tiny shape, 8 tokens")
    ap.add_argument(
        "--symm-mem-too", action="store_true", help="also each size > 1 with ASYNCSPEC_TP_ALL_REDUCE=symm_mem"
    )
    ap.add_argument(
        "--env-variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE[,KEY=VALUE]",
        help="also each size > 1 with these environment variables, reported as <size>-NAME (repeatable), "
        "e.g. nomix:NCCL_GRAPH_MIXING_SUPPORT=0",
    )
    ap.add_argument("--profile-dir", type=Path, help="decode steps of one request profiled per size; traces go here")
    ap.add_argument("--profile-tokens", type=int, default=32, help="decode steps profiled")
    ap.add_argument("--output", type=Path)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-arg", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--settings", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        s = json.loads(args.settings)
        if args.child == "size":
            result = bench_size(args.child_arg, s)
        elif args.child == "bandwidth":
            result = bench_bandwidth(s)
        else:
            result = bench_allreduce(args.child_arg, (TINY_DUMMY if s["smoke"] else LLAMA_8B)["hidden_size"])
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    s = {
        "smoke": args.smoke,
        "concurrency": [int(c) for c in args.concurrency.split(",")],
        "new_tokens": 8 if args.smoke else args.new_tokens,
        "trials": 1 if args.smoke else args.trials,
        "async_scheduling": not args.sync,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "bandwidth_bytes": 2 << 30,
        "profile_dir": str(args.profile_dir.resolve()) if args.profile_dir else None,
        "profile_tokens": args.profile_tokens,
    }
    if args.smoke:
        s["concurrency"] = [1, 4]
    sizes = [int(x) for x in args.sizes.split(",")]
    results: dict[str, Any] = {
        "schema": SCHEMA,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "settings": s,
        "sizes": {},
        "allreduce": {},
    }
    if not args.smoke:
        results["bandwidth"] = run_child("bandwidth", 0, s, 120)
        for size in sizes:
            if size > 1:
                results["allreduce"][str(size)] = run_child("allreduce", size, s, 180)
    for size in sizes:
        results["sizes"][str(size)] = run_child("size", size, s, args.timeout)
    if args.symm_mem_too and not args.smoke:
        # The same sizes with the opt-in symmetric-memory all-reduce for decode-sized messages.
        os.environ["ASYNCSPEC_TP_ALL_REDUCE"] = "symm_mem"
        for size in sizes:
            if size > 1:
                results["sizes"][f"{size}-symm_mem"] = run_child("size", size, s, args.timeout)
        del os.environ["ASYNCSPEC_TP_ALL_REDUCE"]
    for name, env in parse_env_variants(args.env_variant):
        # The same sizes again with extra environment variables (NCCL tuning, say): the ranks
        # inherit the child's environment.
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        for size in sizes:
            if size > 1:
                row = run_child("size", size, s, args.timeout)
                row["env"] = env
                results["sizes"][f"{size}-{name}"] = row
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    derive(results, s)
    print_table(results)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=1))
    return 0 if all("error" not in r for r in results["sizes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
