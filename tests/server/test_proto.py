"""The committed stubs (asyncspec/v1) are what `make proto` generates from proto/ today."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STUBS = ("asyncspec_pb2.py", "asyncspec_pb2.pyi", "asyncspec_pb2_grpc.py")


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    pytest.importorskip("grpc_tools")
    shutil.copytree(REPO / "proto", tmp_path / "proto")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-Iproto",
            "--python_out=.",
            "--grpc_python_out=.",
            "--pyi_out=.",
            "proto/asyncspec/v1/asyncspec.proto",
        ],
        cwd=tmp_path,
        check=True,
    )
    for name in STUBS:
        fresh = (tmp_path / "asyncspec" / "v1" / name).read_text()
        assert fresh == (REPO / "asyncspec" / "v1" / name).read_text(), f"{name} is stale: run `make proto`"


def test_every_field_of_the_proto_is_documented():
    lines = (REPO / "proto" / "asyncspec" / "v1" / "asyncspec.proto").read_text().splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        is_field = stripped.endswith(";") and "=" in stripped and not stripped.startswith(("option", "syntax", "//"))
        if is_field and not stripped.startswith(("FINISH_REASON_",)):
            previous = lines[i - 1].strip()
            documented = previous.startswith("//") or "//" in stripped or previous.endswith("{")
            assert documented, f"line {i + 1} has no comment: {stripped}"
