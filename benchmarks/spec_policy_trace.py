"""What the adaptive speculation policy chose, and why: the bundled pair at batch 1, several generations in one
process, and after each one the k each step verified and the policy's estimates per k (device time from the
graphs, host time from the steady steps it observed, tokens a run emitted).

    python3 benchmarks/spec_policy_trace.py --output $OUT/spec_policy_trace.json          # GPU, ~1 min
    python3 benchmarks/spec_policy_trace.py --device cpu --generations 2 --max-tokens 8     # the script only

On the CPU there are no graphs, so no device costs: the policy keeps k fixed and the estimates are empty.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: asyncspec without an install
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_step_speed import DRAFT, TARGET, load_prompts  # noqa: E402


def estimates(policy: Any) -> dict[str, Any]:
    if policy.step_cost is None:
        return {}
    return {
        str(k): {
            "device_ms": policy.step_cost(1, k) * 1e3,
            "host_ms": policy.host_seconds(k) * 1e3,
            "tokens_per_run": policy.tokens_per_run(k),
        }
        for k in policy.choices
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--generations", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--sync", action="store_true", help="the synchronous loop (default: asynchronous)")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()

    import torch

    import asyncspec

    cpu = args.device == "cpu"
    llm = asyncspec.LLM(
        str(TARGET),
        device=args.device,
        dtype="float32" if cpu else "bfloat16",
        gpu_memory_utilization=0.3,
        async_scheduling=not args.sync,
        speculative_method="draft_model",
        draft_model=str(DRAFT),
        num_speculative_tokens=4,
        max_model_len=1024,
        **({"num_kv_blocks": 128} if cpu else {}),
    )
    policy = llm.engine.engine_core.scheduler.spec_policy
    params = asyncspec.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompt = load_prompts(1)
    sync = torch.cuda.synchronize if not cpu else (lambda: None)
    rows = []
    for g in range(args.generations):
        before = llm.stats()
        start = time.perf_counter()
        llm.generate(prompt, params)
        sync()
        wall = time.perf_counter() - start
        after = llm.stats()
        k_steps = {
            key.removeprefix("spec_steps_with_k_"): after[key] - before.get(key, 0)
            for key in after
            if key.startswith("spec_steps_with_k_")
        }
        row = {
            "generation": g,
            "wall_ms": wall * 1e3,
            "steps": after["num_steps"] - before["num_steps"],
            "steps_by_k": k_steps,
            "acceptance_rate": policy.acceptance_rate,
            "estimates": estimates(policy),
        }
        rows.append(row)
        print(f"gen {g}: {row['wall_ms']:.1f} ms, {row['steps']} steps, by k {k_steps}", flush=True)
        for k, e in row["estimates"].items():
            print(
                f"    k={k}: device {e['device_ms']:.3f} ms, host {e['host_ms']:.3f} ms, "
                f"{e['tokens_per_run']:.2f} tokens a run",
                flush=True,
            )
    llm.shutdown()
    if args.output:
        card = torch.cuda.get_device_name() if not cpu else "cpu"
        args.output.write_text(json.dumps({"card": card, "command": " ".join(sys.argv), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
