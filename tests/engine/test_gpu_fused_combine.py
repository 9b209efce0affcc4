"""Split-KV attention merging its splits in the split pass (ASYNCSPEC_ATTN_FUSED_COMBINE=1) in the engine on a
GPU: fp32 greedy equality with Hugging Face with CUDA graphs on, with and without the draft, and with a sliding
window; no combine kernel launches, and every layer's counters are back at zero when the engine is idle."""

from __future__ import annotations

import random

import pytest
import torch

from asyncspec import LLM
from asyncspec.layers.attention import FUSED_COMBINE_ENV, Attention
from tests.conftest import TARGET_MODEL, load_prompts
from tests.engine.test_gpu_graphs_hf import _check, _free_earlier_engines  # noqa: F401 - an autouse fixture
from tests.hf_tiny_models import save_tiny_family_model

pytestmark = pytest.mark.gpu


class _Refused:
    def __getitem__(self, grid):
        raise AssertionError("the combine kernel was launched")


def _fused(monkeypatch) -> dict[str, int]:
    """Turns the fused merge on and refuses the combine kernel; counts the split pass's fused launches outside the
    start-up's variant warm-up (graph capture and eager steps), so that a test whose steps never split fails."""
    from asyncspec.kernels import paged_attention_triton as mod

    monkeypatch.setenv(FUSED_COMBINE_ENV, "1")
    monkeypatch.setattr(mod, "_combine_splits_kernel", _Refused())
    seen = {"fused": 0, "warmup": 0}
    kernel, compile_variants = mod._paged_attention_split_kernel, mod.compile_tile_variants

    class Launches:
        def __getitem__(self, grid):
            launcher = kernel[grid]

            def launch(*args, **kwargs):
                seen["fused"] += bool(kwargs.get("FUSED_COMBINE")) and not seen["warmup"]
                return launcher(*args, **kwargs)

            return launch

    def warmup(*args, **kwargs):
        seen["warmup"] += 1
        try:
            return compile_variants(*args, **kwargs)
        finally:
            seen["warmup"] -= 1

    monkeypatch.setattr(mod, "_paged_attention_split_kernel", Launches())
    monkeypatch.setattr(mod, "compile_tile_variants", warmup)
    return seen


def _counters(llm: LLM) -> list[torch.Tensor | None]:
    runner = llm.engine.engine_core.runner
    models = [runner.model] + ([runner.spec.proposer.model] if runner.spec is not None else [])
    return [m.combine_counters for model in models for m in model.modules() if isinstance(m, Attention)]


@pytest.mark.parametrize("spec", [None, "draft_model"])
def test_bundled_target_fp32_equal_hf(monkeypatch, spec):
    from transformers import AutoModelForCausalLM

    seen = _fused(monkeypatch)
    hf = AutoModelForCausalLM.from_pretrained(TARGET_MODEL, dtype=torch.float32).cuda().eval()
    kwargs = dict(speculative_method=spec, num_speculative_tokens=4) if spec else {}
    llm = LLM(str(TARGET_MODEL), device="cuda", dtype="float32", max_model_len=1024, num_kv_blocks=512, **kwargs)
    counters = _counters(llm)
    assert counters and all(c is not None for c in counters)
    _check(llm, hf, load_prompts(6), 32)
    torch.cuda.synchronize()
    assert not any(c.any() for c in counters if c is not None)
    assert seen["fused"] > 0, "no step took the split pass"


def sliding_window_check(tmp_path, max_num_batched_tokens: int) -> LLM:
    """A tiny Mistral with a 32-token window, fp32, graphs on: 6 prompts of 40-200 tokens (contexts past the window
    and several key tiles; a 1,024-token block table lets a decode batch split 4 ways), greedy equal to HF."""
    hf = (
        save_tiny_family_model("mistral", tmp_path, torch.float32, sliding_window=32, max_position_embeddings=1024)
        .cuda()
        .eval()
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 512) for _ in range(rng.randrange(40, 200))] for _ in range(6)]
    llm = LLM(
        str(tmp_path),
        device="cuda",
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=1024,
        num_kv_blocks=512,
        max_num_seqs=8,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    _check(llm, hf, prompts, 24)
    torch.cuda.synchronize()
    return llm


def test_sliding_window_fp32_equal_hf(monkeypatch, tmp_path):
    seen = _fused(monkeypatch)
    llm = sliding_window_check(tmp_path, 256)
    assert not any(c.any() for c in _counters(llm) if c is not None)
    assert seen["fused"] > 0, "no step took the split pass"
