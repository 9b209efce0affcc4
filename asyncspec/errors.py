"""Typed errors. Every user-facing failure raises one of these with an actionable message."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncspec.outputs import RequestOutput


class AsyncSpecError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(AsyncSpecError, ValueError):
    """An EngineConfig field is invalid or a combination of fields is unsupported."""


class InvalidSamplingParamsError(AsyncSpecError, ValueError):
    """A SamplingParams field is out of range or of the wrong type."""


class InvalidRequestError(AsyncSpecError, ValueError):
    """A request cannot be served: prompt too long, empty, token ids out of range, duplicate id."""


class ModelLoadError(AsyncSpecError):
    """A model directory cannot be loaded: missing file, unknown architecture, shape mismatch."""


class RequestFailedError(AsyncSpecError, RuntimeError):
    """One request failed while it was admitted, computed or detokenized (for example its logits
    held no valid token). Only its own stream ends with this error; the engine serves on."""

    def __init__(self, message: str, output: RequestOutput | None = None) -> None:
        super().__init__(message)
        self.output = output
        """The request's last output (finish_reason "error"), where the engine made one: its prompt and
        prefix-cache counts, for a usage report even when the request failed before its first token."""


class EngineDeadError(AsyncSpecError, RuntimeError):
    """The engine loop failed; every in-flight request ends with this error."""


class QueueFullError(AsyncSpecError):
    """The waiting queue holds `max_num_waiting` requests; retry later."""


class WorkerDiedError(AsyncSpecError, RuntimeError):
    """A tensor-parallel worker process failed or exited; the engine cannot go on without it."""


class ProfilerError(AsyncSpecError, RuntimeError):
    """start_profile / stop_profile called out of order, or the trace directory is unusable."""
