from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.kernels.interpreter import InterpretedRun, InterpretedSuites, start_interpreted_suites

_RUN = pytest.StashKey[InterpretedRun]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Starts the session's one interpreted child in the background as soon as the tests are known, so it runs
    beside the other tests (xdist workers share it: each worker's basetemp sits in the session's)."""
    files = sorted({Path(str(item.path)) for item in session.items if item.name == "test_interpreter_suite"})
    if not files or os.environ.get("TRITON_INTERPRET") == "1":
        return
    basetemp = session.config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    folder = basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp
    session.config.stash[_RUN] = start_interpreted_suites(files, Path(__file__).resolve().parents[2], folder)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    run = session.config.stash.get(_RUN, None)
    if run is not None and exitstatus == pytest.ExitCode.INTERRUPTED:
        run.stop()


@pytest.fixture(scope="session")
def interpreted_suites(request: pytest.FixtureRequest) -> InterpretedSuites:
    """Every collected `test_interpreter_suite`'s file, its TestInterpreted run once in the interpreter."""
    return request.config.stash[_RUN].wait()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The interpreter checks wait for the background child: run them last, so that no worker idles while it runs.
    items.sort(key=lambda item: item.name == "test_interpreter_suite")
