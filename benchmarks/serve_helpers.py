"""A real `asyncspec serve` process for the served benchmarks (not a benchmark itself)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
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


@dataclass
class RunningServer:
    """The serve process, the address it listens on, and (once stopped) its exit code."""

    proc: subprocess.Popen
    address: str
    exit_code: int | None = None


@contextmanager
def running_server(flags: list[str]) -> Iterator[RunningServer]:
    """`python -m asyncspec.cli serve` on 127.0.0.1, an ephemeral port and no metrics server, with `flags`
    added; on leaving, SIGTERM (a drain) and the exit code, or a kill after 60 s."""
    command = [sys.executable, "-m", "asyncspec.cli", "serve", "--host", "127.0.0.1", "--port", "0"]
    proc = subprocess.Popen(
        [*command, "--metrics-port", "-1", *flags],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    server = RunningServer(proc, "")
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = re.search(r"on 127\.0\.0\.1:(\d+)", line)
        if not match:
            raise RuntimeError(f"the server did not start: {line!r}")
        server.address = f"127.0.0.1:{match.group(1)}"
        yield server
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            server.exit_code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
