"""Profiles steady decode steps on the GPU (torch.profiler): the top CPU ops, and the GPU kernels of
one step with their time, count and share, to say where a step's GPU time goes.

python benchmarks/profile_step.py [--model llama-1b|llama-8b] [--streams N] [--steps N]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_engine_vs_hf import load_prompts  # noqa: E402
from gpu_step_speed import model_dir  # noqa: E402

from asyncspec import LLM, SamplingParams  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["llama-1b", "llama-8b"], default="llama-1b")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--steps", type=int, default=32, help="decode steps profiled")
    parser.add_argument("--top", type=int, default=25, help="kernels listed")
    parser.add_argument(
        "--by-position",
        default="",
        help="a kernel name whose calls are also listed by their position in the step (e.g. _skinny_linear_kernel: "
        "each layer's projections in order, then lm_head), to compare each call with its own microbenchmark",
    )
    parser.add_argument(
        "--sequence",
        type=int,
        default=0,
        help="also list this many kernels of one middle step in launch order: each kernel's duration and the idle "
        "time before it (the chain of a layer, to see which link pays a fixed cost)",
    )
    args = parser.parse_args()
    llm = LLM(
        model_dir(args.model),
        device="cuda",
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=2048,
        max_num_seqs=max(args.streams, 1),
        enable_prefix_caching=False,
        gpu_memory_utilization=0.5,
    )
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 40, ignore_eos=True)
    for i, prompt in enumerate(load_prompts(args.streams)):
        engine.add_request(engine.make_request(prompt, params, f"p{i}"), stream_deltas=False)
    for _ in range(8):  # the prefill and a few decode steps, outside the trace
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    time_us: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            time_us[event.name] += event.device_time
            count[event.name] += 1
    total = sum(time_us.values())
    print(f"GPU time per step {total / args.steps / 1000:.3f} ms, {sum(count.values()) / args.steps:.0f} kernels")
    print(f"{'us/step':>8} {'n/step':>6} {'us/call':>7} {'share':>6}  kernel")
    for name, t in sorted(time_us.items(), key=lambda kv: -kv[1])[: args.top]:
        n = count[name] / args.steps
        print(f"{t / args.steps:8.1f} {n:6.1f} {t / count[name]:7.2f} {t / total:6.1%}  {name[:110]}")
    if args.by_position:
        print_by_position(prof, args.by_position, args.steps)
    if args.sequence:
        print_sequence(prof, args.sequence, args.steps, sum(count.values()) // args.steps)
    return 0


def print_sequence(prof, shown: int, steps: int, per_step: int) -> None:
    """`shown` kernels of the middle step in start order: start offset, duration and the idle time since the
    previous kernel ended, in µs."""
    kernels = sorted(
        (event.time_range.start, event.time_range.end, event.name)
        for event in prof.events()
        if event.device_type == torch.autograd.DeviceType.CUDA
    )
    first = (steps // 2) * per_step
    chosen = kernels[first : first + shown]
    if not chosen:
        return
    origin = chosen[0][0]
    previous_end = kernels[first - 1][1] if first else origin
    print(f"{'start':>8} {'us':>7} {'idle':>6}  kernel (one step's first {len(chosen)}, in order)")
    for start, end, name in chosen:
        print(f"{start - origin:8.1f} {end - start:7.2f} {start - previous_end:6.2f}  {name[:90]}")
        previous_end = max(previous_end, end)


def print_by_position(prof, kernel: str, steps: int) -> None:
    """The named kernel's calls in launch order, one step's worth at a time: mean µs at each position."""
    calls = sorted(
        (event.time_range.start, event.device_time)
        for event in prof.events()
        if event.device_type == torch.autograd.DeviceType.CUDA and event.name == kernel
    )
    if not calls or len(calls) % steps:
        print(f"{kernel}: {len(calls)} calls over {steps} steps, not a whole number a step; no positions")
        return
    per_step = len(calls) // steps
    positions: dict[int, list[float]] = defaultdict(list)
    for i, (_, device_time) in enumerate(calls):
        positions[i % per_step].append(device_time)
    print(f"{kernel} by position in the step ({per_step} calls a step), mean us over {steps} steps:")
    means = [sum(times) / len(times) for _, times in sorted(positions.items())]
    for start in range(0, per_step, 8):
        print(f"  {start:3d}: " + " ".join(f"{mean:7.2f}" for mean in means[start : start + 8]))


if __name__ == "__main__":
    raise SystemExit(main())
