"""Command line.

    asyncspec serve [--engine-option value ...] [--host H --port P --metrics-port M ...]
    asyncspec generate "def fib(n):" [--address host:port --max-tokens N ...]   # from a running server
    asyncspec bench [--address host:port --concurrency C | --request-rate R --num-prompts N ...]
    asyncspec-generate --prompt "def f(" --max-tokens 64 [--engine-option value ...]  # offline, no server

Engine flags are EngineConfig's fields with dashes, generated from the dataclass so they never drift;
server flags are ServerConfig's. Errors print one line and exit non-zero.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import os
import sys
import time
import types
import typing
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from asyncspec.config import EngineConfig, is_bundled_target
from asyncspec.errors import AsyncSpecError, ConfigError

if TYPE_CHECKING:
    from asyncspec.server.client_channel import ChannelSecurity

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"""--log-level's choices (any case)."""


def _field_parser(tp: Any):
    """The argparse `type` for a field annotation (Optional[X] accepts "none")."""
    origin = typing.get_origin(tp)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    # `Optional[X]` has origin typing.Union, `X | None` has types.UnionType (the same object from 3.14).
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        inner = _field_parser(args[0])

        def optional(text: str) -> Any:
            return None if text.lower() == "none" else inner(text)

        # argparse names the type in its message ("invalid int value: 'x'"), not "<lambda>".
        optional.__name__ = getattr(inner, "__name__", "value")
        return optional
    if origin is typing.Literal:
        return str
    if tp is bool:
        return _parse_bool
    if tp in (int, float, str):
        return tp
    return str


def _parse_bool(text: str) -> bool:
    value = text.lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, overrides: dict[str, Any] | None = None) -> None:
    """One flag per field of `cls` (dashes for underscores), its docstring as help."""
    hints = typing.get_type_hints(cls)
    docs = _field_docs(cls)
    for f in dataclasses.fields(cls):
        if overrides and f.name in overrides:
            default = overrides[f.name]
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = f.default
        flag_options: dict[str, Any] = {}
        if hints[f.name] is bool:
            flag_options = dict(nargs="?", const=True)  # `--enforce-eager` alone means true, as in vLLM
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=_field_parser(hints[f.name]),
            default=default,
            help=f"{docs.get(f.name, '')} (default: {default})",
            **flag_options,
        )


def add_engine_args(parser: argparse.ArgumentParser, overrides: dict[str, Any] | None = None) -> None:
    add_dataclass_args(parser, EngineConfig, overrides)


def _field_docs(cls: type = EngineConfig) -> dict[str, str]:
    """Field docstrings, read from the source so the CLI help matches the dataclass."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(cls))
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef)).body
    docs: dict[str, str] = {}
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
        ):
            docs[node.target.id] = str(nxt.value.value).replace("%", "%%")
    return docs


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def generate_offline_main(argv: Sequence[str] | None = None) -> int:
    """`asyncspec-generate`: generation in this process, no server."""
    try:
        return _generate_offline(argv)
    except AsyncSpecError as e:
        sys.stderr.write(f"asyncspec-generate: error: {e}\n")
        return 1


def _generate_offline(argv: Sequence[str] | None) -> int:
    from asyncspec import LLM, SamplingParams

    parser = argparse.ArgumentParser(prog="asyncspec-generate", description="Generate text with asyncspec.")
    parser.add_argument("--prompt", action="append", help="prompt text (repeatable); \\n is a newline")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed-request", type=int, default=None, help="per-request sampling seed")
    parser.add_argument(
        "--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, help="start-up progress goes to stderr"
    )
    add_engine_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prompts = [_newlines(p) for p in (args.prompt or ["def fibonacci(n):\\n"])]
    config = engine_config_from_args(args)
    llm = LLM(**dataclasses.asdict(config))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed_request)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for out in outputs:
        sys.stdout.write(f"--- {out.request_id} (finish: {out.finish_reason}, {len(out.token_ids)} tokens)\n")
        sys.stdout.write(prompts[outputs.index(out)] + out.text + "\n")
    n = sum(len(o.token_ids) for o in outputs)
    sys.stdout.write(f"--- {n} tokens in {elapsed:.2f} s ({n / elapsed:.1f} tok/s)\n")
    if config.speculative_method is not None:
        stats = llm.stats()
        sys.stdout.write(
            f"--- speculation ({config.speculative_method}, k={config.num_speculative_tokens}): "
            f"{stats['spec_num_accepted_tokens']}/{stats['spec_num_draft_tokens']} drafts accepted, "
            f"{stats['spec_mean_acceptance_length']:.2f} tokens per target step\n"
        )
    return 0


# -- asyncspec serve | generate -------------------------------------------------------------------
SERVE_DEFAULTS = {"speculative_method": "draft_model", "num_speculative_tokens": 4}
"""`asyncspec serve` runs the bundled target with its bundled draft at k = 4 unless told otherwise."""


def main(argv: Sequence[str] | None = None) -> int:
    from asyncspec.server.app import ServerConfig

    parser = argparse.ArgumentParser(
        prog="asyncspec",
        description="asyncspec: serve and query an LLM over gRPC. @FILE as the first argument reads the arguments "
        "from FILE, one per line.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the gRPC server (metrics on their own HTTP port)")
    add_engine_args(serve, SERVE_DEFAULTS)
    add_dataclass_args(serve, ServerConfig)
    serve.add_argument(
        "--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, help="progress while loading goes to stderr"
    )
    generate = commands.add_parser("generate", help="stream a completion from a running server")
    generate.add_argument("prompt", help="prompt text; \\n is a newline")
    generate.add_argument("--address", default="127.0.0.1:50051")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--timeout", type=float, default=300.0, help="deadline of the call, seconds")
    generate.add_argument("--auth-token-file", default=None, help="else $ASYNCSPEC_AUTH_TOKEN")
    _add_tls_flags(generate)
    health = commands.add_parser("health", help="exit 0 when a server's gRPC health check says SERVING")
    health.add_argument("--address", default="127.0.0.1:50051")
    health.add_argument("--service", default="", help='"" (liveness) or asyncspec.v1.Generation (readiness)')
    health.add_argument("--timeout", type=float, default=5.0)
    _add_tls_flags(health)
    bench = commands.add_parser("bench", help="load a running server and report throughput and latencies")
    bench.add_argument("--address", default="127.0.0.1:50051")
    bench.add_argument("--dataset", default=_default_dataset(), help='JSONL of {"prompt_token_ids": [...]}')
    bench.add_argument("--num-prompts", type=int, default=100)
    bench.add_argument("--max-tokens", type=int, default=128, help="tokens per request (ignore_eos)")
    bench.add_argument("--concurrency", type=int, default=32, help="requests in flight at most")
    bench.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--output", default=None, help="write the report as JSON here")
    bench.add_argument("--auth-token-file", default=None, help="else $ASYNCSPEC_AUTH_TOKEN")
    _add_tls_flags(bench)
    args = parser.parse_args(_expand_argument_file(list(sys.argv[1:] if argv is None else argv)))
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "bench":
            return _bench(args)
        if args.command == "health":
            return _health(args)
        return _generate_remote(args)
    except AsyncSpecError as e:
        sys.stderr.write(f"asyncspec {args.command}: error: {e}\n")
        return 1
    except KeyboardInterrupt:
        return 130


def _serve(args: argparse.Namespace) -> int:
    from asyncspec.server.app import ServerConfig, run

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not os.path.isdir(args.model):
        raise ConfigError(f"model directory {args.model!r} does not exist")
    if args.speculative_method is None and args.num_speculative_tokens == SERVE_DEFAULTS["num_speculative_tokens"]:
        args.num_speculative_tokens = 0  # `--speculative-method none` alone turns speculation off
    if args.speculative_method == "draft_model" and args.draft_model is None and not is_bundled_target(args.model):
        raise ConfigError(
            f"serve speculates with the bundled draft by default, which serves only the bundled target, not "
            f"{args.model!r}: pass --draft-model DIR, --speculative-method ngram, or --speculative-method none"
        )
    engine_config = engine_config_from_args(args)
    server_config = ServerConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig)})
    return run(engine_config, server_config)


def _health(args: argparse.Namespace) -> int:
    """The container's HEALTHCHECK and a manual probe: one gRPC health check, exit 0 only on SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with _channel_security(args).channel(args.address) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as e:
            sys.stderr.write(f"asyncspec health: {e.code().name}: {e.details()}\n")
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    print(f"{args.service or '(liveness)'}: {status}")
    return 0 if response.status == health_pb2.HealthCheckResponse.SERVING else 1


def _expand_argument_file(argv: list[str]) -> list[str]:
    """`asyncspec @FILE` (the Kubernetes ConfigMap's form): FILE's lines are the arguments. Only as the first
    argument: argparse's own @-expansion would read any later argument that starts with @ (a prompt that opens
    with a decorator) as a file."""
    if not argv or not argv[0].startswith("@"):
        return argv
    path = argv[0][1:]
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f.read().splitlines()]
    except OSError as e:
        sys.stderr.write(f"asyncspec: error: cannot read the argument file {path!r}: {e}\n")
        raise SystemExit(2) from None
    return [line for line in lines if line] + argv[1:]


def _newlines(prompt: str) -> str:
    """The documented escape only: `\\n` is a newline. Any other text, non-ASCII and backslashes (`C:\\x`) included,
    is sent as typed."""
    return prompt.replace("\\n", "\n")


def _add_tls_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls", action="store_true", help="connect with TLS, trusting the system's roots")
    parser.add_argument(
        "--tls-ca-file", default=None, help="connect with TLS, trusting this PEM (the server's CA or certificate)"
    )
    parser.add_argument(
        "--tls-server-name", default=None, help="the name the server's certificate holds, if not the address's host"
    )


def _channel_security(args: argparse.Namespace) -> ChannelSecurity:
    from asyncspec.server.client_channel import ChannelSecurity

    return ChannelSecurity(tls=args.tls, ca_file=args.tls_ca_file, server_name=args.tls_server_name)


def _default_dataset() -> str:
    """The bundled model's benchmark prompts: a source checkout's benchmarks/data, else the installed package's
    copy (asyncspec.bench_data, pyproject.toml's package data)."""
    from pathlib import Path

    package = Path(__file__).resolve().parent
    name = "prompts-code.jsonl"
    checkout = package.parent / "benchmarks" / "data" / name
    installed = package / "bench_data" / name
    return str(installed if not checkout.is_file() and installed.is_file() else checkout)


def _token(args: argparse.Namespace) -> str | None:
    from asyncspec.server.app import AUTH_TOKEN_ENV

    if args.auth_token_file:
        try:
            with open(args.auth_token_file) as f:
                return f.read().strip()
        except OSError as e:
            raise ConfigError(f"cannot read --auth-token-file {args.auth_token_file!r}: {e}") from None
    return os.environ.get(AUTH_TOKEN_ENV, "").strip() or None


def _bench(args: argparse.Namespace) -> int:
    from asyncspec.server import bench

    if not os.path.isfile(args.dataset):
        where = (
            " (the default, which a source checkout and the package hold)" if args.dataset == _default_dataset() else ""
        )
        raise ConfigError(
            f"dataset {args.dataset!r} does not exist{where}: pass --dataset FILE, a JSONL of prompt_token_ids lists"
        )
    for name, value, ok in (
        ("--num-prompts", args.num_prompts, args.num_prompts >= 1),
        ("--max-tokens", args.max_tokens, args.max_tokens >= 1),
        ("--concurrency", args.concurrency, args.concurrency >= 1),
        ("--request-rate", args.request_rate, args.request_rate is None or args.request_rate > 0),
    ):
        if not ok:
            raise ConfigError(f"{name} must be positive, got {value}")
    cfg = bench.BenchConfig(
        address=args.address,
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        seed=args.seed,
        token=_token(args),
        security=_channel_security(args),
    )
    return bench.main(cfg, args.output)


def _generate_remote(args: argparse.Namespace) -> int:
    import grpc

    from asyncspec.v1 import asyncspec_pb2 as pb
    from asyncspec.v1 import asyncspec_pb2_grpc as pb_grpc

    token = _token(args)
    metadata = [("authorization", f"Bearer {token}")] if token else None
    request = pb.GenerateRequest(
        text=_newlines(args.prompt),
        sampling=pb.SamplingOptions(temperature=args.temperature),
        stopping=pb.StoppingOptions(max_tokens=args.max_tokens),
    )
    if args.seed is not None:
        request.sampling.seed = args.seed
    with _channel_security(args).channel(args.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        try:
            last = None
            for response in stub.Generate(request, timeout=args.timeout, metadata=metadata):
                sys.stdout.write(response.text)
                sys.stdout.flush()
                last = response
        except grpc.RpcError as e:
            sys.stderr.write(f"\nasyncspec generate: error: {e.code().name}: {e.details()}\n")
            return 1
    if last is not None:
        usage = last.usage
        reason = pb.FinishReason.Name(last.finish_reason)
        sys.stderr.write(f"\n--- {reason}, {usage.completion_tokens} tokens (prompt {usage.prompt_tokens})\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
