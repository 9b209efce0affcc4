"""The CLI flags are EngineConfig's fields with dashes, parsed into the same types."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from asyncspec.cli import add_engine_args, engine_config_from_args, main
from asyncspec.config import EngineConfig
from asyncspec.errors import ConfigError
from tests.conftest import TARGET_MODEL


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser


def test_every_config_field_is_a_flag_and_defaults_match():
    args = _parser().parse_args([])
    assert engine_config_from_args(args) == EngineConfig()
    flags = {a.dest for a in _parser()._actions}
    assert {f.name for f in dataclasses.fields(EngineConfig)} <= flags


def test_flags_parse_into_typed_fields():
    args = _parser().parse_args(
        [
            "--max-num-seqs",
            "8",
            "--gpu-memory-utilization",
            "0.5",
            "--enable-prefix-caching",
            "false",
            "--num-kv-blocks",
            "none",
            "--max-model-len",
            "256",
            "--scheduling-policy",
            "priority",
        ]
    )
    config = engine_config_from_args(args)
    assert config.max_num_seqs == 8 and config.gpu_memory_utilization == 0.5
    assert config.enable_prefix_caching is False and config.num_kv_blocks is None
    assert config.max_model_len == 256 and config.scheduling_policy == "priority"


def test_bad_values_are_refused():
    with pytest.raises(SystemExit):
        _parser().parse_args(["--enable-prefix-caching", "maybe"])
    with pytest.raises(SystemExit):
        _parser().parse_args(["--max-num-seqs", "eight"])
    with pytest.raises(ConfigError, match="max_num_seqs"):
        engine_config_from_args(_parser().parse_args(["--max-num-seqs", "0"]))


def test_generate_command_runs_on_the_bundled_model(capsys):
    assert (
        main(
            [
                "--model",
                str(TARGET_MODEL),
                "--device",
                "cpu",
                "--prompt",
                "def f(x):\\n",
                "--max-tokens",
                "8",
                "--max-model-len",
                "256",
                "--num-kv-blocks",
                "32",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "finish: length, 8 tokens" in out and out.splitlines()[1].startswith("def f(x):")


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_generate_command_with_speculation_prints_the_same_text(capsys, method):
    common = ["--model", str(TARGET_MODEL), "--device", "cpu", "--dtype", "float32", "--prompt", "import os\\n"]
    common += ["--max-tokens", "24", "--max-model-len", "256", "--num-kv-blocks", "64"]
    assert main(common) == 0
    plain = capsys.readouterr().out.split("\n")[:2]
    assert main([*common, "--speculative-method", method, "--num-speculative-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.split("\n")[:2] == plain
    assert f"speculation ({method}, k=4)" in out and "tokens per target step" in out
