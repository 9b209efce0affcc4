"""fp32 greedy equality with Hugging Face on the GPU with CUDA graphs on (the default), for every family,
without and with speculation (n-gram for the tiny random models, the bundled draft for the bundled target)."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from asyncspec import LLM, SamplingParams
from tests.conftest import TARGET_MODEL, load_prompts
from tests.engine.test_gpu_engine import _hf_greedy_with_top5
from tests.hf_tiny_models import save_tiny_family_model

pytestmark = pytest.mark.gpu

FP32_TIE = 1e-4
"""A divergence is accepted only where HF's own fp32 logits of the two tokens are this close."""


@pytest.fixture(autouse=True)
def _free_earlier_engines():
    """Engines of earlier tests in this process may still hold their memory until collected; the
    pools here are sized explicitly (num_kv_blocks) so that profiling never sees another engine's."""
    gc.collect()
    torch.cuda.empty_cache()
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _assert_equal_up_to_fp32_ties(ours: list[int], ref: list[int], ref_logits) -> None:
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a != b:
            gap = ref_logits[i][b].item() - ref_logits[i][a].item()
            assert gap <= FP32_TIE, f"position {i}: ours {a}, HF {b}, HF logit gap {gap}"
            return


def _check(llm: LLM, hf, prompts: list[list[int]], max_tokens: int) -> None:
    runner = llm.engine.engine_core.runner
    assert runner.cuda_graphs is not None, "graphs should be on by default on CUDA"
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        ref, ref_logits = _hf_greedy_with_top5(hf, prompt, max_tokens)
        _assert_equal_up_to_fp32_ties(out.token_ids, ref, ref_logits)
    assert llm.stats()["cuda_graph_replays"] > 0


@pytest.mark.parametrize("spec", [None, "draft_model"])
def test_bundled_target_fp32_graphs_equal_hf(spec):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(TARGET_MODEL, dtype=torch.float32).cuda().eval()
    kwargs = dict(speculative_method=spec, num_speculative_tokens=4) if spec else {}
    llm = LLM(str(TARGET_MODEL), device="cuda", dtype="float32", max_model_len=1024, num_kv_blocks=512, **kwargs)
    _check(llm, hf, load_prompts(6), 32)


@pytest.mark.parametrize("spec", [None, "draft_model"])
def test_bundled_target_fp32_graphs_equal_hf_at_40_requests(spec):
    """From 32 requests the decode tiles walk 128 keys a step (`_LONG_KEY_STEP_MIN_REQS`): 40 prompts put the
    graphed decode steps (and with the draft, the k = 4 verifications) on that tile."""
    from transformers import AutoModelForCausalLM

    from asyncspec.kernels.paged_attention_triton import _LONG_KEY_STEP_MIN_REQS

    prompts = load_prompts(40)
    assert len(prompts) > _LONG_KEY_STEP_MIN_REQS
    hf = AutoModelForCausalLM.from_pretrained(TARGET_MODEL, dtype=torch.float32).cuda().eval()
    kwargs = dict(speculative_method=spec, num_speculative_tokens=4) if spec else {}
    llm = LLM(str(TARGET_MODEL), device="cuda", dtype="float32", max_model_len=1024, num_kv_blocks=1024, **kwargs)
    _check(llm, hf, prompts, 16)


@pytest.mark.parametrize("spec", [None, "ngram"])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_tiny_families_fp32_graphs_equal_hf(family, spec, tmp_path):
    # Mistral's window is crossed within the generation.
    overrides = {"sliding_window": 32} if family == "mistral" else {}
    hf = save_tiny_family_model(family, tmp_path, torch.float32, **overrides)
    hf = hf.cuda().eval()
    rng = random.Random(0)
    # Repetitive prompts, so that the n-gram proposer finds drafts.
    prompts = [[rng.randrange(2, 512) for _ in range(rng.randrange(5, 20))] * 3 for _ in range(6)]
    kwargs = dict(speculative_method=spec, num_speculative_tokens=3) if spec else {}
    llm = LLM(
        str(tmp_path),
        device="cuda",
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=256,
        num_kv_blocks=256,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        **kwargs,
    )
    _check(llm, hf, prompts, 24)
