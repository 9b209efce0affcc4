"""Command line: `python -m asyncspec.cli --prompt "def f(" --max-tokens 64 [--engine-option value ...]`.

Engine flags are EngineConfig's fields with dashes, generated from the dataclass so they never drift.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import sys
import time
import types
import typing
from collections.abc import Sequence
from typing import Any

from asyncspec.config import EngineConfig


def _field_parser(tp: Any):
    """The argparse `type` for a field annotation (Optional[X] accepts "none")."""
    origin = typing.get_origin(tp)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    # `Optional[X]` has origin typing.Union, `X | None` has types.UnionType (the same object from 3.14).
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        inner = _field_parser(args[0])
        return lambda s: None if s.lower() == "none" else inner(s)
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


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(EngineConfig)
    docs = _field_docs()
    for f in dataclasses.fields(EngineConfig):
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=_field_parser(hints[f.name]),
            default=f.default,
            help=f"{docs.get(f.name, '')} (default: {f.default})",
        )


def _field_docs() -> dict[str, str]:
    """Field docstrings, read from the source so the CLI help matches the dataclass."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(EngineConfig))
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


def main(argv: Sequence[str] | None = None) -> int:
    from asyncspec import LLM, SamplingParams

    parser = argparse.ArgumentParser(description="Generate text with asyncspec.")
    parser.add_argument("--prompt", action="append", help="prompt text (repeatable); \\n is a newline")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed-request", type=int, default=None, help="per-request sampling seed")
    parser.add_argument("--log-level", default="INFO", help="start-up progress (CUDA graph capture) goes to stderr")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prompts = [p.encode().decode("unicode_escape") for p in (args.prompt or ["def fibonacci(n):\\n"])]
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


if __name__ == "__main__":
    raise SystemExit(main())
