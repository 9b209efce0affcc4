"""Runs the test files' TestInterpreted classes in one child pytest with TRITON_INTERPRET=1: triton fixes
interpreter mode when it is first imported, so the parent process cannot switch it on (not a test module). One
child for every file collected in the session: each child pays seconds of imports and collection."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import tempfile
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


def run_interpreted_suites(test_files: list[Path], root: Path) -> InterpretedSuites:
    """One child pytest over `test_files`' TestInterpreted classes, in the interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    for name in UNSET_ENV:
        env.pop(name, None)
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "interpreted.xml"
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", *(f"{f}::TestInterpreted" for f in test_files), "-q"]
            + ["-p", "no:cacheprovider", "-rfEs", f"--junitxml={junit}"],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        report = proc.stdout[-8000:] + proc.stderr[-2000:]
        counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        if junit.exists():
            for case in ET.parse(junit).getroot().iter("testcase"):
                stem = case.get("classname", "").split(".")[-2:-1]
                outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
                counts[stem[0] if stem else ""][{"failure": "failed"}.get(outcome, outcome)] += 1
    return InterpretedSuites(dict(counts), report)
