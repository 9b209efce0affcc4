"""Host CPU time per generated token of the server's process and of the engine's, with the engine in the server's
process or in its own (`serve --engine-process true`), under `asyncspec bench` at a fixed concurrency.

python3 benchmarks/serve_cpu_cost.py --output $OUT/serve_cpu_cost.json [--device cpu] [--concurrency 128]

Each mode starts `asyncspec serve` (the bundled pair with its draft, the serve defaults), runs one warm-up and one
timed `asyncspec bench`, and reads the processes' user + system CPU time from /proc around the timed run. The
served rate is capped by the slower process once the engine has its own: the server process's CPU per token
says how many tokens per second one gRPC process can carry. Linux only (reads /proc).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATASET = REPO / "benchmarks" / "data" / "prompts-code.jsonl"
_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (its threads included), from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def spawned_children(pid: int) -> list[int]:
    """Processes that multiprocessing spawned from `pid` (the engine process; not the resource tracker)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(") ", 1)[1].split()[1]) == pid:
                if b"spawn_main" in (stat.parent / "cmdline").read_bytes():
                    found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def bench(exe: Path, address: str, args: argparse.Namespace, output: Path) -> dict:
    command = [
        str(exe),
        "bench",
        "--address",
        address,
        "--dataset",
        str(DATASET),
        "--num-prompts",
        str(args.num_prompts),
        "--concurrency",
        str(args.concurrency),
        "--max-tokens",
        str(args.max_tokens),
        "--output",
        str(output),
    ]
    subprocess.run(command, check=True, capture_output=True, timeout=1800)
    return json.loads(output.read_text())


def run_mode(exe: Path, engine_process: bool, args: argparse.Namespace, scratch: Path) -> dict:
    serve = [
        str(exe),
        "serve",
        "--device",
        args.device,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--metrics-port",
        "-1",
        "--max-model-len",
        "1024",
        "--engine-process",
        "true" if engine_process else "false",
    ]
    if args.device == "cpu":
        serve += ["--dtype", "float32"]
    proc = subprocess.Popen(serve, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        match = re.search(r"on 127\.0\.0\.1:(\d+)", proc.stdout.readline())
        if not match:
            raise RuntimeError("serve did not report its port")
        address = f"127.0.0.1:{match.group(1)}"
        engine_pids = spawned_children(proc.pid)
        bench(exe, address, args, scratch / "warmup.json")
        pids = [proc.pid, *engine_pids]
        before = [cpu_seconds(pid) for pid in pids]
        start = time.monotonic()
        report = bench(exe, address, args, scratch / "timed.json")
        wall = time.monotonic() - start
        spent = [cpu_seconds(pid) - b for pid, b in zip(pids, before, strict=True)]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    tokens = report["total_output_tokens"]
    row = {
        "engine_process": engine_process,
        "wall_s": wall,
        "output_tokens": tokens,
        "output_throughput": report["output_throughput"],
        "server_cpu_s": spent[0],
        "server_cpu_us_per_token": 1e6 * spent[0] / tokens,
        "engine_cpu_s": spent[1] if engine_process else None,
        "engine_cpu_us_per_token": 1e6 * spent[1] / tokens if engine_process else None,
        "spec_decode_acceptance_length": report.get("spec_decode_acceptance_length"),
    }
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    exe = Path(sys.executable).parent / "asyncspec"
    if not exe.exists():
        print("the asyncspec console script is not installed beside this Python", file=sys.stderr)
        return 1
    scratch = args.output.parent
    scratch.mkdir(parents=True, exist_ok=True)
    rows = [run_mode(exe, engine_process, args, scratch) for engine_process in (False, True)]
    result = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "nproc": os.cpu_count(),
        "settings": vars(args) | {"output": str(args.output)},
        "rows": rows,
    }
    args.output.write_text(json.dumps(result, indent=1))
    print(f"{'engine':<16}{'tok/s':>9}{'server µs/tok':>15}{'engine µs/tok':>15}")
    for row in rows:
        engine = f"{row['engine_cpu_us_per_token']:.0f}" if row["engine_process"] else "-"
        where = "own process" if row["engine_process"] else "in the server"
        print(f"{where:<16}{row['output_throughput']:>9.0f}{row['server_cpu_us_per_token']:>15.0f}{engine:>15}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
