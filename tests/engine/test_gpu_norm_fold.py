"""The norms folded into the projections (ASYNCSPEC_NORM_FOLD, on by default) in the engine on a GPU: decode
batches of 4 to 32 rows run on graphs whose o and down projections add the residual and weight the sum for the next
norm, and whose q|k|v and gate|up projections scale their sums by the rows' RMS factors; bf16 greedy decoding stays
close to Hugging Face for every family whose attention input takes it (Qwen3's q/k norm keeps the unfolded
layers)."""

from __future__ import annotations

import random

import pytest
import torch

from asyncspec import LLM
from tests.engine.test_gpu_engine import _assert_close_greedy, _hf_greedy_with_top5, _run_ours
from tests.hf_tiny_models import save_tiny_family_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_batches_bf16_close_to_hf(monkeypatch, family: str, tmp_path) -> None:
    from asyncspec.kernels import skinny_linear_triton

    monkeypatch.delenv("ASYNCSPEC_NORM_FOLD", raising=False)
    monkeypatch.delenv("ASYNCSPEC_NORM_FOLD_MIN_ROWS", raising=False)
    rows: list[int] = []
    add_norm = skinny_linear_triton.skinny_linear_add_norm

    def recording_add_norm(x, *args, **kwargs):
        rows.append(x.shape[0])
        return add_norm(x, *args, **kwargs)

    # Before the engine starts: the graphs' captures call it (replays do not).
    monkeypatch.setattr(skinny_linear_triton, "skinny_linear_add_norm", recording_add_norm)
    hf = save_tiny_family_model(family, tmp_path, torch.bfloat16).cuda().eval()
    llm = LLM(str(tmp_path), device="cuda", skip_tokenizer_init=True, max_model_len=256, max_num_batched_tokens=512)
    if family == "qwen3":
        assert rows == []  # q/k norm: the layers never fold
    else:
        assert {4, 8, 16, 32} <= set(rows) and min(rows) >= 4
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 512) for _ in range(rng.randrange(5, 80))] for _ in range(12)]
    for prompt, (ours, our_top5) in zip(prompts, _run_ours(llm, prompts, 24), strict=True):
        ref, ref_logprobs = _hf_greedy_with_top5(hf, prompt, 24)
        _assert_close_greedy(ours, our_top5, ref, ref_logprobs)
