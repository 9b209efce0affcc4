"""tensor_parallel_size=2 on the CPU (gloo, two worker processes, fp32): greedy output equals one
process token for token (bundled pair with its draft, tiny random models of every family, a model
with fewer KV heads than ranks), in both loops; a worker that dies or fails ends every stream with a
clear error, stops the other ranks and frees the KV pool."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from asyncspec import LLM, SamplingParams
from asyncspec.engine.async_engine import AsyncEngine
from asyncspec.errors import ConfigError, EngineDeadError, ModelLoadError, WorkerDiedError
from asyncspec.worker.tp_executor import (
    STORE_DIR_PREFIX,
    TensorParallelExecutor,
    make_store_dir,
    remove_stale_store_dirs,
)
from tests.conftest import TARGET_MODEL, load_prompts
from tests.engine.engine_helpers import assert_kv_free
from tests.engine.test_tiny_families import _TINY, FAMILIES
from tests.hf_tiny_models import save_random_hf_model

CPU = dict(device="cpu", dtype="float32")
BUNDLED = dict(block_size=16, max_model_len=512, num_kv_blocks=96, max_num_batched_tokens=128, max_num_seqs=8, **CPU)


def _executor(llm: LLM) -> TensorParallelExecutor:
    runner = llm.engine.engine_core.runner
    assert isinstance(runner, TensorParallelExecutor)
    return runner


def _pids(executor: TensorParallelExecutor) -> list[int]:
    return [p.pid for p in executor._procs if p.pid is not None]


def _assert_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 15
    for pid in pids:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            # A zombie counts as gone once its parent reaped it: join() in close() does.
            assert time.monotonic() < deadline, f"worker {pid} still running"
            time.sleep(0.05)


def _greedy(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize(
    "spec,async_scheduling,scheduler_steps",
    [(None, False, 1), ("draft_model", True, 1), (None, True, 4)],
    ids=["plain-sync", "draft-async", "multi-step-async"],
)
def test_bundled_pair_tp2_equals_tp1(spec, async_scheduling, scheduler_steps) -> None:
    prompts = [p[:60] for p in load_prompts(6)]
    kwargs = dict(async_scheduling=async_scheduling, num_scheduler_steps=scheduler_steps, **BUNDLED)
    if spec:
        kwargs.update(speculative_method=spec, num_speculative_tokens=4)
    with LLM(str(TARGET_MODEL), **kwargs) as single:
        reference = _greedy(single, prompts, 32)
    with LLM(str(TARGET_MODEL), tensor_parallel_size=2, **kwargs) as llm:
        pids = _pids(_executor(llm))
        assert len(pids) == 2
        assert _greedy(llm, prompts, 32) == reference
        stats = llm.stats()
        assert_kv_free(stats)
        if spec:
            assert stats["spec_num_accepted_tokens"] > 0
        if scheduler_steps > 1:  # 32 tokens each: plans of several steps, not 32 plans
            assert stats["num_steps"] < 20, stats["num_steps"]
    _assert_gone(pids)


TP_FAMILIES = {
    **FAMILIES,
    # One KV head for two ranks (replicated), and a vocabulary that does not split evenly.
    "llama-mqa-odd-vocab": (FAMILIES["llama-untied"][0], FAMILIES["llama-untied"][1], dict(num_key_value_heads=1)),
}


@pytest.mark.parametrize("family", list(TP_FAMILIES))
def test_tiny_family_tp2_equals_tp1(family, tmp_path) -> None:
    cfg_cls, model_cls, overrides = TP_FAMILIES[family]
    config = {**_TINY, **overrides}
    if family == "llama-mqa-odd-vocab":
        config["vocab_size"] = 509
    save_random_hf_model(cfg_cls, model_cls, config, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TARGET_MODEL / name, tmp_path / name)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 23, 11, 40)]
    # Chunked prefill (16-token budget) and, in the asynchronous loop, n-gram speculation.
    kwargs = dict(block_size=4, max_model_len=64, num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=4, **CPU)
    if family in ("qwen2", "llama-mqa-odd-vocab"):
        kwargs.update(async_scheduling=True, speculative_method="ngram", num_speculative_tokens=3)
    with LLM(str(tmp_path), skip_tokenizer_init=True, **kwargs) as single:
        reference = _greedy(single, prompts, 16)
    with LLM(str(tmp_path), skip_tokenizer_init=True, tensor_parallel_size=2, **kwargs) as llm:
        assert _greedy(llm, prompts, 16) == reference
        assert_kv_free(llm.stats())


@pytest.mark.parametrize(
    "processes", [dict(tensor_parallel_size=2), dict(worker_process=True)], ids=["tp2", "worker-process"]
)
def test_a_sigterm_to_the_ranks_leaves_them_to_the_engine(processes) -> None:
    """A supervisor's SIGTERM to the whole process group (systemd, supervisord's stopasgroup) reaches the ranks
    while the server drains: they keep serving until the engine stops them, as the engine process does."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [p[:30] for p in load_prompts(2)]
    with LLM(str(TARGET_MODEL), **BUNDLED) as single:
        reference = [o.token_ids for o in single.generate(prompts, params)]
    with LLM(str(TARGET_MODEL), **BUNDLED, **processes) as llm:
        pids = _pids(_executor(llm))
        llm.generate(prompts[:1], params)  # every rank started and stepped
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        time.sleep(0.5)
        assert [o.token_ids for o in llm.generate(prompts, params)] == reference
    _assert_gone(pids)


def test_a_script_without_a_main_guard_is_told_what_to_add(tmp_path) -> None:
    """Each spawned rank imports the main script: one that starts the engine at import time makes the rank fail
    before it can report, and the error says what to change (as vLLM warns)."""
    script = tmp_path / "no_guard.py"
    script.write_text(
        "from asyncspec import LLM\n"
        f"llm = LLM({str(TARGET_MODEL)!r}, device='cpu', dtype='float32', max_model_len=256, num_kv_blocks=32,"
        " tensor_parallel_size=2)\n"
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert "WorkerDiedError" in last and 'if __name__ == "__main__":' in last, last


def test_rendezvous_directories_of_dead_engines_are_removed(tmp_path) -> None:
    """An engine killed hard (SIGKILL, os._exit) leaves its ranks' rendezvous directory behind; the next one
    started removes those whose process has exited, and no other."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    names = {
        "dead": f"{STORE_DIR_PREFIX}{dead.pid}-abc",
        "alive": f"{STORE_DIR_PREFIX}{os.getpid()}-def",
        "old-style": f"{STORE_DIR_PREFIX}h9n0tir_",
        "other": f"other-{dead.pid}-x",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "store").write_text("x")
    remove_stale_store_dirs(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(v for k, v in names.items() if k != "dead")
    store = make_store_dir()
    try:
        assert os.path.basename(store).startswith(f"{STORE_DIR_PREFIX}{os.getpid()}-")
    finally:
        shutil.rmtree(store)


@pytest.mark.parametrize(
    ("processes", "killed"),
    [(dict(tensor_parallel_size=2), 1), (dict(worker_process=True), 0)],
    ids=["tp2-rank1", "worker-process"],
)
def test_killed_worker_ends_every_stream_and_frees_everything(processes, killed) -> None:
    async def main() -> None:
        engine = AsyncEngine(_config(async_scheduling=True, **processes))
        executor = engine.engine.engine_core.runner
        assert isinstance(executor, TensorParallelExecutor)
        pids = _pids(executor)
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        first_tokens = asyncio.Event()

        async def consume(i: int) -> BaseException | None:
            try:
                async for _ in engine.generate(load_prompts(3)[i][:40], params, request_id=f"r{i}"):
                    first_tokens.set()
            except BaseException as e:
                return e
            return None

        tasks = [asyncio.create_task(consume(i)) for i in range(3)]
        await asyncio.wait_for(first_tokens.wait(), 60)
        os.kill(pids[killed], signal.SIGKILL)
        errors = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        for error in errors:
            assert isinstance(error, EngineDeadError), error
            assert f"rank {killed}" in str(error) and "signal 9" in str(error), error
        assert_kv_free(engine.engine.stats())
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate([1, 2, 3], params):
                pass
        await engine.shutdown()
        _assert_gone(pids)

    asyncio.run(main())


def test_worker_dying_while_idle_is_noticed_without_a_request() -> None:
    async def main() -> None:
        engine = AsyncEngine(_config(tensor_parallel_size=2))
        deaths: list[EngineDeadError] = []
        engine.add_death_listener(deaths.append)
        params = SamplingParams(temperature=0.0, max_tokens=4)
        async for _ in engine.generate([5, 6, 7], params):  # the loop runs, then idles
            pass
        executor = engine.engine.engine_core.runner
        assert isinstance(executor, TensorParallelExecutor)
        pids = _pids(executor)
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not deaths and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert deaths and "rank 0" in str(deaths[0])
        _assert_gone(pids)
        await engine.shutdown()

    asyncio.run(main())


def _config(**overrides):
    from asyncspec.config import make_config

    return make_config(str(TARGET_MODEL), skip_tokenizer_init=True, **{**BUNDLED, **overrides})


def test_worker_failing_to_load_raises_its_error_and_leaves_no_process(tmp_path) -> None:
    save_random_hf_model(*FAMILIES["llama-untied"][:2], dict(_TINY), tmp_path)
    # A checkpoint whose tensor has the wrong shape: each rank finds it while slicing its shard.
    from safetensors.torch import load_file, save_file

    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"] = weights["model.layers.1.mlp.down_proj.weight"][:, :-2].clone()
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    before = set(_children())
    with pytest.raises(ModelLoadError, match="shape mismatch for tensor 'model.layers.1.mlp.down_proj.weight'"):
        LLM(str(tmp_path), skip_tokenizer_init=True, tensor_parallel_size=2, **CPU)
    deadline = time.monotonic() + 15
    while set(_children()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(_children()) - before


def _children() -> list[int]:
    import multiprocessing

    return [p.pid for p in multiprocessing.active_children() if p.pid is not None]


def test_bad_sizes_are_refused_before_any_process_starts(tmp_path) -> None:
    before = set(_children())
    with pytest.raises(ConfigError, match="tensor_parallel_size must be a positive integer"):
        LLM(str(TARGET_MODEL), tensor_parallel_size=0, **CPU)
    with pytest.raises(ConfigError, match="num_attention_heads=6 is not divisible by tensor_parallel_size=4"):
        LLM(str(TARGET_MODEL), tensor_parallel_size=4, **CPU)
    with pytest.raises(ConfigError, match="num_key_value_heads=2 is below tensor_parallel_size=3"):
        LLM(str(TARGET_MODEL), tensor_parallel_size=3, **CPU)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"needs cuda:0 to cuda:1, but 0 GPU\(s\) are visible"):
            LLM(str(TARGET_MODEL), tensor_parallel_size=2, device="cuda")
    assert set(_children()) == before


def test_a_closed_executor_refuses_steps() -> None:
    llm = LLM(str(TARGET_MODEL), tensor_parallel_size=2, skip_tokenizer_init=True, **BUNDLED)
    pids = _pids(_executor(llm))
    llm.shutdown()
    llm.shutdown()  # idempotent
    _assert_gone(pids)
    with pytest.raises(WorkerDiedError):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))


def test_a_rank_failing_in_a_step_reports_its_own_error() -> None:
    """A rank that fails in a command nobody waits a reply to (a launch, or a collect on a rank
    other than 0) exits with status 1, and the engine raises that rank's error, not a bare exit."""
    with LLM(str(TARGET_MODEL), tensor_parallel_size=2, skip_tokenizer_init=True, **BUNDLED) as llm:
        executor = _executor(llm)
        pids = _pids(executor)
        executor._send("no_such_command", (), "none")  # every rank raises AttributeError, replying to nobody
        deadline = time.monotonic() + 15
        while all(p.is_alive() for p in executor._procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(WorkerDiedError, match="AttributeError.*no_such_command"):
            executor.check_health()
        with pytest.raises(WorkerDiedError):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    _assert_gone(pids)


def test_a_killed_rank_is_named_when_its_peer_reports_the_broken_collective() -> None:
    """A rank killed mid-collective makes its peers fail with a transport error (a reset connection) that may
    reach the engine before the kill does: the error names the killed rank, and keeps the reporter's error."""
    with LLM(str(TARGET_MODEL), tensor_parallel_size=2, skip_tokenizer_init=True, **BUNDLED) as llm:
        executor = _executor(llm)
        pids = _pids(executor)
        os.kill(pids[1], signal.SIGKILL)
        reset = RuntimeError("Connection reset by peer")
        with pytest.raises(
            WorkerDiedError,
            match=r"rank 1 exited \(pid \d+ killed by signal 9\) and rank 0 failed "
            r"during collect: RuntimeError\('Connection reset by peer'\)",
        ):
            executor._raise_error(0, "collect", ("error", reset, "Traceback: ..."))
        with pytest.raises(WorkerDiedError, match="rank 1 exited"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # the engine stays dead with that error
    _assert_gone(pids)


def test_a_rank_failing_alone_is_named_alone() -> None:
    """A rank that reports an error while every other rank still runs is the one named (after a short grace for
    a peer's exit)."""
    with LLM(str(TARGET_MODEL), tensor_parallel_size=2, skip_tokenizer_init=True, **BUNDLED) as llm:
        executor = _executor(llm)
        pids = _pids(executor)
        with pytest.raises(WorkerDiedError) as e:
            executor._raise_error(1, "collect", ("error", ValueError("bad step"), "Traceback: ..."))
        assert str(e.value) == "tensor-parallel rank 1 failed during collect: ValueError('bad step')"
    _assert_gone(pids)


def test_ranks_that_part_are_caught_in_debug_mode() -> None:
    """Debug mode (on in every test) compares every rank's step results; the comparison names the
    first field where a rank parted from rank 0."""
    from asyncspec.core.scheduler_output import ModelRunnerOutput
    from asyncspec.worker.tp_executor import check_ranks_agree

    same = [ModelRunnerOutput(["a", "b"], [[5], [7, 8]], num_draft_tokens=[0, 1]) for _ in range(2)]
    check_ranks_agree(same)
    parted = [same[0], ModelRunnerOutput(["a", "b"], [[5], [7, 9]], num_draft_tokens=[0, 1])]
    with pytest.raises(AssertionError, match="rank 1 parted from rank 0 in sampled_token_ids"):
        check_ranks_agree(parted)


def test_debug_mode_compares_every_rank_in_real_steps() -> None:
    """With ASYNCSPEC_DEBUG_INVARIANTS=1 (tests/conftest.py) the executor asks all ranks for each
    step's results: a seeded stochastic run and speculation keep them identical."""
    with LLM(
        str(TARGET_MODEL),
        tensor_parallel_size=2,
        async_scheduling=True,
        speculative_method="draft_model",
        num_speculative_tokens=4,
        skip_tokenizer_init=True,
        **BUNDLED,
    ) as llm:
        assert _executor(llm)._debug
        params = [SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=24) for i in range(4)]
        outs = llm.generate([p[:40] for p in load_prompts(4)], params)
        assert all(len(o.token_ids) > 0 for o in outs)
        assert_kv_free(llm.stats())


def test_every_rank_writes_its_own_profile(tmp_path) -> None:
    import json

    from asyncspec.errors import ProfilerError

    with LLM(str(TARGET_MODEL), tensor_parallel_size=2, skip_tokenizer_init=True, **BUNDLED) as llm:
        llm.start_profile(tmp_path)
        with pytest.raises(ProfilerError, match="already running"):  # refused here: no rank is disturbed
            llm.start_profile(tmp_path)
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=4))
        summaries = llm.stop_profile()
        assert [s.process for s in summaries] == ["rank0", "rank1"]
        for s in summaries:
            events = json.loads(open(s.trace_path).read())["traceEvents"]
            assert any(e.get("name") == "aten::embedding" for e in events)
        assert (
            llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=4))[0].token_ids == out[0].token_ids
        )


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_worker_process_of_one_equals_the_in_process_runner(async_scheduling) -> None:
    """worker_process=True with tensor_parallel_size=1: the model runs in one worker process (the
    server's streams then never share an interpreter lock with it); greedy output is unchanged, with
    the draft model, and the process goes away with the engine."""
    prompts = [p[:60] for p in load_prompts(4)]
    kwargs = dict(async_scheduling=async_scheduling, speculative_method="draft_model", num_speculative_tokens=4)
    with LLM(str(TARGET_MODEL), **kwargs, **BUNDLED) as single:
        assert not isinstance(single.engine.engine_core.runner, TensorParallelExecutor)
        reference = _greedy(single, prompts, 24)
    with LLM(str(TARGET_MODEL), worker_process=True, **kwargs, **BUNDLED) as llm:
        pids = _pids(_executor(llm))
        assert len(pids) == 1 and pids[0] != os.getpid()
        assert _greedy(llm, prompts, 24) == reference
        stats = llm.stats()
        assert_kv_free(stats)
        assert stats["spec_num_accepted_tokens"] > 0
    _assert_gone(pids)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("processes", "debug"),
    [(dict(worker_process=True), False), (dict(tensor_parallel_size=2), True)],
    ids=["worker-process", "tp2-debug"],
)
def test_ctrl_c_while_a_step_is_collected_leaves_the_engine_usable(monkeypatch, tmp_path, processes, debug) -> None:
    """KeyboardInterrupt lands while LLM.generate waits for a step's results from the worker processes: the
    generate call raises it and aborts its requests, and the next call runs on the same engine and returns what a
    fresh engine returns (the interrupted step's results, arriving late, are not taken for a later step's)."""
    from asyncspec.worker import tp_executor

    prompts = [p[:40] for p in load_prompts(3)]
    kwargs = dict(async_scheduling=True, speculative_method="draft_model", num_speculative_tokens=3)
    with LLM(str(TARGET_MODEL), **kwargs, **BUNDLED) as single:
        reference = _greedy(single, prompts, 20)
    with LLM(str(TARGET_MODEL), **kwargs, **processes, **BUNDLED) as llm:
        executor = _executor(llm)
        if debug:
            executor.set_debug_invariants(True)
        real_wait = tp_executor.wait
        waits_in_collect = []

        def interrupted_wait(*args, **kw):
            if executor._collect_ranks is not None:
                waits_in_collect.append(1)
                if len(waits_in_collect) == 6:
                    raise KeyboardInterrupt
            return real_wait(*args, **kw)

        monkeypatch.setattr(tp_executor, "wait", interrupted_wait)
        with pytest.raises(KeyboardInterrupt):
            _greedy(llm, prompts, 60)
        assert len(waits_in_collect) == 6
        # A command that waits for replies, before the next generate: the interrupted collect's replies come
        # first in the pipes, and are the next collect's, not the command's.
        llm.start_profile(tmp_path, with_cpu=False)
        summaries = llm.stop_profile()
        assert len(summaries) == executor.size
        assert _greedy(llm, prompts, 20) == reference
        assert_kv_free(llm.stats())


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "processes", [dict(worker_process=True), dict(tensor_parallel_size=2)], ids=["worker-process", "tp2"]
)
def test_ctrl_c_while_a_command_waits_for_its_replies_leaves_the_engine_usable(
    monkeypatch, tmp_path, processes
) -> None:
    """As the collect case above, for a command of another kind: Ctrl-C while stop_profile waits for the ranks'
    replies. They arrive later, and the next call drops them instead of taking them for its own (a step's results,
    or the next command's)."""
    from asyncspec.worker import tp_executor

    prompts = [p[:40] for p in load_prompts(2)]
    with LLM(str(TARGET_MODEL), **BUNDLED) as single:
        reference = _greedy(single, prompts, 8)
    with LLM(str(TARGET_MODEL), **processes, **BUNDLED) as llm:
        executor = _executor(llm)
        real_wait = tp_executor.wait
        armed = [True]

        def interrupted_wait(*args, **kw):
            if armed[0]:
                armed[0] = False
                raise KeyboardInterrupt
            return real_wait(*args, **kw)

        llm.start_profile(tmp_path / "first", with_cpu=False)
        monkeypatch.setattr(tp_executor, "wait", interrupted_wait)
        with pytest.raises(KeyboardInterrupt):
            llm.stop_profile()
        monkeypatch.setattr(tp_executor, "wait", real_wait)
        assert _greedy(llm, prompts, 8) == reference
        llm.start_profile(tmp_path / "second", with_cpu=False)  # a command after the step: its own replies
        assert len(llm.stop_profile()) == executor.size
        assert _greedy(llm, prompts, 8) == reference
        assert_kv_free(llm.stats())


def test_a_worker_dead_during_a_collect_fails_every_later_call_the_same_way(monkeypatch) -> None:
    """The worker dies while a step is collected: that generate raises WorkerDiedError, and so does every later
    one (the step it left in flight is not waited for again on closed pipes)."""
    from asyncspec.worker import tp_executor

    with LLM(str(TARGET_MODEL), async_scheduling=True, worker_process=True, **BUNDLED) as llm:
        executor = _executor(llm)
        real_wait = tp_executor.wait
        waits_in_collect = []

        def killing_wait(*args, **kw):
            if executor._collect_ranks is not None:
                waits_in_collect.append(1)
                if len(waits_in_collect) == 5:
                    os.kill(executor._procs[0].pid, signal.SIGKILL)
            return real_wait(*args, **kw)

        monkeypatch.setattr(tp_executor, "wait", killing_wait)
        for _ in range(3):
            with pytest.raises(WorkerDiedError):
                _greedy(llm, [p[:40] for p in load_prompts(3)], 60)


_ENGINE_EXITS_WITH_A_STUCK_STEP = """
import os, signal, sys, threading, time
from asyncspec import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, device="cpu", dtype="float32", block_size=16, max_model_len=256,
          num_kv_blocks=64)
pids = [p.pid for p in llm.engine.engine_core.runner._procs]
print(*pids, flush=True)
os.kill(pids[1], signal.SIGSTOP)
params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
threading.Thread(target=llm.generate, args=([[5, 6, 7, 8]], params), daemon=True).start()
time.sleep(float(sys.argv[2]))
os._exit(0)
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for a reaper that a container may lack)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.timeout(180)
def test_ranks_exit_with_an_engine_that_exits_while_a_step_is_stuck() -> None:
    """Rank 1 is stopped (SIGSTOP), so rank 0's step waits in a collective for it, and the engine's process exits
    with os._exit (as serve's bounded shutdown does, skipping the ranks' clean-up): rank 0 exits at once rather than
    wait for its step, and rank 1 does as soon as it runs again."""
    import subprocess
    import sys

    engine = subprocess.Popen(
        [sys.executable, "-c", _ENGINE_EXITS_WITH_A_STUCK_STEP, str(TARGET_MODEL), "3"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert engine.stdout is not None
    pids = [int(p) for p in engine.stdout.readline().split()]
    assert len(pids) == 2, pids
    try:
        assert engine.wait(120) == 0
        assert _wait_gone(pids[0], 10), "rank 0 outlived its engine"
        os.kill(pids[1], signal.SIGCONT)
        assert _wait_gone(pids[1], 10), "rank 1 outlived its engine"
    finally:
        for pid in pids:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def test_ctrl_c_while_a_command_is_written_stops_the_ranks_with_a_clear_error() -> None:
    """Ctrl-C lands while a step's command is written to the ranks' pipes (rank 0 has it, rank 1 not): they can no
    longer run in step, so they are stopped, and the next call says why instead of hanging in a collective."""
    prompts = [p[:40] for p in load_prompts(2)]
    with LLM(str(TARGET_MODEL), tensor_parallel_size=2, async_scheduling=True, **BUNDLED) as llm:
        executor = _executor(llm)
        pids = _pids(executor)
        conn = executor._conns[1]
        send_bytes = conn.send_bytes
        sends = []

        def interrupted_send(message):
            sends.append(1)
            if len(sends) == 5:
                raise KeyboardInterrupt
            return send_bytes(message)

        conn.send_bytes = interrupted_send
        with pytest.raises(KeyboardInterrupt):
            _greedy(llm, prompts, 40)
        with pytest.raises(WorkerDiedError, match="interrupted while sending .* start a new engine"):
            _greedy(llm, prompts, 8)
    _assert_gone(pids)
