"""The CLI flags are EngineConfig's fields with dashes, parsed into the same types."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from asyncspec.cli import add_engine_args, engine_config_from_args, generate_offline_main
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
            "--async-scheduling",
            "false",
        ]
    )
    assert engine_config_from_args(_parser().parse_args(["--async-scheduling", "none"])).async_scheduling is None
    config = engine_config_from_args(args)
    assert config.max_num_seqs == 8 and config.gpu_memory_utilization == 0.5
    assert config.enable_prefix_caching is False and config.num_kv_blocks is None
    assert config.max_model_len == 256 and config.scheduling_policy == "priority"
    assert config.async_scheduling is False


def test_bad_values_are_refused():
    with pytest.raises(SystemExit):
        _parser().parse_args(["--enable-prefix-caching", "maybe"])
    with pytest.raises(SystemExit):
        _parser().parse_args(["--max-num-seqs", "eight"])
    with pytest.raises(ConfigError, match="max_num_seqs"):
        engine_config_from_args(_parser().parse_args(["--max-num-seqs", "0"]))


def test_generate_command_runs_on_the_bundled_model(capsys):
    assert (
        generate_offline_main(
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
    assert generate_offline_main(common) == 0
    plain = capsys.readouterr().out.split("\n")[:2]
    assert generate_offline_main([*common, "--speculative-method", method, "--num-speculative-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.split("\n")[:2] == plain
    assert f"speculation ({method}, k=4)" in out and "tokens per target step" in out


# -- asyncspec serve / generate -----------------------------------------------------------------------
def test_serve_help_has_every_engine_and_server_flag(capsys):
    from asyncspec.cli import main
    from asyncspec.server.app import ServerConfig

    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for f in [*dataclasses.fields(EngineConfig), *dataclasses.fields(ServerConfig)]:
        assert "--" + f.name.replace("_", "-") in text, f.name


def test_serve_errors_are_one_line_and_non_zero(capsys, tmp_path):
    import socket

    from asyncspec.cli import main

    assert main(["serve", "--model", str(tmp_path / "missing"), "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("asyncspec serve: error:") and "missing" in err and len(err.splitlines()) == 1
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["serve", "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "-1"]
        assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("asyncspec serve: error:") and str(port) in err


def test_serve_flag_mistakes_are_one_line_errors(capsys, tmp_path):
    import shutil

    from asyncspec.cli import main
    from tests.conftest import TARGET_MODEL

    with pytest.raises(SystemExit) as e:
        main(["serve", "--log-level", "bogus"])
    assert e.value.code == 2 and "--log-level" in capsys.readouterr().err
    assert main(["generate", "--auth-token-file", str(tmp_path / "none"), "x"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("asyncspec generate: error:") and "--auth-token-file" in err
    # Another model: the bundled draft is not its default, and the error says what to pass.
    other = tmp_path / "other"
    shutil.copytree(TARGET_MODEL, other)
    assert main(["serve", "--model", str(other), "--device", "cpu", "--metrics-port", "-1"]) == 1
    err = capsys.readouterr().err.strip()
    assert "--speculative-method none" in err and len(err.splitlines()) == 1


def test_bench_without_its_dataset_says_what_to_pass(capsys, tmp_path):
    from asyncspec.cli import main

    assert main(["bench", "--dataset", str(tmp_path / "prompts.jsonl")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("asyncspec bench: error:") and "pass --dataset FILE" in err and len(err.splitlines()) == 1


def test_serve_speculation_none_alone_turns_it_off(monkeypatch, tmp_path):
    """`--speculative-method none` needs no `--num-speculative-tokens 0` beside it."""
    import shutil

    from asyncspec import cli
    from tests.conftest import TARGET_MODEL

    seen = {}

    def fake_run(engine_config, server_config):
        seen["config"] = engine_config
        return 0

    monkeypatch.setattr("asyncspec.server.app.run", fake_run)
    other = tmp_path / "other"
    shutil.copytree(TARGET_MODEL, other)
    assert cli.main(["serve", "--model", str(other), "--device", "cpu", "--speculative-method", "none"]) == 0
    assert seen["config"].speculative_method is None and seen["config"].num_speculative_tokens == 0
    assert cli.main(["serve", "--device", "cpu"]) == 0  # the bundled target keeps its draft at k = 4
    assert seen["config"].speculative_method == "draft_model" and seen["config"].num_speculative_tokens == 4


@pytest.mark.parametrize("engine_process", [False, True], ids=["in-process", "engine-process"])
def test_serve_process_streams_then_drains_on_sigterm(tmp_path, engine_process: bool):
    """The console script as an operator runs it: from another directory, on an ephemeral port; a
    client streams a completion; SIGTERM drains and the process exits 0 (with --engine-process, the
    engine's process is gone too)."""
    import os
    import re
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    exe = Path(sys.executable).parent / "asyncspec"
    if not exe.exists():
        pytest.skip("the asyncspec console script is not installed in this environment")
    proc = subprocess.Popen(
        [
            str(exe),
            "serve",
            "--device",
            "cpu",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--metrics-port",
            "-1",
            "--max-model-len",
            "256",
            "--num-kv-blocks",
            "32",
            "--drain-grace-s",
            "5",
            *([] if engine_process else ["--engine-process", "false"]),  # the default runs the engine apart
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        line = proc.stdout.readline()
        match = re.search(r"on 127\.0\.0\.1:(\d+)", line)
        assert match, line
        gen = subprocess.run(
            [str(exe), "generate", "def f(x):\\n", "--address", f"127.0.0.1:{match.group(1)}", "--max-tokens", "8"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert gen.returncode == 0 and "FINISH_REASON_LENGTH, 8 tokens" in gen.stderr, gen.stderr
        children = _children(proc.pid)
        assert bool(children) == engine_process, children
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        deadline = time.monotonic() + 30  # multiprocessing's resource tracker leaves once serve's pipe closes
        while any(Path(f"/proc/{child}").exists() and not _zombie(child) for child in children):
            assert time.monotonic() < deadline, f"children {children} outlived serve"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()


def _children(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (from /proc)."""
    from pathlib import Path

    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def _zombie(pid: int) -> bool:
    from pathlib import Path

    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] == "Z"
    except OSError:
        return True


def test_generate_command_sends_non_ascii_and_backslashes_as_typed(capsys):
    """Only the documented `\\n` is an escape: a prompt with accents, CJK and a backslash (a Windows path, a regex)
    reaches the model as typed, the same ids as the Python API's."""
    from asyncspec import LLM, SamplingParams

    typed = '# café 日本語: C:\\x "\\d+"\\n'
    meant = '# café 日本語: C:\\x "\\d+"\n'
    common = ["--model", str(TARGET_MODEL), "--device", "cpu", "--dtype", "float32", "--max-tokens", "4"]
    common += ["--max-model-len", "256", "--num-kv-blocks", "64", "--speculative-method", "none"]
    assert generate_offline_main([*common, "--prompt", typed]) == 0
    printed = capsys.readouterr().out.split("\n", 1)[1]
    expected = LLM(str(TARGET_MODEL), device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=64).generate(
        [meant], SamplingParams(temperature=0.0, max_tokens=4)
    )[0]
    assert printed.startswith(meant + expected.text)


def test_an_argument_file_first_and_a_prompt_that_starts_with_at(tmp_path, capsys):
    """`asyncspec @FILE` (the ConfigMap's form) reads FILE's lines as arguments; a later argument starting with @
    (a decorator in a prompt) is text, not a file to read."""
    from asyncspec.cli import main

    args = tmp_path / "serve.args"
    args.write_text("serve\n--device\ncpu\n\n--port\n70000\n--metrics-port\n-1\n")
    assert main([f"@{args}"]) == 1  # read, parsed, then refused before anything starts
    assert "port must be in [0, 65535] (0: ephemeral), got 70000" in capsys.readouterr().err
    prompt = "@property\\ndef name(self):"
    assert main(["generate", "--address", "127.0.0.1:1", "--timeout", "5", prompt]) == 1
    err = capsys.readouterr().err
    assert "UNAVAILABLE" in err and "No such file" not in err
    with pytest.raises(SystemExit) as e:
        main([f"@{tmp_path / 'missing.args'}"])
    assert e.value.code == 2 and "cannot read the argument file" in capsys.readouterr().err


def test_a_bad_switch_in_the_environment_is_one_line_not_a_traceback(monkeypatch, capsys):
    monkeypatch.setenv("ASYNCSPEC_ATTENTION_BACKEND", "bogus")
    common = ["--model", str(TARGET_MODEL), "--device", "cpu", "--max-tokens", "2", "--speculative-method", "none"]
    assert generate_offline_main(common) == 1
    err = capsys.readouterr().err
    assert "ASYNCSPEC_ATTENTION_BACKEND must be 'torch' or 'triton'" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "lines, args, message",
    [
        ("", [], "holds no prompts"),
        ('{"prompt": [1, 2]}\n', [], 'prompts.jsonl:1: not a JSON object with "prompt_token_ids"'),
        ('{"prompt_token_ids": [1]}\nnot json\n', [], "prompts.jsonl:2: not a JSON object"),
        ('{"prompt_token_ids": []}\n', [], "prompts.jsonl:1: prompt_token_ids must be a non-empty list"),
        ('{"prompt_token_ids": [1]}\n', ["--concurrency", "-1"], "--concurrency must be positive"),
        ('{"prompt_token_ids": [1]}\n', ["--request-rate", "0"], "--request-rate must be positive"),
    ],
)
def test_bench_input_errors_are_one_line(capsys, tmp_path, lines, args, message):
    from asyncspec.cli import main

    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(lines)
    assert main(["bench", "--address", "127.0.0.1:1", "--dataset", str(dataset), *args]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1, err


def test_boolean_flags_alone_mean_true_and_bad_values_name_their_type(capsys):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--enforce-eager", "--enable-prefix-caching", "false"])
    assert args.enforce_eager is True and args.enable_prefix_caching is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-model-len", "lots"])
    assert "invalid int value: 'lots'" in capsys.readouterr().err
