"""benchmarks/kernel_pipelining.py on the CPU: it compiles the attention and skinny_linear kernels for sm_90 and reads
their loops' pipelining depth, which must tell the shallow walk (each step waits for everything it asked for) from
a deep one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_the_attention_walk_waits_at_two_stages_and_overlaps_at_five(tmp_path: Path, sm90_compiler) -> None:
    pytest.importorskip("triton")
    out = tmp_path / "pipelining.json"
    args = ["--shapes", "llama-1b", "--block-n", "64", "--stages", "2,5", "--ms", "32", "--output", str(out)]
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "kernel_pipelining.py"), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    walk = {(r["kernel"], r["tile"]): r for r in rows if r["kernel"].startswith("_paged_attention")}
    for kernel in ("_paged_attention_split_kernel", "_paged_attention_kernel"):
        shallow, deep = walk[(kernel, "n64/s2/w4")], walk[(kernel, "n64/s5/w4")]
        assert shallow["groups_in_flight"] == 0 and deep["groups_in_flight"] > 0
        assert deep["prologue_copies"] > shallow["prologue_copies"]
        assert deep["shared_bytes"] > shallow["shared_bytes"]
    projections = [r for r in rows if r["kernel"].startswith("skinny_linear")]
    assert len(projections) == 4  # q|k|v, o, gate|up, down at M = 32: tensor-core tiles, pipelined
    assert all(r["tile"].startswith("dot") and r["groups_in_flight"] > 0 for r in projections)
