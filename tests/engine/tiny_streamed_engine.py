"""The tiny bf16 engine the streamed kernels' GPU tests share: widths the streamed kernels take (multiples of 512),
Hugging Face's model over the same weights on the GPU, and batch-1 greedy decoding checked against it."""

from __future__ import annotations

import random

import torch

from asyncspec import LLM
from tests.engine.test_gpu_engine import _assert_close_greedy, _hf_greedy_with_top5, _run_ours
from tests.hf_tiny_models import save_tiny_family_model


def tiny_engine(family: str, tmp_path, enforce_eager: bool, **model_overrides) -> tuple[torch.nn.Module, LLM]:
    """(Hugging Face's tiny bf16 model of `family` on the GPU, the engine over its weights): hidden 512,
    intermediate 1,024, `model_overrides` on top (heads, say)."""
    hf = save_tiny_family_model(
        family, tmp_path, torch.bfloat16, hidden_size=512, intermediate_size=1024, **model_overrides
    )
    hf = hf.cuda().eval()  # before the engine sizes its KV pool from the free memory
    llm = LLM(
        str(tmp_path),
        device="cuda",
        skip_tokenizer_init=True,
        max_model_len=256,
        max_num_batched_tokens=64,
        enforce_eager=enforce_eager,
    )
    return hf, llm


def assert_batch_1_close_to_hf(llm: LLM, hf: torch.nn.Module, seed: int, num_prompts: int = 4) -> None:
    """`num_prompts` requests one at a time (every decode step a batch of 1), 24 greedy tokens each, close to
    Hugging Face."""
    rng = random.Random(seed)
    for _ in range(num_prompts):
        prompt = [rng.randrange(2, 512) for _ in range(rng.randrange(5, 80))]
        ((ours, our_top5),) = _run_ours(llm, [prompt], 24)
        ref, ref_logprobs = _hf_greedy_with_top5(hf, prompt, 24)
        _assert_close_greedy(ours, our_top5, ref, ref_logprobs)
