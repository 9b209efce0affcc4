"""The attention reading its step inputs and older keys before the PDL wait (ASYNCSPEC_ATTN_EARLY_KV=1) in the engine
on a GPU: fp32 greedy equality with Hugging Face with CUDA graphs on, with and without the draft (whose verify steps
write several new keys a request), and with a sliding window; the kernels really took the early path."""

from __future__ import annotations

import pytest
import torch

from asyncspec import LLM
from asyncspec.layers.attention import EARLY_KV_ENV
from tests.conftest import TARGET_MODEL, load_prompts
from tests.engine.test_gpu_fused_combine import sliding_window_check
from tests.engine.test_gpu_graphs_hf import _check, _free_earlier_engines  # noqa: F401 - an autouse fixture

pytestmark = pytest.mark.gpu


def _early(monkeypatch) -> dict[str, int]:
    """Turns the early reads on; counts the attention launches that took them (single pass and split pass) outside
    the start-up's variant warm-up (graph capture and eager steps), so that a test whose steps never took them
    fails."""
    from asyncspec.kernels import paged_attention_triton as mod

    monkeypatch.setenv(EARLY_KV_ENV, "1")
    seen = {"single": 0, "split": 0, "warmup": 0}

    def counting(kernel, name: str):
        class Launches:
            def __getitem__(self, grid):
                launcher = kernel[grid]

                def launch(*args, **kwargs):
                    seen[name] += bool(kwargs.get("EARLY_KV")) and not seen["warmup"]
                    return launcher(*args, **kwargs)

                return launch

        return Launches()

    compile_variants = mod.compile_tile_variants

    def warmup(*args, **kwargs):
        seen["warmup"] += 1
        try:
            return compile_variants(*args, **kwargs)
        finally:
            seen["warmup"] -= 1

    monkeypatch.setattr(mod, "_paged_attention_kernel", counting(mod._paged_attention_kernel, "single"))
    monkeypatch.setattr(mod, "_paged_attention_split_kernel", counting(mod._paged_attention_split_kernel, "split"))
    monkeypatch.setattr(mod, "compile_tile_variants", warmup)
    return seen


@pytest.mark.parametrize("spec", [None, "draft_model"])
def test_bundled_target_fp32_equal_hf(monkeypatch, spec):
    from transformers import AutoModelForCausalLM

    seen = _early(monkeypatch)
    hf = AutoModelForCausalLM.from_pretrained(TARGET_MODEL, dtype=torch.float32).cuda().eval()
    kwargs = dict(speculative_method=spec, num_speculative_tokens=4) if spec else {}
    llm = LLM(str(TARGET_MODEL), device="cuda", dtype="float32", max_model_len=1024, num_kv_blocks=512, **kwargs)
    _check(llm, hf, load_prompts(6), 32)
    assert seen["split"] > 0 and seen["single"] > 0, seen


def test_sliding_window_fp32_equal_hf(monkeypatch, tmp_path):
    # 64-token chunks give prefill tiles after a context. The 1,024-token block table splits every call of this engine
    # (an H100 counted 30 split launches, no single pass), so the window is checked on the split pass here; the
    # single pass's early reads with a window are the kernel tests'.
    seen = _early(monkeypatch)
    sliding_window_check(tmp_path, 64)
    assert seen["split"] > 0, seen
