"""Step timing counters: CPU planning time, launch-to-launch gap and device idle between steps."""

from __future__ import annotations

import pytest

from asyncspec import SamplingParams
from asyncspec.engine.step_timing import StepTimings
from tests.conftest import load_prompts
from tests.spec.spec_helpers import make_llm


def test_totals_gaps_and_reset():
    t = StepTimings()
    # schedule_start, launch, execute_end, update_end, device idle (None: the host's gap)
    t.record(0.0, 0.1, 0.5, 0.6, None)
    assert (t.num_steps, t.launch_gap_seconds, t.device_idle_seconds) == (1, 0.0, 0.0)  # nothing before
    t.record(0.7, 0.75, 1.0, 1.1, None)
    assert t.last_launch_gap_seconds == pytest.approx(0.65)  # 0.1 -> 0.75
    assert t.last_device_idle_seconds == pytest.approx(0.25)  # execution ended at 0.5, resumed at 0.75
    assert t.scheduling_seconds == pytest.approx(0.15)
    assert t.execute_seconds == pytest.approx(0.65)
    assert t.update_seconds == pytest.approx(0.2)
    t.record(1.2, 1.3, 1.4, 1.5, 0.004)  # measured on the device
    assert t.last_device_idle_seconds == 0.004 and t.device_idle_seconds == pytest.approx(0.254)
    t.reset_gaps()  # the engine went idle: the wait for new work is no bubble
    t.record(9.0, 9.1, 9.2, 9.3, None)
    assert t.last_launch_gap_seconds == 0.0 and t.last_device_idle_seconds == 0.0
    stats = t.as_stats()
    assert stats["num_timed_steps"] == 4 and stats["step_launch_gap_seconds_total"] == pytest.approx(0.65 + 0.55)


def test_engine_counts_every_step():
    """In the synchronous loop the device waits for the CPU between steps: each launch gap covers the
    previous execution plus the CPU work after it, and the idle time is that CPU work."""
    llm = make_llm(block_size=16, max_model_len=192, num_kv_blocks=64, max_num_seqs=4)
    prompts = [p[:50] for p in load_prompts(3)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    stats = llm.stats()
    assert stats["num_timed_steps"] == stats["num_steps"] >= 12
    assert stats["step_scheduling_seconds_total"] > 0 and stats["step_update_seconds_total"] > 0
    assert 0 < stats["device_idle_seconds_total"] < stats["step_launch_gap_seconds_total"]
    # gap i = step i-1's execution + the host's time between its results and step i's launch, and
    # that host time lies inside the worker's idle time between the two steps (the worker stops
    # before the results reach the engine and starts after the launch): so the gaps add up to every
    # execution but the last, plus at least nothing and at most all the idle time
    executions_before_last = stats["step_execute_seconds_total"] - stats["last_step_execute_seconds"]
    gaps = stats["step_launch_gap_seconds_total"]
    assert executions_before_last - 1e-9 <= gaps <= executions_before_last + stats["device_idle_seconds_total"] + 1e-9
    # the engine ran dry after generate: a later request's first step starts no gap
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=1))
    assert llm.stats()["last_step_launch_gap_seconds"] == 0.0


@pytest.mark.gpu
def test_device_idle_is_measured_with_cuda_events():
    llm = make_llm(
        device="cuda", block_size=16, max_model_len=192, num_kv_blocks=64, max_num_seqs=4, async_scheduling=False
    )
    prompts = [p[:50] for p in load_prompts(3)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    stats = llm.stats()
    runner = llm.engine.engine_core.runner
    assert runner.last_device_idle_seconds is not None
    # the synchronous loop leaves the GPU idle between steps, never longer than the launch gaps
    assert 0 < stats["device_idle_seconds_total"] < stats["step_launch_gap_seconds_total"]


@pytest.mark.gpu
def test_async_loop_leaves_the_gpu_less_idle_than_the_sync_loop(monkeypatch, tmp_path):
    """The bubble, measured by the step events: the asynchronous loop queues step N+1 before step N
    ends, so the device waits less between steps than in the synchronous loop. The model is a
    random-weight Llama-1B shape whose decode step outlasts the host's work per step (with the
    15.7M bundled model the host, not the device, sets the pace in both loops, and neither can keep
    the device busy: docs/benchmarks.md)."""
    import json

    from asyncspec import LLM

    monkeypatch.setenv("ASYNCSPEC_DEBUG_INVARIANTS", "0")  # its device reads would add bubbles
    config = dict(  # the Llama-3.2-1B shape (benchmarks/gpu_step_speed.py), plain RoPE
        architectures=["LlamaForCausalLM"],
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
        max_position_embeddings=512,
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    prompts = [p[:50] for p in load_prompts(4)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    idle = {}
    for async_scheduling in (False, True):
        llm = LLM(
            str(tmp_path),
            load_format="dummy",
            skip_tokenizer_init=True,
            device="cuda",
            dtype="bfloat16",
            block_size=16,
            max_model_len=192,
            num_kv_blocks=64,
            max_num_seqs=4,
            async_scheduling=async_scheduling,
        )
        llm.generate(prompts, params)  # warm-up
        before = llm.stats()
        llm.generate(prompts, params)
        after = llm.stats()
        steps = after["num_timed_steps"] - before["num_timed_steps"]
        idle[async_scheduling] = (after["device_idle_seconds_total"] - before["device_idle_seconds_total"]) / steps
        llm.shutdown()
        del llm
    assert idle[True] < idle[False], idle


def test_startup_phases_are_reported():
    """Construction's phases in stats: loading and the KV pool took time; the warm-up runs on CUDA only."""
    stats = make_llm(num_kv_blocks=32, max_model_len=256).stats()
    assert stats["startup_load_seconds"] > 0 and stats["startup_kv_cache_seconds"] > 0
    assert stats["startup_warm_up_seconds"] == 0 and stats["startup_warm_up_steps"] == 0
