"""Runs a test file's TestInterpreted class in a child pytest with TRITON_INTERPRET=1: triton fixes
interpreter mode when it is first imported, so the parent process cannot switch it on (not a test module)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


def run_interpreted_suite(test_file: str, min_passed: int, unset_env: tuple[str, ...] = ()) -> None:
    """Asserts that `test_file::TestInterpreted` passes in the interpreter with at least `min_passed`
    tests and none skipped (a skip would mean the kernels were not really exercised)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    for name in unset_env:
        env.pop(name, None)
    here = Path(test_file).resolve()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", f"{here}::TestInterpreted", "-q", "-p", "no:cacheprovider", "-rfEs"],
        cwd=here.parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= min_passed and "skipped" not in proc.stdout, report
