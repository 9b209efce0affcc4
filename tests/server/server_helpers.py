"""A real server on 127.0.0.1 (ephemeral ports) in a background thread with its own event loop, for
tests that talk to it through ordinary grpc channels (not a test module)."""

from __future__ import annotations

import asyncio
import threading

import grpc

from asyncspec.config import make_config
from asyncspec.server.app import GenerationServer, ServerConfig
from asyncspec.v1 import asyncspec_pb2_grpc as pb_grpc
from tests.conftest import TARGET_MODEL

ENGINE = dict(device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=128)


class ServerThread:
    def __init__(self, engine_overrides: dict | None = None, model: str | None = None, **server_overrides) -> None:
        self.engine_config = make_config(model or str(TARGET_MODEL), **{**ENGINE, **(engine_overrides or {})})
        # In the server's process unless a test asks otherwise: most tests reach into the engine (faults, KV).
        server_overrides.setdefault("engine_process", False)
        config = ServerConfig(host="127.0.0.1", port=0, metrics_port=0, **server_overrides)
        self.server = GenerationServer(self.engine_config, config)
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self._started.wait(120)
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.server.start())
        except BaseException as e:  # noqa: BLE001 - reported to the constructor
            self._error = e
            self._started.set()
            return
        self._started.set()
        self.loop.run_until_complete(self.server.wait_stopped())

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def channel(self, **options) -> grpc.Channel:
        return grpc.insecure_channel(self.address, options=list(options.items()))

    def stub(self) -> pb_grpc.GenerationStub:
        return pb_grpc.GenerationStub(self.channel())

    def call(self, coro_fn, timeout: float = 60.0):
        """Runs a coroutine on the server's loop (its engine's stats, a drain) and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(timeout)

    def stats(self) -> dict:
        async def read():
            return self.server.engine.stats()

        return self.call(read)

    def stop(self, grace_s: float = 0.0) -> None:
        if self.thread.is_alive():
            self.call(lambda: self.server.drain(grace_s))
            self.thread.join(30)
