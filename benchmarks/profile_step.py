"""Profiles a few decode steps on the GPU (torch.profiler) and prints the top CPU and CUDA ops.

python benchmarks/profile_step.py [--model-config PATH_TO_CONFIG_DIR] [--streams N]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_engine_vs_hf import LLAMA_1B, load_prompts  # noqa: E402

from asyncspec import LLM, SamplingParams  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    tmp = tempfile.mkdtemp()
    with open(Path(tmp) / "config.json", "w") as f:
        json.dump(LLAMA_1B, f)
    llm = LLM(
        tmp,
        device="cuda",
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=2048,
        max_num_seqs=max(args.streams, 1),
        enable_prefix_caching=False,
        gpu_memory_utilization=0.5,
    )
    prompts = load_prompts(args.streams)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True)
    llm.generate(prompts, params)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
