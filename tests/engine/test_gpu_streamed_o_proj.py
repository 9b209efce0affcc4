"""The streamed o projection's `auto` (ASYNCSPEC_STREAMED_O_PROJ unset) in the engine on a Hopper GPU: it takes the
one-row o projections only where every program's share of the weight fits the GEMV's ring, and bf16 greedy decoding
at batch 1 then stays close to Hugging Face with CUDA graphs on."""

from __future__ import annotations

import random

import pytest
import torch

from asyncspec import LLM
from tests.engine.test_gpu_engine import _assert_close_greedy, _hf_greedy_with_top5, _run_ours
from tests.hf_tiny_models import save_tiny_family_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU"
    ),
]


@pytest.mark.parametrize(("heads", "served"), [(8, True), (36, False)])
def test_auto_serves_an_o_projection_whose_share_fits_the_ring(monkeypatch, heads: int, served: bool, tmp_path) -> None:
    """Heads of 64: 8 make an o projection of [512, 512], 32 tiles of 16 KiB, one a program (it fits the 64 KiB
    ring); 36 make [2304, 2304], whose every 16-row tile is 72 KiB (it fits no program's ring, so `auto` keeps
    `skinny_linear`, though the kernel takes the shape)."""
    from asyncspec.kernels.streamed_gemv_gluon import StreamedGemv

    monkeypatch.delenv("ASYNCSPEC_STREAMED_O_PROJ", raising=False)
    calls: list[tuple[int, ...]] = []
    original = StreamedGemv.__call__

    def recording(self, x, weight):
        calls.append(tuple(weight.shape))
        return original(self, x, weight)

    monkeypatch.setattr(StreamedGemv, "__call__", recording)
    hidden = heads * 64
    hf = save_tiny_family_model(
        "llama",
        tmp_path,
        torch.bfloat16,
        hidden_size=hidden,
        intermediate_size=1024,
        num_attention_heads=heads,
        head_dim=64,
    )
    llm = LLM(str(tmp_path), device="cuda", skip_tokenizer_init=True, max_model_len=256, max_num_batched_tokens=64)
    o_projs = [m.o_proj for m in llm.engine.engine_core.runner.model.modules() if hasattr(m, "o_proj")]
    assert o_projs and all((o.streamed_gemv is not None) == served for o in o_projs)
    assert ((hidden, hidden) in calls) == served  # captured into the batch-1 graph
    if not served:
        return
    hf = hf.cuda().eval()
    rng = random.Random(2)
    for _ in range(3):  # one request at a time: every decode step replays the batch-1 graph
        prompt = [rng.randrange(2, 512) for _ in range(rng.randrange(5, 80))]
        ((ours, our_top5),) = _run_ours(llm, [prompt], 24)
        ref, ref_logprobs = _hf_greedy_with_top5(hf, prompt, 24)
        _assert_close_greedy(ours, our_top5, ref, ref_logprobs)
