"""Where the host's time goes per engine step: cProfile (Python functions) around a generation on
the GPU, for the configurations whose speed the host sets (the bundled pair at batch 1, with and
without its draft; many streams). Prints, per configuration, wall time per step and the functions
with the most own time per step; writes everything as JSON.

    python3 benchmarks/host_profile.py --output $OUT/host_profile.json
    python3 benchmarks/host_profile.py --smoke      # CPU: checks the script only

cProfile slows Python roughly twice over; read the shares, not the absolute times.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_step_speed import DRAFT, TARGET, _import_asyncspec, load_prompts  # noqa: E402

CONFIGS: dict[str, dict[str, Any]] = {
    "bundled-b1": {"streams": 1, "spec": {}},
    "bundled-draft-b1": {
        "streams": 1,
        "spec": {"speculative_method": "draft_model", "draft_model": str(DRAFT), "num_speculative_tokens": 4},
    },
    "bundled-draft-b128": {
        "streams": 128,
        "spec": {"speculative_method": "draft_model", "draft_model": str(DRAFT), "num_speculative_tokens": 4},
    },
    "bundled-b128": {"streams": 128, "spec": {}},
    "bundled-b64": {"streams": 64, "spec": {}},
    "bundled-draft-b64": {
        "streams": 64,
        "spec": {"speculative_method": "draft_model", "draft_model": str(DRAFT), "num_speculative_tokens": 4},
    },
}


def profile_config(name: str, cfg: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    asyncspec = _import_asyncspec()
    streams = cfg["streams"] if not args.smoke else min(cfg["streams"], 4)
    llm = asyncspec.LLM(
        str(TARGET),
        device="cpu" if args.smoke else "cuda",
        dtype="float32" if args.smoke else "bfloat16",
        async_scheduling=not args.sync,
        max_model_len=2048,
        max_num_seqs=max(streams, 1),
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
        gpu_memory_utilization=0.5,
        **cfg["spec"],
    )
    n = 8 if args.smoke else args.new_tokens
    params = asyncspec.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    prompts = load_prompts(streams)
    llm.generate(prompts, params)  # warm: graphs, this batch's shapes
    steps_before = llm.stats()["num_steps"]
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    plain_wall = time.perf_counter() - t0
    steps = llm.stats()["num_steps"] - steps_before
    profiler = cProfile.Profile()
    steps_before = llm.stats()["num_steps"]
    t0 = time.perf_counter()
    profiler.enable()
    llm.generate(prompts, params)
    profiler.disable()
    profiled_wall = time.perf_counter() - t0
    profiled_steps = llm.stats()["num_steps"] - steps_before
    llm.shutdown()
    stats = pstats.Stats(profiler)
    rows = []
    for (file, line, func), (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "function": f"{Path(file).name}:{line}({func})",
                "calls_per_step": nc / profiled_steps,
                "own_us_per_step": tt / profiled_steps * 1e6,
                "cumulative_us_per_step": ct / profiled_steps * 1e6,
            }
        )
    rows.sort(key=lambda r: -r["own_us_per_step"])
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
    return {
        "config": name,
        "streams": streams,
        "steps": steps,
        "wall_ms_per_step": plain_wall / steps * 1e3,
        "profiled_wall_ms_per_step": profiled_wall / profiled_steps * 1e3,
        "tokens_per_step": streams * n / steps,
        "top_own_time": rows[: args.top],
        "cumulative_text": text.getvalue()[-12000:],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--sync", action="store_true", help="the synchronous loop (default: asynchronous)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    results = []
    unknown = [n for n in args.configs.split(",") if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")
    for name in args.configs.split(","):
        r = profile_config(name, CONFIGS[name], args)
        results.append(r)
        print(
            f"\n== {name}: {r['wall_ms_per_step']:.3f} ms per step unprofiled "
            f"({r['profiled_wall_ms_per_step']:.3f} profiled), {r['tokens_per_step']:.2f} tokens per step"
        )
        for row in r["top_own_time"][:18]:
            print(f"  {row['own_us_per_step']:8.1f} us  {row['calls_per_step']:7.1f}x  {row['function'][:90]}")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"results": results, "command": " ".join(sys.argv)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
