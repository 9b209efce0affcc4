"""Runs the test files' TestInterpreted classes in one child pytest with TRITON_INTERPRET=1: triton fixes
interpreter mode when it is first imported, so the parent process cannot switch it on (not a test module). One
child for every file collected in the session (each child pays seconds of imports and collection), started in
the background as soon as the session's tests are known and shared by its xdist workers through files in the
session's basetemp; each file's `test_interpreter_suite` waits for it and reads its results."""

from __future__ import annotations

import collections
import fcntl
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

UNSET_ENV = ("ASYNCSPEC_ATTENTION_BACKEND", "ASYNCSPEC_REJECTION_BACKEND")
"""Backend switches the interpreted suites run without (each would route a kernel away from Triton)."""


@dataclass(frozen=True)
class InterpretedSuites:
    """The outcomes of every collected file's TestInterpreted, from one child run."""

    counts: dict[str, collections.Counter]
    """File stem -> outcome ("passed", "failed", "error", "skipped") -> tests."""
    report: str
    """The child's output, for a failure's message."""

    def check(self, test_file: str, min_passed: int, unset_env: tuple[str, ...] = ()) -> None:
        """Asserts that `test_file::TestInterpreted` passed in the interpreter with at least `min_passed` tests
        and none failed or skipped (a skip would mean the kernels were not really exercised)."""
        unknown = set(unset_env) - set(UNSET_ENV)
        if unknown:
            raise ValueError(f"add {sorted(unknown)} to interpreter.UNSET_ENV: the child runs every suite at once")
        counts = self.counts.get(Path(test_file).stem, collections.Counter())
        ok = counts["passed"] >= min_passed and not (counts["failed"] or counts["error"] or counts["skipped"])
        assert ok, f"{Path(test_file).name}: {dict(counts)}\n{self.report}"


_CHILD = """
import subprocess, sys, os
with open(sys.argv[1] + ".log", "w") as log:
    try:
        rc = subprocess.run(sys.argv[2:], stdout=log, stderr=subprocess.STDOUT, timeout=1800).returncode
    except subprocess.TimeoutExpired:
        rc = "timed out after 1800 s"
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(rc))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
"""
"""Runs the child pytest, then writes its exit status to the done file in one rename: a reader never sees it
half-written."""


@dataclass(frozen=True)
class InterpretedRun:
    """The child pytest of a test session, shared by every xdist worker through files in `folder`."""

    folder: Path
    process: subprocess.Popen | None
    """The child, in the process that started it (None in the others)."""

    @property
    def done(self) -> Path:
        return self.folder / "interpreted.done"

    def wait(self, timeout: float = 1800.0) -> InterpretedSuites:
        """The outcomes, once the child has finished (it runs beside the session's other tests)."""
        deadline = time.monotonic() + timeout
        while not self.done.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the interpreted Triton suites did not finish within {timeout:.0f} s")
            time.sleep(0.5)
        log = Path(str(self.done) + ".log")
        report = log.read_text()[-10000:] if log.exists() else ""
        counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        junit = self.folder / "interpreted.xml"
        if junit.exists():
            for case in ET.parse(junit).getroot().iter("testcase"):
                stem = case.get("classname", "").split(".")[-2:-1]
                outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
                counts[stem[0] if stem else ""][{"failure": "failed"}.get(outcome, outcome)] += 1
        return InterpretedSuites(dict(counts), report)

    def stop(self) -> None:
        """Ends the child if this process started it and it still runs (an interrupted session)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()


def start_interpreted_suites(test_files: list[Path], root: Path, folder: Path) -> InterpretedRun:
    """Starts one child pytest over `test_files`' TestInterpreted classes, in the interpreter, in the background,
    unless a process of the same session already did: `folder` is shared by the session's xdist workers, and a
    lock in it makes the first caller start the child and the others find it."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "interpreted.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        started = folder / "interpreted.started"
        if started.exists():
            return InterpretedRun(folder, None)
        env = dict(os.environ, TRITON_INTERPRET="1")
        for name in UNSET_ENV:
            env.pop(name, None)
        command = [sys.executable, "-m", "pytest", *(f"{f}::TestInterpreted" for f in test_files), "-q"]
        command += ["-p", "no:cacheprovider", "-rfEs", f"--junitxml={folder / 'interpreted.xml'}"]
        run = InterpretedRun(folder, None)
        process = subprocess.Popen([sys.executable, "-c", _CHILD, str(run.done), *command], cwd=root, env=env)
        started.touch()
        return InterpretedRun(folder, process)
