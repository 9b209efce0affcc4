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


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_steady_decode_batch_copies_its_inputs_only_when_they_change(async_scheduling: bool):
    """Host work proportional to what changed: a step whose requests, counts and drafts match the last copy's
    (nothing admitted) copies no meta, and its block tables only when a request got a new block. The tokens
    are those of a request run alone, and of a batch that changes under it (a second request joins and ends)."""
    from tests.conftest import load_prompts
    from tests.engine.engine_helpers import bundled_llm

    prompt = load_prompts(1)[0][:20]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)

    def make() -> LLM:
        return bundled_llm(async_scheduling=async_scheduling)  # 16-token blocks

    llm = make()
    alone = llm.generate([prompt], params)[0].token_ids
    stats = llm.stats()
    # 60 steps (a prefill that samples the first token, 59 decodes; asynchronously one more, planned past the
    # end): the prefill's meta (admitted) and the first decode's, then none; the table at the prefill and at each
    # of the 3 blocks that 20 + 60 tokens add past the first 2.
    assert stats["num_steps"] == (61 if async_scheduling else 60)
    assert stats["step_meta_copies"] <= 3, stats["step_meta_copies"]
    assert stats["step_block_table_copies"] <= 5, stats["step_block_table_copies"]
    short = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    llm = make()
    engine = llm.engine
    engine.add_request(engine.make_request(prompt, params, "long"), stream_deltas=False)
    tokens: list[int] = []
    step = 0
    while engine.has_unfinished_requests():
        if step == 10:  # joins mid-decode, ends 7 tokens later
            engine.add_request(engine.make_request(prompt[:9], short, "short"), stream_deltas=False)
        for output in engine.step():
            if output.request_id == "long" and output.finished:
                tokens = output.token_ids
        step += 1
    assert tokens == alone


def _staggered_tokens(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, list[int]]:
    """Each request joins two steps after the one before it, so prompt chunks share steps with decodes."""
    engine = llm.engine
    tokens: dict[str, list[int]] = {}
    step = 0
    while step == 0 or engine.has_unfinished_requests():
        if step % 2 == 0 and step // 2 < len(prompts):
            i = step // 2
            engine.add_request(engine.make_request(prompts[i], params[i], f"r{i}"), stream_deltas=False)
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = output.token_ids
        step += 1
    return tokens


def test_an_all_greedy_step_samples_with_the_argmax_alone_and_a_random_row_brings_the_sampler_back(monkeypatch):
    """A step the graphs do not sample (on the CPU, every step; on a GPU, one with prompt chunks) takes the argmax that
    writes its tokens itself while every row of the batch is greedy: no sampler and no sampling metadata, and the
    tokens the sampler gives. A random row in the batch brings the sampler back, and the greedy rows keep their
    tokens."""
    from tests.conftest import load_prompts
    from tests.engine.engine_helpers import bundled_llm

    prompts = [p[:40] for p in load_prompts(3)]
    greedy = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 3

    def counted(llm: LLM) -> list[int]:
        runner = llm.engine.engine_core.runner
        calls = [0, 0]
        forward, metadata = runner.sampler.forward, runner._sampling_metadata

        def sampler_forward(*args, **kwargs):
            calls[0] += 1
            return forward(*args, **kwargs)

        def sampling_metadata(*args, **kwargs):
            calls[1] += 1
            return metadata(*args, **kwargs)

        monkeypatch.setattr(runner.sampler, "forward", sampler_forward)
        monkeypatch.setattr(runner, "_sampling_metadata", sampling_metadata)
        return calls

    fast = bundled_llm(max_num_batched_tokens=32, max_num_seqs=8)  # 40-token prompts take two chunks
    fast_calls = counted(fast)
    fast_tokens = _staggered_tokens(fast, prompts, greedy)
    assert fast_calls == [0, 0]
    monkeypatch.setenv("ASYNCSPEC_FUSED_TOKEN_WRITE", "0")
    sampled = bundled_llm(max_num_batched_tokens=32, max_num_seqs=8)
    monkeypatch.delenv("ASYNCSPEC_FUSED_TOKEN_WRITE")
    sampled_calls = counted(sampled)
    assert _staggered_tokens(sampled, prompts, greedy) == fast_tokens
    assert sampled_calls[0] > 0 and sampled_calls[1] > 0
    assert all(len(t) == 12 for t in fast_tokens.values())
    mixed = bundled_llm(max_num_batched_tokens=32, max_num_seqs=8)
    mixed_calls = counted(mixed)
    random = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
    tokens = _staggered_tokens(mixed, prompts, [greedy[0], random, greedy[2]])
    assert mixed_calls[0] > 0
    assert tokens["r0"] == fast_tokens["r0"] and tokens["r2"] == fast_tokens["r2"]


def test_the_cpu_pool_sized_from_host_memory_is_shared_by_the_tensor_parallel_ranks(monkeypatch):
    """Without num_kv_blocks or kv_cache_bytes the CPU pool takes a quarter of the host's available memory; the
    ranks of a tensor-parallel group are processes on the same host, so each takes its share of that quarter."""
    from asyncspec.layers.tensor_parallel import TensorParallel
    from asyncspec.worker import model_runner

    llm = LLM(str(TARGET_MODEL), device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=64)
    runner = llm.engine.engine_core.runner
    monkeypatch.setattr(runner.config, "num_kv_blocks", None)
    monkeypatch.setattr(runner.config, "max_num_seqs", 10_000)  # the full-length cap above the memory's
    monkeypatch.setattr(model_runner, "_available_host_memory", lambda: 4000 * 4 * runner.bytes_per_block)
    assert runner.determine_num_kv_blocks() == 4000
    monkeypatch.setattr(runner, "tp", TensorParallel(rank=1, size=4))
    per_rank = runner.bytes_per_block  # the model's KV heads are split, so each rank's block is smaller
    monkeypatch.setattr(model_runner, "_available_host_memory", lambda: 4000 * 4 * per_rank)
    assert runner.determine_num_kv_blocks() == 1000
