"""`serve`'s exit status, which supervisors restart on: 0 after a clean drain, 1 when the engine failed, before or
during the drain, and 1 without waiting forever when a failed engine cannot even stop."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from asyncspec.config import EngineConfig
from asyncspec.server import app


class _FakeServer:
    """GenerationServer's surface that serve() uses; its drain does what the test names."""

    drain_does = "finish"

    def __init__(self, engine_config, server_config) -> None:
        self.engine_failed = asyncio.Event()
        self.port = 0
        self.stopped = False

    async def start(self) -> None:
        # SIGTERM once serve() waits for it (its handler is installed before start()).
        asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGTERM)

    async def drain(self) -> None:
        if self.drain_does in ("fail", "fail-and-hang"):
            self.engine_failed.set()  # the engine died mid-drain
        if self.drain_does == "fail-and-hang":
            await asyncio.Event().wait()  # its stop waits on a step that never returns

    async def stop(self) -> None:
        self.stopped = True


@pytest.mark.parametrize(("drain_does", "status"), [("finish", 0), ("fail", 1)])
def test_serve_exits_non_zero_when_the_engine_fails_during_the_drain(monkeypatch, drain_does, status):
    monkeypatch.setattr(_FakeServer, "drain_does", drain_does)
    monkeypatch.setattr(app, "GenerationServer", _FakeServer)
    assert asyncio.run(app.serve(EngineConfig(), app.ServerConfig())) == status


def test_serve_exits_without_a_failed_engine_that_never_stops(monkeypatch):
    exits: list[int] = []

    class _Exited(Exception):
        pass

    def fake_exit(code: int) -> None:
        exits.append(code)
        raise _Exited

    monkeypatch.setattr(_FakeServer, "drain_does", "fail-and-hang")
    monkeypatch.setattr(app, "GenerationServer", _FakeServer)
    monkeypatch.setattr(app, "_STOP_AFTER_FAILURE_S", 0.2)
    monkeypatch.setattr(app.os, "_exit", fake_exit)
    with pytest.raises(_Exited):
        asyncio.run(app.serve(EngineConfig(), app.ServerConfig()))
    assert exits == [1]


@pytest.mark.parametrize(
    "field, value",
    [
        ("port", 70000),  # gRPC would listen on 70000 - 65536
        ("port", -1),
        ("metrics_port", 70000),
        ("metrics_port", -2),
        ("drain_grace_s", float("nan")),
        ("keepalive_time_s", 0.0),
        ("engine_stall_timeout_s", -1.0),
        ("max_message_bytes", 0),
        ("max_message_bytes", 2**31),  # gRPC's options are C ints: an OverflowError inside grpc.aio.server()
        ("keepalive_time_s", 3e6),  # 3e9 ms
        ("keepalive_timeout_s", float("inf")),
    ],
)
def test_server_settings_out_of_range_are_refused_before_anything_starts(field, value):
    config = app.ServerConfig(**{"port": 0, "metrics_port": -1, field: value})
    server = app.GenerationServer(EngineConfig(), config)
    with pytest.raises(app.ServerStartError, match=f"{field} must be"):
        asyncio.run(server.start())
    assert server.engine is None
