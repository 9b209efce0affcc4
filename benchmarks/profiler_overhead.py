"""What an attached profiler costs a timed run: batch-1 asynchronous TPOT in fresh processes, alternately with and
without torch.profiler started before the engine (as a script that profiles graph replays must start it, before
any capture: pytorch#100441). Once CUPTI is attached it stays for the process, so a script that times anything
after starting the profiler measures it too; gpu_step_speed.py therefore times in an engine built before it.

    python3 benchmarks/profiler_overhead.py --models llama-1b,bundled --rounds 2 --output $OUT/profiler.json  # GPU
    python3 benchmarks/profiler_overhead.py --smoke                                                         # CPU

TPOT is `(wall of 128 new tokens - wall of 1) / 127`, the median of 9 alternated pairs after 3 untimed runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def measure(model: str, profiler: bool, smoke: bool) -> dict[str, Any]:
    """One process's TPOT (this function runs in the child)."""
    sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
    if profiler:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU if smoke else ProfilerActivity.CUDA]):
            pass
    import gpu_step_speed as gss

    import asyncspec

    kwargs: dict[str, Any] = dict(
        max_model_len=2048,
        max_num_seqs=1,
        max_num_batched_tokens=4096,
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
    )
    if smoke:
        kwargs.update(device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=512)
    else:
        kwargs.update(device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5)
    if gss.MODELS[model]["dummy"]:
        kwargs["load_format"] = "dummy"
    llm = asyncspec.LLM(gss.model_dir(model), **kwargs)
    prompt = [p[:32] for p in gss.load_prompts(1)] if smoke else gss.load_prompts(1)
    # Five smoke pairs: the median outlasts a stalled run on a busy CI core (two gave a negative TPOT once).
    new_tokens, pairs, warm = (8, 5, 1) if smoke else (128, 9, 3)
    full = asyncspec.SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    one = asyncspec.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate(prompt, one)
    for _ in range(warm):
        llm.generate(prompt, full)
    tpots = []
    for _ in range(pairs):
        t = time.perf_counter()
        llm.generate(prompt, full)
        a = time.perf_counter() - t
        t = time.perf_counter()
        llm.generate(prompt, one)
        b = time.perf_counter() - t
        tpots.append((a - b) / (new_tokens - 1) * 1e3)
    return {"model": model, "profiler": profiler, "tpot_ms": statistics.median(tpots), "trials_ms": tpots}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama-1b,bundled")
    ap.add_argument("--rounds", type=int, default=2, help="pairs of processes (without, with) per model")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny settings: checks the script")
    ap.add_argument("--output", type=Path)
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "PROFILER"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1] == "1", args.smoke)))
        return 0
    rows = []
    for model in args.models.split(","):
        for _ in range(args.rounds):
            for profiler in ("0", "1"):
                cmd = [sys.executable, __file__, "--child", model, profiler] + (["--smoke"] if args.smoke else [])
                proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600, check=False)
                lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
                if proc.returncode or not lines:
                    rows.append({"model": model, "profiler": profiler == "1", "error": proc.stderr[-2000:]})
                else:
                    rows.append(json.loads(lines[-1]))
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "trials_ms"}), flush=True)
    result: dict[str, Any] = {"command": " ".join(sys.argv), "rows": rows, "per_model": {}}
    for model in args.models.split(","):
        by = {
            p: [r["tpot_ms"] for r in rows if r["model"] == model and r["profiler"] is p and "tpot_ms" in r]
            for p in (False, True)
        }
        if by[False] and by[True]:
            result["per_model"][model] = {
                "without_ms": statistics.median(by[False]),
                "with_ms": statistics.median(by[True]),
                "with_over_without": statistics.median(by[True]) / statistics.median(by[False]),
            }
            print(f"{model}: {result['per_model'][model]}")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
