"""Shared fixtures: the bundled models, the benchmark prompts, and the gpu marker."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

# Debug mode in every test: the placeholder invariant at each boundary and the host's reconciled
# counts against the device's (tests of the hot loop's host syncs turn it off: it synchronizes).
os.environ.setdefault("ASYNCSPEC_DEBUG_INVARIANTS", "1")

REPO = Path(__file__).resolve().parents[1]
TARGET_MODEL = REPO / "models" / "stdlib-coder-target"
DRAFT_MODEL = REPO / "models" / "stdlib-coder-draft"
_PROMPT_FILES = [
    REPO.parent / "shared" / "data" / "prompts-code.jsonl",
    REPO / "benchmarks" / "data" / "prompts-code.jsonl",
]


def load_prompts(n: int) -> list[list[int]]:
    path = next(p for p in _PROMPT_FILES if p.is_file())
    with open(path) as f:
        return [json.loads(line)["prompt_token_ids"] for _, line in zip(range(n), f, strict=False)]


@contextmanager
def recorded_spec_plans(scheduler) -> Iterator[list[tuple[int, int]]]:
    """Each plan `scheduler.schedule` returns inside the block that schedules any token, as (drafts verified,
    drafts proposed); the scheduler's own method is back afterwards."""
    plans: list[tuple[int, int]] = []
    schedule = scheduler.schedule

    def recording_schedule():
        out = schedule()
        if out.num_scheduled_tokens:
            plans.append((out.num_speculative_tokens, out.num_proposals))
        return out

    wrapped = "schedule" in vars(scheduler)  # an instance attribute already (another wrapper): put it back
    scheduler.schedule = recording_schedule
    try:
        yield plans
    finally:
        if wrapped:
            scheduler.schedule = schedule
        else:
            del scheduler.schedule


@pytest.fixture(scope="session")
def code_prompts() -> list[list[int]]:
    return load_prompts(16)


# Under pytest-xdist each worker gets one core: torch's default of one thread per core would oversubscribe
# the machine (two workers, two threads each, on CI's two cores) and its threads would spin against each other.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def sm90_compiler() -> None:
    """Skips the test where Triton cannot compile for sm_90 on this host: interpreting, or a build without the
    CUDA backend or its bundled ptxas. The compile tests check what only a compiled kernel shows (layouts, the PDL
    wait's place, the pipelining depth), without a GPU."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("compiles the kernels: needs triton not in interpreter mode")
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        if not os.path.isfile(get_ptxas(90).path or ""):
            raise FileNotFoundError("ptxas")
    except Exception as e:  # a triton build without the CUDA backend or its bundled ptxas
        pytest.skip(f"cannot compile for sm_90 here: {e!r}")
