"""Model runner: device selection errors, KV pool sizing, and the device-resident token buffer."""

from __future__ import annotations

import pytest
import torch

from asyncspec import LLM, SamplingParams
from asyncspec.errors import ConfigError
from tests.conftest import TARGET_MODEL


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_requested_without_cuda_is_a_clear_error():
    with pytest.raises(ConfigError, match="CUDA is not available"):
        LLM(str(TARGET_MODEL), device="cuda")


def test_pool_smaller_than_one_max_len_request_is_refused():
    with pytest.raises(ConfigError, match=r"fewer than one request of max_model_len=512 needs \(32\)"):
        LLM(str(TARGET_MODEL), device="cpu", max_model_len=512, block_size=16, num_kv_blocks=31)


def test_pool_sized_in_bytes():
    # 8 layers x 2 (K, V) x 2 KV heads x 64 dims x 4 bytes (fp32) = 8192 bytes per token.
    bytes_per_block = 8 * 2 * 2 * 64 * 4 * 16
    llm = LLM(
        str(TARGET_MODEL), device="cpu", dtype="float32", max_model_len=256, kv_cache_bytes=40 * bytes_per_block + 5
    )
    assert llm.stats()["num_kv_blocks"] == 40
    with pytest.raises(ConfigError):
        LLM(str(TARGET_MODEL), device="cpu", dtype="float32", max_model_len=256, kv_cache_bytes=bytes_per_block - 1)


def test_device_token_buffer_holds_prompt_and_sampled_tokens():
    llm = LLM(str(TARGET_MODEL), device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=64)
    engine = llm.engine
    request = engine.make_request([5, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), "r")
    engine.add_request(request)
    runner = engine.engine_core.runner
    seen = None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        state = runner.input_batch.rows.get("r")
        if state is not None:
            seen = runner.input_batch.token_ids[state.row, : state.num_tokens].tolist()
            assert seen == request.all_token_ids
        if outputs and outputs[-1].finished:
            break
    assert seen is not None and len(seen) >= 5 + 5


def test_unchunked_prefill_needs_a_budget_of_max_model_len():
    with pytest.raises(ConfigError, match="enable_chunked_prefill=False"):
        LLM(
            str(TARGET_MODEL), device="cpu", max_model_len=512, enable_chunked_prefill=False, max_num_batched_tokens=256
        )


def test_prefix_cache_queries_count_each_admission_once():
    llm = LLM(str(TARGET_MODEL), device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=8, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([list(range(10, 110))], params)
    # The pool holds one request at a time, so the third waits (and is retried) for several steps;
    # each admission still counts its tokens exactly once.
    later = [list(range(10, 110)) + [7, 8], list(range(200, 300))]
    llm.generate(later, params)
    stats = llm.stats()
    assert stats["num_steps"] > 10
    assert stats["prefix_cache_queries"] == 100 + 102 + 100
    assert stats["prefix_cache_hits"] == 96  # six full blocks of the shared 100-token prefix
