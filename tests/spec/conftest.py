"""Fixtures shared by the engine tests: pytest finds them here, so test modules need not import them."""

from __future__ import annotations

from tests.engine.engine_helpers import one_thread

__all__ = ["one_thread"]
