"""Speculation over the paged KV cache at its edges: block size 1 (every draft crosses a block
boundary), a pool that runs dry mid-step (preemption, never corruption), and no leak."""

from __future__ import annotations

import pytest

from asyncspec import LLM, SamplingParams
from tests.conftest import TARGET_MODEL, load_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
@pytest.mark.parametrize("block_size, num_kv_blocks", [(1, 150), (16, 12)])
def test_tiny_blocks_and_a_dry_pool_keep_greedy_output(one_thread, method, block_size, num_kv_blocks):
    prompts = [p[:40] for p in load_prompts(6)]
    config = dict(
        device="cpu",
        dtype="float32",
        max_model_len=96,
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        max_num_seqs=6,
        max_num_batched_tokens=64,
    )
    plain = LLM(str(TARGET_MODEL), **{**config, "num_kv_blocks": 600 // block_size + 64}).generate(prompts, GREEDY)
    llm = LLM(str(TARGET_MODEL), speculative_method=method, num_speculative_tokens=4, **config)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    stats = llm.stats()
    assert stats["num_preemptions"] > 0, "the pool must run dry"
    assert stats["spec_num_accepted_tokens"] > 0
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
