"""A real `asyncspec serve` process for the served benchmarks (not a benchmark itself)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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
