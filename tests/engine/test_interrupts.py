"""Ctrl-C while LLM.generate waits for a step (the in-process runner; tests/worker/test_tensor_parallel.py has the
worker processes'): the call raises KeyboardInterrupt and aborts its requests, and the next call on the same engine
returns what a fresh engine returns, with the loop's own number of steps in flight."""

from __future__ import annotations

import pytest

from asyncspec import LLM, SamplingParams
from asyncspec.engine.engine_core import MAX_INFLIGHT_STEPS
from tests.conftest import TARGET_MODEL, load_prompts

CONFIG = dict(device="cpu", dtype="float32", block_size=16, max_model_len=512, num_kv_blocks=96, max_num_seqs=8)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_ctrl_c_while_a_step_is_collected_leaves_the_engine_usable(async_scheduling, monkeypatch):
    prompts = [p[:40] for p in load_prompts(3)]
    with LLM(str(TARGET_MODEL), async_scheduling=async_scheduling, **CONFIG) as fresh:
        greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        base = [o.token_ids for o in fresh.generate(prompts, greedy)]
        # Every token the streams emit is a stop id, and min_tokens holds them to 7 tokens: a step more in flight
        # than the loop keeps (exact counts are what min_tokens waits for) would emit more.
        stops = sorted({t for tokens in base for t in tokens})
        params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=6, stop_token_ids=stops)
        reference = [o.token_ids for o in fresh.generate(prompts, params)]
    assert all(len(tokens) == 7 for tokens in reference)
    with LLM(str(TARGET_MODEL), async_scheduling=async_scheduling, **CONFIG) as llm:
        core = llm.engine.engine_core
        collect = core.runner.collect
        calls = []

        def interrupted_collect(handle):
            calls.append(handle)
            if len(calls) == 4:
                raise KeyboardInterrupt
            return collect(handle)

        monkeypatch.setattr(core.runner, "collect", interrupted_collect)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
        assert core.num_inflight_steps >= 1  # the interrupted step, retired by the next call
        in_flight = []
        launch_next = core.launch_next

        def counting_launch():
            step = launch_next()
            in_flight.append(core.num_inflight_steps)
            return step

        monkeypatch.setattr(core, "launch_next", counting_launch)
        assert [o.token_ids for o in llm.generate(prompts, params)] == reference
        assert max(in_flight) == (MAX_INFLIGHT_STEPS if async_scheduling else 1)
        stats = llm.stats()
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
