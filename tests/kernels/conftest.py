from __future__ import annotations

from pathlib import Path

import pytest

from tests.kernels.interpreter import InterpretedSuites, run_interpreted_suites


@pytest.fixture(scope="session")
def interpreted_suites(request: pytest.FixtureRequest) -> InterpretedSuites:
    """Every collected `test_interpreter_suite`'s file, its TestInterpreted run once in the interpreter."""
    files = sorted({Path(str(item.path)) for item in request.session.items if item.name == "test_interpreter_suite"})
    return run_interpreted_suites(files, Path(__file__).resolve().parents[2])
