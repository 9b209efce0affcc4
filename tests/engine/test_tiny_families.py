"""Engine greedy output equals HF `generate(do_sample=False)` token for token, for tiny random models of every
supported family, with mixed-length prompts batched together, chunked prefill and forced preemption."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from asyncspec import LLM, SamplingParams
from asyncspec.errors import InvalidRequestError
from tests.conftest import TARGET_MODEL
from tests.hf_tiny_models import save_random_hf_model

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 512
MAX_MODEL_LEN = 64
BLOCK_SIZE = 4
MAX_NEW_TOKENS = 12
PROMPT_LENS = (3, 29, 11, 40, 1, 17)

_TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    # A wide init spreads the logits, so fp32 rounding never flips a greedy argmax.
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

FAMILIES = {
    "llama-untied": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False)),
    "llama-tied-bias": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=True, attention_bias=True)),
    "llama3-rope": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "mistral": (MistralConfig, MistralForCausalLM, dict(head_dim=16, sliding_window=None)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=32, num_key_value_heads=4)),
}


def _build(cfg_cls, model_cls, overrides, path) -> torch.nn.Module:
    hf = save_random_hf_model(cfg_cls, model_cls, {**_TINY, **overrides}, path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TARGET_MODEL / name, path / name)
    return hf


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tiny_family_matches_hf_greedy(family, tmp_path) -> None:
    hf = _build(*FAMILIES[family], tmp_path)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    llm = LLM(
        str(tmp_path),
        device="cpu",
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=MAX_MODEL_LEN // BLOCK_SIZE,  # one full-length request: preemption is certain
        max_num_batched_tokens=16,  # prompts of 17..40 tokens are chunked
        max_num_seqs=8,
        enable_prefix_caching=True,
    )
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True))
    stats = llm.stats()
    assert stats["num_preemptions"] > 0, "the tiny KV pool was meant to force preemption"
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"], "KV blocks leaked"
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.finish_reason == "length"
        assert all(0 <= t < VOCAB for t in out.token_ids)
        assert out.token_ids == _hf_greedy(hf, prompt, MAX_NEW_TOKENS), family
        # (No exact text check: random ids are random bytes, and the incremental detokenizer rightly
        # decodes the first output bytes together with a prompt that may end mid-character.)
        assert isinstance(out.text, str)


def test_tiny_model_without_tokenizer_and_stop_at_eos(tmp_path) -> None:
    """skip_tokenizer_init: token ids in, token ids out, no text; EOS stops exactly where HF stops."""
    cfg_cls, model_cls, overrides = FAMILIES["llama-untied"]
    hf = _build(cfg_cls, model_cls, overrides, tmp_path)
    llm = LLM(
        str(tmp_path),
        device="cpu",
        dtype="float32",
        skip_tokenizer_init=True,
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=64,
    )
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 9, 14)]
    free = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    # Stop on the 4th greedy token id: the output ends at its first occurrence, inclusive.
    for prompt, out in zip(prompts, free, strict=True):
        assert out.text == ""
        assert out.token_ids == _hf_greedy(hf, prompt, 10)
        stop_id = out.token_ids[3]
        first = out.token_ids.index(stop_id)
        again = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_id]))[0]
        assert again.token_ids == out.token_ids[: first + 1]
        assert again.finish_reason == "stop" and again.stop_reason == stop_id
    with pytest.raises(InvalidRequestError, match="without a tokenizer"):
        llm.generate(["text needs a tokenizer"], SamplingParams(max_tokens=2))
    stats = llm.stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
