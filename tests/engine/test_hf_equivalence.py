"""The engine's greedy output equals Hugging Face transformers' greedy output, token for token (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncspec import LLM, SamplingParams
from asyncspec.config import EngineConfig
from tests.conftest import TARGET_MODEL

MAX_NEW_TOKENS = 64


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    input_ids = torch.tensor([prompt])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=1,
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(TARGET_MODEL, dtype=torch.float32).eval()


def test_bundled_target_matches_hf_under_batching_chunking_prefix_cache_and_preemption(hf_model, code_prompts):
    # Eight prompts of 161..364 tokens: transformers' one-prompt-at-a-time reference is most of the test's time.
    prompts = list(code_prompts[:8])
    # Two prompts that share long prefixes with earlier ones, so the prefix cache must serve them.
    prompts.append(code_prompts[0][:200] + code_prompts[1][:40])
    prompts.append(list(code_prompts[2]))
    llm = LLM(
        str(TARGET_MODEL),
        device="cpu",
        dtype="float32",
        block_size=16,
        max_model_len=1024,
        num_kv_blocks=96,  # far below 10 requests x ~20 blocks: preemption must happen
        max_num_seqs=10,
        max_num_batched_tokens=96,  # small chunks: long prompts interleave with decodes
        enable_prefix_caching=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts[:8], params)
    assert llm.stats()["num_preemptions"] > 0, "the KV pool was meant to force preemption"
    # The repeats come later: a preempted request finding its own blocks is no prefix-cache hit, and the run above
    # evicts most of what it cached. So prompts 0 and 2 run again, then the repeats hit what they left (prompts that
    # arrive together are test_a_burst_sharing_a_prefix_matches_hf's).
    outputs[0], outputs[2] = llm.generate([prompts[0], prompts[2]], params)
    hits_before = llm.stats()["prefix_cache_hits"]
    outputs += llm.generate(prompts[8:], params)
    stats = llm.stats()
    # At least the shared 200-token prefix's full blocks (the repeats' own allocations may evict the least recently
    # used tail of prompt 2's blocks first).
    assert stats["prefix_cache_hits"] - hits_before >= 200 // 16 * 16, "the repeats were meant to hit the cache"
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"], "KV blocks leaked"
    expected: dict[tuple[int, ...], list[int]] = {}  # the repeated prompt's reference is computed once
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.finish_reason == "length"
        assert out.prompt_token_ids == prompt
        if tuple(prompt) not in expected:
            expected[tuple(prompt)] = hf_greedy(hf_model, prompt, MAX_NEW_TOKENS)
        assert out.token_ids == expected[tuple(prompt)]


@pytest.mark.parametrize(
    "engine",
    [
        dict(async_scheduling=False),
        dict(async_scheduling=True, speculative_method="draft_model", num_speculative_tokens=3),
    ],
    ids=["sync", "async-draft"],
)
def test_a_burst_sharing_a_prefix_matches_hf(hf_model, code_prompts, engine):
    """Four prompts with one 288-token prefix arrive together (beside one that shares nothing): the first
    computes the prefix, the others wait for its blocks (prefix_sharing_wait_tokens) and hit them, in one generate
    call, with the draft model's KV of the shared blocks too; the tokens are transformers'."""
    prefix = (list(code_prompts[3]) + list(code_prompts[6]))[:288]
    assert len(prefix) == 288 >= EngineConfig().prefix_sharing_wait_tokens
    prompts = [prefix + list(code_prompts[4 + i][: 9 + 5 * i]) for i in range(4)]
    prompts.insert(2, list(code_prompts[5][:50]))
    llm = LLM(
        str(TARGET_MODEL),
        device="cpu",
        dtype="float32",
        block_size=16,
        max_model_len=512,
        num_kv_blocks=128,
        max_num_batched_tokens=512,
        **engine,
    )
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    stats = llm.stats()
    assert stats["num_prefix_sharing_waits"] >= 3
    assert stats["prefix_cache_hits"] >= 3 * 288, stats["prefix_cache_hits"]
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"], "KV blocks leaked"
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == hf_greedy(hf_model, prompt, 24)


def test_text_prompt_matches_hf_and_detokenizes(hf_model):
    llm = LLM(str(TARGET_MODEL), device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=512)
    prompt = "import os\nimport sys\n\n\ndef main("
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    assert out.token_ids == hf_greedy(hf_model, ids, 24)
    assert out.text == tokenizer.decode(out.token_ids)
