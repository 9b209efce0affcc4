"""The streamed MLP (ASYNCSPEC_STREAMED_MLP) in the engine on a Hopper GPU: bf16 greedy decoding at batch 1
stays close to Hugging Face, with CUDA graphs on and eagerly, and the kernel really serves the decode steps."""

from __future__ import annotations

import random

import pytest
import torch

from asyncspec import LLM
from tests.engine.test_gpu_engine import _assert_close_greedy, _hf_greedy_with_top5, _run_ours
from tests.engine.tiny_streamed_engine import assert_batch_1_close_to_hf, tiny_engine
from tests.hf_tiny_models import save_tiny_family_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU"
    ),
]


def _tiny_engine(family: str, tmp_path, enforce_eager: bool, **model_overrides):
    """`tiny_engine`, and the engine's decoder layers with a streamed-MLP slot."""
    hf, llm = tiny_engine(family, tmp_path, enforce_eager, **model_overrides)
    runner = llm.engine.engine_core.runner
    return hf, llm, [m for m in runner.model.modules() if "streamed_mlp" in vars(m)]


@pytest.mark.parametrize("form", ["barrier", "split", "split-deep"])
@pytest.mark.parametrize("enforce_eager", [False, True])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_batch_1_bf16_close_to_hf(monkeypatch, family: str, enforce_eager: bool, form: str, tmp_path) -> None:
    from asyncspec.kernels.streamed_gemv_gluon import StreamedGemv

    monkeypatch.setenv("ASYNCSPEC_STREAMED_MLP", form)
    # The unfolded chain: the default fold sends the split forms' down projections through `add_norm` instead.
    monkeypatch.setenv("ASYNCSPEC_STREAMED_MLP_NORM_FOLD", "0")
    down_calls: list[tuple[int, ...]] = []
    original = StreamedGemv.__call__

    def counting(self, x, weight):
        down_calls.append(tuple(weight.shape))
        return original(self, x, weight)

    monkeypatch.setattr(StreamedGemv, "__call__", counting)
    hf, llm, layers = _tiny_engine(family, tmp_path, enforce_eager)
    assert layers and all(m.streamed_mlp is not None for m in layers)
    streamed = layers[0].streamed_mlp
    assert streamed.config.grid_barrier == (form == "barrier")
    assert streamed.config.co_resident == (form != "split-deep")
    if form != "barrier":  # the down projection's GEMV: 14 slots of its own (split-deep), or what shares an SM
        from asyncspec.kernels.streamed_mlp import down_stages_for

        depth = streamed._down[(512, 1024)].config.stages
        assert depth == down_stages_for(streamed.config, 512, 1024) and (depth == 14) == (form == "split-deep")
    flags = streamed._flags
    launched_before = int(flags[0].item())
    streamed._act.fill_(float("nan"))  # only the kernel writes its activations' scratch
    assert_batch_1_close_to_hf(llm, hf, seed=0)
    assert torch.isfinite(streamed._act).all()
    if form == "barrier":
        # Each launch moves every program's flag on by one: it ran for every decode step's layers.
        assert set(flags.tolist()) == {int(flags[0].item())}
        assert int(flags[0].item()) - launched_before >= 4 * 23 * len(layers)
        assert down_calls == []
    else:
        assert set(flags.tolist()) == {0}  # no barrier
        # The down projection's GEMV: captured into the graphs, or called by every eager decode step's layers.
        assert down_calls.count((512, 1024)) >= (4 * 23 * len(layers) if enforce_eager else 1)


@pytest.mark.parametrize("enforce_eager", [False, True])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_next_norm_folded_into_the_down_projection_close_to_hf(
    monkeypatch, family: str, enforce_eager: bool, tmp_path
) -> None:
    """ASYNCSPEC_STREAMED_MLP_NORM_FOLD unset (on by default): a batch-1 layer's down projection adds the residual
    and weights it for the next layer's norm, whose q|k|v scales by the factors (no norm kernel between them): greedy
    tokens stay close to Hugging Face, graphed and eager. Qwen3's q/k norm keeps its q|k|v from scaling: it never
    folds."""
    from asyncspec.kernels.streamed_gemv_gluon import StreamedGemv

    monkeypatch.setenv("ASYNCSPEC_STREAMED_MLP", "split-deep")
    monkeypatch.delenv("ASYNCSPEC_STREAMED_MLP_NORM_FOLD", raising=False)
    folded_calls: list[tuple[int, ...]] = []
    original = StreamedGemv.add_norm

    def counting(self, x, weight, **kwargs):
        folded_calls.append(tuple(weight.shape))
        return original(self, x, weight, **kwargs)

    monkeypatch.setattr(StreamedGemv, "add_norm", counting)
    from asyncspec.models.llama import LlamaAttention

    scaled_calls: list[int] = []
    project = LlamaAttention.project_rotated

    def counting_scaled(self, x, rope, kv_cache, attn_metadata, row_scale=None):
        q_rot = project(self, x, rope, kv_cache, attn_metadata, row_scale=row_scale)
        if row_scale is not None and q_rot is not None:  # the scaled path, not the unfolding fallback
            scaled_calls.append(x.shape[0])
        return q_rot

    monkeypatch.setattr(LlamaAttention, "project_rotated", counting_scaled)
    hf, llm, layers = _tiny_engine(family, tmp_path, enforce_eager)
    assert layers and all(m.streamed_mlp is not None and m.streamed_mlp.fold_next_norm for m in layers)
    assert_batch_1_close_to_hf(llm, hf, seed=1)
    if family == "qwen3":
        assert folded_calls == [] and scaled_calls == []
    else:  # every layer but the last folds, the next one scales: in the graphs, or at every eager decode step
        assert folded_calls.count((512, 1024)) >= ((4 * 23 * (len(layers) - 1)) if enforce_eager else 1)
        # (the 4-row-and-up fold of the skinny kernels also scales, in steps of several rows: not counted here)
        assert scaled_calls.count(1) >= ((4 * 23 * (len(layers) - 1)) if enforce_eager else 1)


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_streamed_o_proj_batch_1_bf16_close_to_hf(monkeypatch, enforce_eager: bool, tmp_path) -> None:
    """ASYNCSPEC_STREAMED_O_PROJ=1 beside the split streamed MLP: the o projections' one-row calls take the
    streamed GEMV, and greedy decoding stays close to HF."""
    from asyncspec.kernels.streamed_gemv_gluon import StreamedGemv

    monkeypatch.setenv("ASYNCSPEC_STREAMED_MLP", "split")
    monkeypatch.setenv("ASYNCSPEC_STREAMED_O_PROJ", "1")
    calls: list[tuple[int, ...]] = []
    original = StreamedGemv.__call__

    def counting(self, x, weight):
        calls.append(tuple(weight.shape))
        return original(self, x, weight)

    monkeypatch.setattr(StreamedGemv, "__call__", counting)
    # An o projection of 512 x 512: 8 heads of 64.
    hf, llm, _ = _tiny_engine("llama", tmp_path, enforce_eager, num_attention_heads=8, head_dim=64)
    runner = llm.engine.engine_core.runner
    o_projs = [m.o_proj for m in runner.model.modules() if hasattr(m, "o_proj")]
    assert o_projs and all(o.streamed_gemv is not None for o in o_projs)
    o_shape = tuple(o_projs[0].weight.shape)
    assert o_shape == (512, 512) and o_shape in calls  # captured into the graphs, or run by the warm-up
    calls.clear()
    assert_batch_1_close_to_hf(llm, hf, seed=1, num_prompts=3)
    if enforce_eager:  # every decode step's layers called it from Python (graph replays do not)
        assert calls.count(o_shape) >= 3 * 23 * len(o_projs)


@pytest.mark.parametrize("others", [False, True])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_streamed_attn_in_batch_1_bf16_close_to_hf(monkeypatch, enforce_eager: bool, others: bool, tmp_path) -> None:
    """ASYNCSPEC_STREAMED_ATTN_IN=1, alone and beside the split streamed MLP and the streamed o projection (a
    batch-1 layer is then three streamed kernels and the attention): greedy decoding stays close to HF."""
    from asyncspec.kernels.streamed_attn_in_gluon import StreamedAttnIn

    monkeypatch.setenv("ASYNCSPEC_STREAMED_MLP", "split" if others else "0")
    monkeypatch.setenv("ASYNCSPEC_STREAMED_O_PROJ", "1" if others else "0")
    monkeypatch.setenv("ASYNCSPEC_STREAMED_ATTN_IN", "1")
    residuals: list[bool] = []
    original = StreamedAttnIn.__call__

    def counting(self, x, residual, *args):
        residuals.append(residual is not None)
        return original(self, x, residual, *args)

    monkeypatch.setattr(StreamedAttnIn, "__call__", counting)
    hf, llm = tiny_engine("llama", tmp_path, enforce_eager, num_attention_heads=8, head_dim=64)
    runner = llm.engine.engine_core.runner
    layers = [m for m in runner.model.modules() if "streamed_attn_in" in vars(m)]
    assert layers and all(m.streamed_attn_in is not None for m in layers)
    assert True in residuals and False in residuals  # captured or warmed: the first layer has no residual
    residuals.clear()
    assert_batch_1_close_to_hf(llm, hf, seed=2, num_prompts=3)
    if enforce_eager:
        assert len(residuals) >= 3 * 23 * len(layers)


@pytest.mark.parametrize(("hidden", "served"), [(2048, True), (512, False)])
def test_auto_serves_the_measured_shape_only(monkeypatch, hidden: int, served: bool, tmp_path) -> None:
    """auto (also unset) runs the split-deep form where the down projection's 16-row tiles fill between half the
    SMs and all of them (hidden 2,048: 128 tiles), and leaves the down projection's own GEMV off there; hidden 512
    (32 tiles) keeps the chain. Where it serves, batch-1 bf16 greedy decoding stays close to HF."""
    if served:
        monkeypatch.delenv("ASYNCSPEC_STREAMED_MLP", raising=False)
        monkeypatch.delenv("ASYNCSPEC_STREAMED_DOWN_PROJ", raising=False)
    else:
        monkeypatch.setenv("ASYNCSPEC_STREAMED_MLP", "auto")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    if not 128 <= num_sms < 256:
        pytest.skip(f"the test's shapes assume 128 to 255 SMs, not {num_sms}")
    hf = save_tiny_family_model("llama", tmp_path, torch.bfloat16, hidden_size=hidden, intermediate_size=4096)
    llm = LLM(
        str(tmp_path),
        device="cuda",
        skip_tokenizer_init=True,
        max_model_len=128,
        gpu_memory_utilization=0.2,  # beside other tests' engines in one process
    )
    model = llm.engine.engine_core.runner.model
    layers = [m for m in model.modules() if "streamed_mlp" in vars(m)]
    assert layers and all((m.streamed_mlp is not None) == served for m in layers)
    if not served:
        return
    assert (layers[0].streamed_mlp.config.grid_barrier, layers[0].streamed_mlp.config.co_resident) == (False, False)
    assert all(m.down_proj.streamed_gemv is None for m in model.modules() if hasattr(m, "down_proj"))
    hf = hf.cuda().eval()
    rng = random.Random(0)
    for _ in range(2):
        prompt = [rng.randrange(2, 512) for _ in range(rng.randrange(5, 40))]
        ((ours, our_top5),) = _run_ours(llm, [prompt], 16)
        ref, ref_logprobs = _hf_greedy_with_top5(hf, prompt, 16)
        _assert_close_greedy(ours, our_top5, ref, ref_logprobs)
