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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
