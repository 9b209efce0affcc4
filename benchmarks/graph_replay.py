"""Device time of the captured decode graphs, timed with CUDA events (no profiler: kernels launched with
programmatic dependent launch overlap, so a trace's summed kernel times would overcount), with and
without environment switches, each configuration in its own process, all in one call on one card.

python benchmarks/graph_replay.py --models llama-1b,llama-8b --switches ASYNCSPEC_PDL=0,ASYNCSPEC_PDL=1 \
    --output results.json

Prints one table: per model and switch, the ms of one replay of the (batch, 1) decode graph (forward pass
only; the sampling tail apart), the ratio to the first switch, and the batch-1 time over the roofline
(weight bytes over the read bandwidth measured here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from gpu_step_speed import LLAMA_1B, LLAMA_8B  # noqa: E402

SHAPES = {"llama-1b": LLAMA_1B, "llama-8b": LLAMA_8B}
BATCHES = (1, 2, 4, 8, 32)


def _one(model: str, repeats: int) -> dict:
    """In a child process: capture the model's graphs, time each (batch, 1) replay `repeats` times."""
    import torch

    from asyncspec import LLM

    tmp = tempfile.mkdtemp()
    (Path(tmp) / "config.json").write_text(json.dumps(SHAPES[model]))
    llm = LLM(
        tmp,
        device="cuda",
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=2048,
        max_num_seqs=max(BATCHES),
        enable_prefix_caching=False,
        gpu_memory_utilization=0.5,
    )
    runner = llm.engine.engine_core.runner
    graphs = runner.cuda_graphs
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    out: dict = {"weight_bytes": weight_bytes, "ms": {}}
    for batch in BATCHES:
        graph, _ = graphs._graphs[(batch, 1)]
        for _ in range(5):
            graph.replay()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 10)
        out["ms"][batch] = statistics.median(times)
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
    parser.add_argument("--output")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_one(args.one, args.repeats)))
        return 0
    results = []
    for model in args.models.split(","):
        for round_ in range(args.rounds):
            for switch in args.switches.split(","):
                env = dict(os.environ)
                env.update(kv.split("=", 1) for kv in switch.split("+"))
                proc = subprocess.run(
                    [sys.executable, __file__, "--one", model, "--repeats", str(args.repeats)],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if proc.returncode != 0:
                    print(proc.stderr[-3000:], file=sys.stderr)
                    return 1
                row = json.loads(proc.stdout.strip().splitlines()[-1])
                results.append({"model": model, "switch": switch, "round": round_, **row})
    print(f"{'model':9} {'switch':40} " + " ".join(f"{'b' + str(b) + ' ms':>8}" for b in BATCHES) + "  b1/RL  b1 ratio")
    base: dict[str, float] = {}
    for r in results:
        b1 = r["ms"]["1"] if "1" in r["ms"] else r["ms"][1]
        base.setdefault(r["model"], b1)
        roofline_ms = r["weight_bytes"] / r["read_bytes_per_s"] * 1e3
        cells = " ".join(f"{r['ms'][b if b in r['ms'] else str(b)]:8.3f}" for b in BATCHES)
        print(f"{r['model']:9} {r['switch']:40} {cells}  {b1 / roofline_ms:5.2f}  {b1 / base[r['model']]:6.3f}")
    if args.output:
        Path(args.output).write_text(json.dumps({"benchmark": "graph_replay", "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
