"""The gRPC server: health (liveness on "", readiness on asyncspec.v1.Generation), reflection, the
Generation service, Prometheus metrics on their own HTTP port, optional TLS and bearer-token auth, and
a drain on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from asyncspec.config import EngineConfig
from asyncspec.engine.async_engine import AsyncEngine
from asyncspec.engine.engine_process import EngineProcessClient
from asyncspec.errors import AsyncSpecError
from asyncspec.server.interceptors import MalformedRequestInterceptor
from asyncspec.server.metrics import ServerMetrics
from asyncspec.server.service import SERVICE_NAME, GenerationService, ServingEngine
from asyncspec.v1 import asyncspec_pb2 as pb
from asyncspec.v1 import asyncspec_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

AUTH_TOKEN_ENV = "ASYNCSPEC_AUTH_TOKEN"
"""Environment variable holding the bearer token clients must send (unset: no auth)."""
_ABORTED_STREAMS_END_S = 5.0  # how long a drain waits for aborted streams to send their final response
_GRPC_INT_MAX = 2**31 - 1  # gRPC's integer channel options are C ints
_STOP_AFTER_FAILURE_S = 90.0  # a failed engine's stop (a process's join and kill take up to 70 s); then exit without it


class ServerStartError(AsyncSpecError):
    """The server could not start: a port in use, an unreadable certificate, a model that fails to load."""


@dataclass
class ServerConfig:
    """How the server listens; the engine's own options are EngineConfig's."""

    host: str = "0.0.0.0"
    """Address the gRPC and metrics servers bind."""
    port: int = 50051
    """gRPC port (0: an ephemeral port, reported by `GenerationServer.port`)."""
    metrics_port: int = 9400
    """Prometheus HTTP port (0: ephemeral; -1: no metrics server)."""
    drain_grace_s: float = 30.0
    """On SIGTERM: how long in-flight streams may run on before they are aborted."""
    max_message_bytes: int = 16 * 2**20
    """Largest request or response message; bigger requests get RESOURCE_EXHAUSTED."""
    keepalive_time_s: float = 30.0
    """Interval of HTTP/2 keepalive pings on idle connections."""
    keepalive_timeout_s: float = 10.0
    """How long a keepalive ping may go unanswered before the connection is closed."""
    tls_cert_file: str | None = None
    """PEM certificate chain: serve TLS (with tls_key_file)."""
    tls_key_file: str | None = None
    """PEM private key of tls_cert_file."""
    auth_token_file: str | None = None
    """File holding the bearer token; else $ASYNCSPEC_AUTH_TOKEN; neither: no auth."""
    engine_stall_timeout_s: float = 300.0
    """How long the engine may hold unfinished requests with no step finishing before it counts as hung (a stuck
    kernel or collective): the streams then end with INTERNAL, liveness goes NOT_SERVING and `serve` exits 1, so
    the orchestrator restarts it. Above the longest step, first-use kernel compilation included; 0: never."""
    engine_process: bool = True
    """Run the engine (scheduling, output processing, the model) in a process of its own, so that the
    server's per-stream gRPC work never shares an interpreter lock with it; each step's outputs cross one pipe.
    False keeps it in the server's process (one process less, for debugging)."""

    def validate(self) -> None:
        """Raises ServerStartError naming the first field out of range (gRPC would wrap a port past 65535)."""
        checks = [
            ("port", self.port, 0 <= self.port <= 65535, "in [0, 65535] (0: ephemeral)"),
            ("metrics_port", self.metrics_port, -1 <= self.metrics_port <= 65535, "in [-1, 65535] (-1: none)"),
            (
                "max_message_bytes",
                self.max_message_bytes,
                0 < self.max_message_bytes <= _GRPC_INT_MAX,
                f"in [1, {_GRPC_INT_MAX}] (gRPC takes a C int)",
            ),
        ]
        for name in ("drain_grace_s", "keepalive_time_s", "keepalive_timeout_s", "engine_stall_timeout_s"):
            value = getattr(self, name)
            if name.startswith("keepalive"):  # gRPC takes milliseconds as a C int
                ok = math.isfinite(value) and 0 < value and value * 1000 <= _GRPC_INT_MAX
                checks.append((name, value, ok, f"a finite number > 0 and at most {_GRPC_INT_MAX // 1000}"))
            else:
                ok = math.isfinite(value) and value >= 0
                checks.append((name, value, ok, "a finite number >= 0"))
        for name, value, ok, allowed in checks:
            if not ok:
                raise ServerStartError(f"{name} must be {allowed}, got {value!r}")

    def auth_token(self) -> str | None:
        token = self._read_auth_token()
        if token is not None and not all(" " <= c <= "~" for c in token):
            # gRPC metadata carries printable ASCII only: no client could send such a token.
            source = f"auth_token_file {self.auth_token_file!r}" if self.auth_token_file else f"${AUTH_TOKEN_ENV}"
            raise ServerStartError(f"the bearer token of {source} must be printable ASCII (gRPC metadata)")
        return token

    def _read_auth_token(self) -> str | None:
        if self.auth_token_file:
            try:
                with open(self.auth_token_file) as f:
                    token = f.read().strip()
            except OSError as e:
                raise ServerStartError(f"cannot read auth_token_file {self.auth_token_file!r}: {e}") from None
            if not token:
                raise ServerStartError(f"auth_token_file {self.auth_token_file!r} is empty")
            return token
        # Stripped as the file is: a Secret written from a file usually ends in a newline, which no client can send.
        return os.environ.get(AUTH_TOKEN_ENV, "").strip() or None


_OPEN_METHODS = ("/grpc.health.v1.Health/",)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED unless the call carries `authorization: Bearer <token>`; health checks stay open (probes
    carry no token). Reflection needs the token too: an unauthenticated caller learns nothing but the health."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(_OPEN_METHODS):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        # Bytes: compare_digest refuses a str with non-ASCII characters, which a caller's header may hold.
        if hmac.compare_digest(str(metadata.get("authorization", "")).encode(), self._expected):
            return handler

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
            yield  # pragma: no cover - makes this an async generator

        kwargs = dict(
            request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(deny_stream, **kwargs)
        return grpc.unary_unary_rpc_method_handler(deny, **kwargs)


class GenerationServer:
    """`await start()` binds, then loads the engine (readiness NOT_SERVING until it is ready);
    `await drain()` stops taking requests, lets in-flight streams finish within the grace period,
    then stops everything."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig | None = None) -> None:
        self.engine_config = engine_config
        self.config = server_config or ServerConfig()
        self.engine: ServingEngine | None = None
        self.port = 0
        self.metrics_port: int | None = None
        self.metrics = ServerMetrics(self._stats)
        self.health = health.aio.HealthServicer()
        self.draining = False
        self._server: grpc.aio.Server | None = None
        self._metrics_http: WSGIServer | None = None
        self._service: GenerationService | None = None
        self._stopped = asyncio.Event()
        self.engine_failed = asyncio.Event()
        """Set when the engine has failed for good (a worker process died, the loop raised)."""
        self._health_task: asyncio.Task[None] | None = None
        self._last_progress = time.monotonic()
        """When a step last finished, or the engine last had no unfinished request (the stall watchdog's clock)."""
        self._watchdog: asyncio.Task[None] | None = None

    def _stats(self) -> dict[str, float]:
        # Read by the metrics server's thread: the snapshot taken between steps.
        return self.engine.stats_snapshot() if self.engine is not None else {}

    async def start(self) -> None:
        cfg = self.config
        cfg.validate()
        token = cfg.auth_token()
        options = [
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.keepalive_time_ms", int(cfg.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(cfg.keepalive_timeout_s * 1000)),
            ("grpc.http2.min_ping_interval_without_data_ms", 5000),
            # grpc sets SO_REUSEPORT by default: a second server on a port in use would start and split its calls.
            ("grpc.so_reuseport", 0),
        ]
        # The token is checked first: an unauthenticated caller learns nothing about its message.
        interceptors: list[grpc.aio.ServerInterceptor] = [BearerTokenInterceptor(token)] if token else []
        interceptors.append(MalformedRequestInterceptor())
        server = grpc.aio.server(options=options, interceptors=interceptors)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)  # liveness: the process is up
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)  # readiness: loading
        self._service = GenerationService(
            lambda: self.engine, self.metrics, lambda: self.draining, self.mark_engine_dead, cfg.max_message_bytes
        )
        pb_grpc.add_GenerationServicer_to_server(self._service, server)
        names = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        address = f"{cfg.host}:{cfg.port}"
        try:
            if cfg.tls_cert_file or cfg.tls_key_file:
                credentials = grpc.ssl_server_credentials([(_read(cfg.tls_key_file), _read(cfg.tls_cert_file))])
                self.port = server.add_secure_port(address, credentials)
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError as e:
            raise ServerStartError(f"cannot listen on {address}: {e}") from None
        if self.port == 0:
            raise ServerStartError(f"cannot listen on {address} (is the port in use?)")
        await server.start()
        self._server = server
        if cfg.metrics_port >= 0:
            try:
                self._metrics_http, _ = start_http_server(
                    cfg.metrics_port, addr=cfg.host, registry=self.metrics.registry
                )
            except OSError as e:
                await server.stop(0)
                raise ServerStartError(f"cannot serve metrics on {cfg.host}:{cfg.metrics_port}: {e}") from None
            self.metrics_port = self._metrics_http.server_port
        logger.info(
            "gRPC listening on %s:%d, metrics on %s; loading the engine", cfg.host, self.port, self.metrics_port
        )
        start = time.perf_counter()
        try:
            if cfg.engine_process:
                self.engine = await EngineProcessClient.launch(self.engine_config)
            else:
                self.engine = await asyncio.get_running_loop().run_in_executor(None, AsyncEngine, self.engine_config)
        except Exception as e:
            await self.stop()
            raise ServerStartError(f"the engine failed to start: {e}") from e
        self.engine.add_step_listener(self.metrics.iteration_tokens.observe)
        self.engine.add_step_listener(self._on_step)
        self.engine.add_death_listener(self._on_engine_death)
        self.engine.start()
        if cfg.engine_stall_timeout_s > 0:
            self._last_progress = time.monotonic()
            self._watchdog = asyncio.get_running_loop().create_task(self._watch_for_stall(cfg.engine_stall_timeout_s))
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        logger.info("ready in %.1f s: serving %s", time.perf_counter() - start, self.engine_config.model)

    def _on_step(self, num_tokens: int) -> None:
        self._last_progress = time.monotonic()

    async def _watch_for_stall(self, timeout_s: float) -> None:
        """A hung engine is alive to every other check: it neither dies nor answers. Unfinished requests with no
        step finishing for timeout_s declare it dead."""
        period = min(5.0, timeout_s / 4)
        while self.engine is not None and not self.engine_failed.is_set():
            await asyncio.sleep(period)
            now = time.monotonic()
            # Requests the engine has not finished, not streams: a stream whose client reads slowly may outlive
            # its request's last step by any time.
            waiting = self.engine.num_unfinished_requests
            if waiting == 0:
                self._last_progress = now
            elif now - self._last_progress > timeout_s:
                self.engine.declare_dead(
                    f"the engine is hung: no step finished in {now - self._last_progress:.0f} s with {waiting} "
                    f"requests unfinished (engine_stall_timeout_s {timeout_s:g})"
                )
                return

    def _on_engine_death(self, error: Exception) -> None:
        logger.error("the engine failed: %s", error)
        self.mark_engine_dead()
        self.engine_failed.set()

    def mark_engine_dead(self) -> None:
        """The engine failed: readiness (and liveness, so the orchestrator restarts it) NOT_SERVING."""
        self._health_task = asyncio.get_running_loop().create_task(
            self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        )

    async def _set_all(self, status) -> None:
        await self.health.set(SERVICE_NAME, status)
        await self.health.set("", status)

    async def drain(self, grace_s: float | None = None) -> None:
        """Readiness NOT_SERVING, new Generate calls UNAVAILABLE; in-flight streams run on for the grace
        period. Those still running then are aborted, so that each ends with a final ABORTED response and its
        usage (the API's finish reason for a shutdown); then the engine and the servers stop."""
        if self.draining:
            await self._stopped.wait()
            return
        self.draining = True
        grace = self.config.drain_grace_s if grace_s is None else grace_s
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._wait_streams_end(time.monotonic() + grace)
        if self._service is not None and await self._service.abort_streams():
            await self._wait_streams_end(time.monotonic() + _ABORTED_STREAMS_END_S)
        await self.stop()

    async def _wait_streams_end(self, deadline: float) -> None:
        while self._service is not None and self._service.num_active_streams > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.engine is not None:
            await self.engine.shutdown()
        if self._server is not None:
            await self._server.stop(0.5)
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
            self._metrics_http = None
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


def _read(path: str | None) -> bytes:
    if not path:
        raise ServerStartError("TLS needs both tls_cert_file and tls_key_file")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ServerStartError(f"cannot read {path!r}: {e}") from None


async def serve(engine_config: EngineConfig, server_config: ServerConfig, exit_process: bool = False) -> int:
    """Runs a server until SIGTERM or SIGINT, then drains; returns the exit status. A signal while the model
    loads in this process (engine_process=False) leaves its loading thread running, which the event loop's end
    would wait for: with `exit_process` (the `asyncspec serve` command) the process then exits at once."""
    server = GenerationServer(engine_config, server_config)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    starting = asyncio.ensure_future(server.start())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([starting, stopping], return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        # A signal while the model loads (minutes on a large GPU model): stop now, not once it is ready, or the
        # orchestrator's grace period runs out and it kills the pod.
        logger.info("stopping before the engine was ready")
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        await server.stop()
        if exit_process and not server_config.engine_process:
            # The model loads in an executor thread, which nothing can interrupt and the loop's exit would join.
            for handler in logging.getLogger().handlers:
                handler.flush()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        return 0
    stopping.cancel()
    starting.result()  # a ServerStartError
    print(f"asyncspec: serving {engine_config.model} on {server_config.host}:{server.port}", flush=True)
    stopping = asyncio.ensure_future(stop.wait())
    failing = asyncio.ensure_future(server.engine_failed.wait())
    await asyncio.wait([stopping, failing], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    failing.cancel()
    if server.engine_failed.is_set():
        # Every stream has ended with INTERNAL; a restart (the orchestrator's) is the only way on.
        await _stop_failed(server.stop())
        print("asyncspec: the engine failed; exiting", file=sys.stderr, flush=True)
        return 1
    logger.info("draining (grace %.1f s)", server_config.drain_grace_s)
    draining = asyncio.ensure_future(server.drain())
    failing = asyncio.ensure_future(server.engine_failed.wait())
    await asyncio.wait([draining, failing], return_when=asyncio.FIRST_COMPLETED)
    failing.cancel()
    if not draining.done():  # the engine failed (or hung) during the drain
        await _stop_failed(draining)
    # An engine that failed during the drain is a failure too, for supervisors that restart on one.
    return 1 if server.engine_failed.is_set() else 0


async def _stop_failed(stopping: Awaitable[None]) -> None:
    """Waits for a failed engine's stop, but not forever: a step hung in the engine's thread never returns, and
    the process must still exit (non-zero) for the orchestrator to restart it."""
    try:
        await asyncio.wait_for(stopping, _STOP_AFTER_FAILURE_S)
    except TimeoutError:
        logger.error("the failed engine did not stop in %.0f s; exiting without it", _STOP_AFTER_FAILURE_S)
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def run(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """`serve` on uvloop where it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(serve(engine_config, server_config, exit_process=True))
    return uvloop.run(serve(engine_config, server_config, exit_process=True))


__all__ = ["GenerationServer", "ServerConfig", "ServerStartError", "run", "serve", "pb"]
