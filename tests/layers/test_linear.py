"""Linear layers' dispatch to the decode-shaped kernel: which calls take it, and that a model switched
over generates what it did before. On the CPU a recording stand-in (the kernel's torch reference)
plays the kernel; on a GPU the real Triton kernel runs inside the engine."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
import torch.nn.functional as F

from asyncspec import LLM, SamplingParams
from asyncspec.kernels.silu_and_mul import silu_and_mul_ref
from asyncspec.kernels.skinny_linear import skinny_linear_gated_ref, skinny_linear_ref
from asyncspec.layers.linear import (
    DECODE_ROWS,
    DEFAULT_MAX_ROWS,
    NORM_FOLD_ENV,
    ROTARY_IN_LINEAR_ENV,
    SKINNY_MAX_ROWS_ENV,
    WIDE_MAX_MIB_ENV,
    WIDE_MAX_WEIGHT_BYTES,
    DecodeLinear,
    SkinnyLinear,
    SkinnyMaxRowsSettingError,
    linear,
    linear_rotary_kv_write,
    linear_silu_and_mul,
    skinny_max_rows,
    use_skinny_linear,
    wide_max_weight_bytes,
)
from asyncspec.worker.model_runner import SKINNY_LINEAR_ENV
from tests.conftest import DRAFT_MODEL, TARGET_MODEL, load_prompts
from tests.spec.spec_helpers import assert_same_outputs


class _Recording:
    """The kernel's reference, counting the rows of every call it serves."""

    def __init__(self, reference=skinny_linear_ref) -> None:
        self.rows: list[int] = []
        self.reference = reference

    def __call__(self, x, weight, bias, *, counters):
        assert counters is not None
        self.rows.append(x.shape[0])
        return self.reference(x, weight, bias)


def _stand_in(max_rows: int = 2, supported=lambda x, w: True) -> tuple[SkinnyLinear, _Recording, _Recording]:
    """A SkinnyLinear of recording references: (it, its plain kernel, its gated kernel)."""
    kernel, gated = _Recording(), _Recording(skinny_linear_gated_ref)
    counters = torch.zeros(8, dtype=torch.int32)
    return SkinnyLinear(max_rows, counters, kernel, supported, gated), kernel, gated


def test_linear_sends_only_decode_sized_calls_the_kernel_takes() -> None:
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(24, 16, generator=gen), torch.randn(24, generator=gen)
    skinny, kernel, _ = _stand_in()
    for rows in (1, 2, 3, 9):
        x = torch.randn(rows, 16, generator=gen)
        torch.testing.assert_close(linear(x, weight, bias, skinny), F.linear(x, weight, bias))
    assert kernel.rows == [1, 2]
    refusing, kernel, _ = _stand_in(supported=lambda x, w: False)
    x = torch.randn(1, 16, generator=gen)
    torch.testing.assert_close(linear(x, weight, None, refusing), F.linear(x, weight))
    assert kernel.rows == []
    layer = DecodeLinear(16, 24)
    assert layer.skinny_linear is None  # F.linear until a model is switched over
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_gated_projection_takes_the_activation_only_where_the_kernel_serves() -> None:
    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(24, 16, generator=gen), torch.randn(24, generator=gen)
    skinny, kernel, gated = _stand_in()
    for rows in (1, 2, 3):
        x = torch.randn(rows, 16, generator=gen)
        got = linear_silu_and_mul(x, weight, bias, skinny, silu_and_mul_ref)
        torch.testing.assert_close(got, silu_and_mul_ref(F.linear(x, weight, bias)))
    assert gated.rows == [1, 2] and kernel.rows == []  # three rows: F.linear, then the activation
    refusing, kernel, gated = _stand_in(supported=lambda x, w: False)
    x = torch.randn(1, 16, generator=gen)
    expected = silu_and_mul_ref(F.linear(x, weight))
    torch.testing.assert_close(linear_silu_and_mul(x, weight, None, refusing, silu_and_mul_ref), expected)
    assert gated.rows == [] and kernel.rows == []
    torch.testing.assert_close(linear_silu_and_mul(x, weight, None, None, silu_and_mul_ref), expected)


def test_rotary_projection_takes_the_kernel_only_for_bf16_decode_sized_calls() -> None:
    """The q|k|v projection with RoPE and the KV write goes to the rotary kernel (with the step's operands and
    the shared counters) for a bf16 x of at most max_rows rows the kernel takes; otherwise None, and the layer
    runs the projection then the rotary kernel."""
    served: list[tuple[int, dict]] = []

    def rotary(x, weight, bias, **kwargs):
        served.append((x.shape[0], kwargs))
        return torch.zeros(x.shape[0], kwargs["num_heads"], weight.shape[0] // 8)

    skinny, _, _ = _stand_in()
    skinny = dataclasses.replace(skinny, rotary_kernel=rotary)
    weight = torch.randn(64, 16).bfloat16()
    k_cache, v_cache = torch.zeros(4, 2, 2, 8), torch.zeros(4, 2, 2, 8)
    rope = dict(
        num_heads=4,
        num_kv_heads=2,
        positions=torch.arange(3),
        cos_cache=torch.ones(8, 4),
        sin_cache=torch.zeros(8, 4),
        kv_cache=(k_cache, v_cache),
        slot_mapping=torch.arange(3),
    )
    for rows, dtype in ((1, torch.bfloat16), (2, torch.bfloat16), (3, torch.bfloat16), (1, torch.float32)):
        x = torch.randn(rows, 16).to(dtype)
        got = linear_rotary_kv_write(x, weight.to(dtype), None, skinny, **rope)
        assert (got is not None) == (rows <= 2 and dtype == torch.bfloat16)
    assert [rows for rows, _ in served] == [1, 2]
    kwargs = served[0][1]
    assert kwargs["k_cache"] is k_cache and kwargs["v_cache"] is v_cache and kwargs["counters"] is skinny.counters
    x = torch.randn(1, 16).bfloat16()
    assert linear_rotary_kv_write(x, weight, None, dataclasses.replace(skinny, rotary_kernel=None), **rope) is None
    assert linear_rotary_kv_write(x, weight, None, None, **rope) is None
    refusing = dataclasses.replace(skinny, supported=lambda x, w: False)
    assert linear_rotary_kv_write(x, weight, None, refusing, **rope) is None
    assert len(served) == 2


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "draft"])
def test_switched_model_generates_the_same_tokens(spec: bool) -> None:
    """Every projection and the logits of the target (and the draft) take the kernel for their decode
    calls; prefill chunks stay on F.linear; greedy fp32 tokens are unchanged."""
    kwargs = dict(device="cpu", dtype="float32", max_model_len=256, max_num_seqs=2, num_kv_blocks=64)
    if spec:
        kwargs.update(speculative_method="draft_model", draft_model=str(DRAFT_MODEL), num_speculative_tokens=3)
    prompts = [p[:40] for p in load_prompts(2)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = LLM(str(TARGET_MODEL), **kwargs).generate(prompts, params)
    llm = LLM(str(TARGET_MODEL), **kwargs)
    runner = llm.engine.engine_core.runner
    skinny, kernel, gated = _stand_in()
    num_layers = runner.model_config.num_hidden_layers
    assert use_skinny_linear(runner.model, skinny) == 4 * num_layers + 1  # projections, and the logits
    if spec:
        use_skinny_linear(runner.spec.proposer.model, skinny)
    assert_same_outputs(ref, llm.generate(prompts, params), "the decode-shaped kernel")
    assert kernel.rows and max(kernel.rows) <= 2
    # Two requests decoding one token each: every projection of every layer, then the logits; gate|up with
    # its activation through the gated kernel.
    assert kernel.rows.count(2) >= 3 * num_layers and gated.rows.count(2) >= num_layers
    assert gated.rows and max(gated.rows) <= 2
    assert use_skinny_linear(runner.model, None) == 4 * num_layers + 1


def _tokens_equal_with_switch_off_and_on(monkeypatch, env: str, dtype: str, spec: bool, is_on, what: str) -> None:
    """Greedy tokens of the bundled target (graphs on; with the draft if `spec`) with `env`=0 and with the
    default: equal. `is_on(runner)` says whether the switched path is set up."""
    kwargs = dict(device="cuda", dtype=dtype, max_model_len=512, max_num_seqs=8, gpu_memory_utilization=0.3)
    if spec:
        kwargs.update(speculative_method="draft_model", draft_model=str(DRAFT_MODEL), num_speculative_tokens=4)
    prompts = load_prompts(6)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    monkeypatch.setenv(env, "0")
    ref_llm = LLM(str(TARGET_MODEL), **kwargs)
    assert not is_on(ref_llm.engine.engine_core.runner)
    ref = ref_llm.generate(prompts, params)
    del ref_llm  # its KV pool would count against the next engine's share of the card
    gc.collect()
    monkeypatch.delenv(env)  # the default
    llm = LLM(str(TARGET_MODEL), **kwargs)
    assert is_on(llm.engine.engine_core.runner)
    assert_same_outputs(ref, llm.generate(prompts, params), what)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [False, True], ids=["plain", "draft"])
def test_skinny_linear_in_the_engine_on_gpu(spec: bool, monkeypatch) -> None:
    """The Triton kernel inside the engine (its default on CUDA, graphs on): fp32 greedy tokens equal the
    run with it switched off (cuBLAS)."""
    _tokens_equal_with_switch_off_and_on(
        monkeypatch,
        SKINNY_LINEAR_ENV,
        "float32",
        spec,
        lambda runner: runner.model.skinny_linear is not None,
        "the decode-shaped kernel on the GPU",
    )


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [False, True], ids=["plain", "draft"])
def test_rotary_in_the_projection_keeps_bf16_tokens_on_gpu(spec: bool, monkeypatch) -> None:
    """bf16, graphs on: the q|k|v projection with RoPE and the KV write in its epilogue computes the numbers of
    the projection then the rotary kernel, so greedy tokens equal the run with it switched off. The norm fold,
    which needs the epilogue and rounds differently, is off on both sides."""
    monkeypatch.setenv(NORM_FOLD_ENV, "0")
    _tokens_equal_with_switch_off_and_on(
        monkeypatch,
        ROTARY_IN_LINEAR_ENV,
        "bfloat16",
        spec,
        lambda runner: runner.model.skinny_linear.rotary_kernel is not None,
        "RoPE and the KV write in the q|k|v projection",
    )


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_graphs_take_the_kernel_up_to_its_rows_and_eager_steps_compile_none(monkeypatch, async_scheduling) -> None:
    """The graphs are captured with the kernel serving every batch bucket (rows 1 to 8 here, and the
    verification graphs' k + 1 rows per request); an eager step (the prefills of short prompts) keeps it to
    its 2 rows and compiles no kernel variant mid-run, in either loop. Greedy fp32 tokens equal cuBLAS's."""

    triton = pytest.importorskip("triton")
    from asyncspec.worker import model_runner

    rows: list[int] = []
    make = model_runner.make_skinny_linear

    def recording_make(device, max_rows=None):
        skinny = make(device, max_rows)
        assert skinny.gated_kernel is not None

        def kernel(x, weight, bias, **kwargs):
            rows.append(x.shape[0])
            return skinny.kernel(x, weight, bias, **kwargs)

        def gated(x, weight, bias, **kwargs):
            rows.append(x.shape[0])
            return skinny.gated_kernel(x, weight, bias, **kwargs)

        return dataclasses.replace(skinny, kernel=kernel, gated_kernel=gated)

    kwargs = dict(device="cuda", dtype="float32", max_model_len=512, max_num_seqs=8, gpu_memory_utilization=0.3)
    kwargs.update(async_scheduling=async_scheduling)
    kwargs.update(speculative_method="draft_model", draft_model=str(DRAFT_MODEL), num_speculative_tokens=3)
    monkeypatch.setattr(model_runner, "make_skinny_linear", recording_make)
    llm = LLM(str(TARGET_MODEL), **kwargs)
    assert llm.engine.engine_core.runner.model.skinny_linear.max_rows == model_runner.EAGER_SKINNY_ROWS
    at_start = set(rows)
    assert {1, 2, 4, 8} <= at_start  # the decode buckets
    assert max(at_start) > 8  # verification graphs: k + 1 rows per request
    compiled: list[str] = []

    def hook(*args, **kw):
        compiled.append(str(getattr(kw.get("fn"), "name", kw.get("fn"))))
        return False

    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", hook)
    rows.clear()
    # Short prompts: their prefills run eagerly, with more than 2 rows per step.
    prompts = [p[: 3 + 8 * i] for i, p in enumerate(load_prompts(8))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got = llm.generate(prompts, params)
    # The graphs' calls run no Python; an eager call of more rows went to cuBLAS. Whether an eager step of one
    # or two rows happens at all depends on the adaptive policy's choices (the steps' measured costs), so
    # `rows` may be empty: the cap itself is the max_rows asserted above.
    assert max(rows, default=0) <= model_runner.EAGER_SKINNY_ROWS, rows
    assert not [name for name in compiled if "skinny" in name]
    del llm
    gc.collect()
    monkeypatch.setattr(model_runner, "make_skinny_linear", make)
    monkeypatch.setenv(SKINNY_LINEAR_ENV, "0")
    ref = LLM(str(TARGET_MODEL), **kwargs).generate(prompts, params)
    assert_same_outputs(ref, got, "graphs with the decode-shaped kernel up to 32 rows")


@pytest.mark.gpu
def test_wide_rows_keep_the_tokens_of_a_plain_batch_of_48_on_gpu(monkeypatch) -> None:
    """The default wide rows: the plain engine's decode graphs of 48 and 64 requests take the kernel for the
    bundled target's weights (all under the 6 MiB limit), and greedy fp32 tokens of 48 requests decoding together
    equal those with the kernel kept to 32 rows (cuBLAS above)."""
    from asyncspec.worker import model_runner

    rows: list[int] = []
    make = model_runner.make_skinny_linear

    def recording_make(device, max_rows=None):
        skinny = make(device, max_rows)

        def kernel(x, weight, bias, **kwargs):
            rows.append(x.shape[0])
            return skinny.kernel(x, weight, bias, **kwargs)

        return dataclasses.replace(skinny, kernel=kernel)

    kwargs = dict(device="cuda", dtype="float32", max_model_len=512, max_num_seqs=64, gpu_memory_utilization=0.3)
    prompts = [p[:100] for p in load_prompts(48)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    monkeypatch.setenv(SKINNY_MAX_ROWS_ENV, "32")
    ref_llm = LLM(str(TARGET_MODEL), **kwargs)
    assert ref_llm.engine.engine_core.runner._skinny_graphed.max_rows == DECODE_ROWS
    ref = ref_llm.generate(prompts, params)
    del ref_llm
    gc.collect()
    monkeypatch.delenv(SKINNY_MAX_ROWS_ENV)
    monkeypatch.setattr(model_runner, "make_skinny_linear", recording_make)
    llm = LLM(str(TARGET_MODEL), **kwargs)
    assert llm.engine.engine_core.runner._skinny_graphed.max_rows == 256
    assert {48, 64} <= set(rows)  # captured: the decode buckets past 32 rows took the kernel
    assert_same_outputs(ref, llm.generate(prompts, params), "the skinny kernel past 32 rows")


def test_runner_switches_its_models_to_the_graph_kernel_only_while_capturing() -> None:
    """The runner's models take the skinny kernel for every size it takes only inside `_graph_kernels`
    (the graphs' capture and their memory estimate), and get the eager one back after, an error included."""
    kwargs = dict(device="cpu", dtype="float32", max_model_len=256, max_num_seqs=2, num_kv_blocks=64)
    kwargs.update(speculative_method="draft_model", draft_model=str(DRAFT_MODEL), num_speculative_tokens=3)
    runner = LLM(str(TARGET_MODEL), **kwargs).engine.engine_core.runner
    draft = runner.spec.proposer.model
    eager, _, _ = _stand_in(max_rows=2)
    graphed, _, _ = _stand_in(max_rows=32)
    runner._skinny, runner._skinny_graphed = eager, graphed
    runner._use_skinny(eager)
    with runner._graph_kernels():
        assert runner.model.skinny_linear is graphed and draft.skinny_linear is graphed
    assert runner.model.skinny_linear is eager and draft.skinny_linear is eager
    with pytest.raises(RuntimeError, match="capture failed"), runner._graph_kernels():
        raise RuntimeError("capture failed")
    assert runner.model.skinny_linear is eager and draft.skinny_linear is eager
    runner._skinny = runner._skinny_graphed = None  # no kernel (cuBLAS): nothing is switched
    runner._use_skinny(None)
    with runner._graph_kernels():
        assert runner.model.skinny_linear is None


def test_skinny_max_rows_setting(monkeypatch) -> None:
    """Unset takes 256 rows; 32 to the kernel's 1024 are taken; anything else is refused with the range."""
    pytest.importorskip("triton")
    from asyncspec.kernels.skinny_linear_triton import MAX_M, WIDE_MAX_M

    assert DECODE_ROWS == MAX_M  # the layers' wide-row rule starts where the kernel's row blocks do
    monkeypatch.delenv(SKINNY_MAX_ROWS_ENV, raising=False)
    assert skinny_max_rows() == DEFAULT_MAX_ROWS == 256
    for value in ("32", "160", "640", str(WIDE_MAX_M)):
        monkeypatch.setenv(SKINNY_MAX_ROWS_ENV, value)
        assert skinny_max_rows() == int(value)
    for value in ("31", str(WIDE_MAX_M + 1), "wide", "-40"):
        monkeypatch.setenv(SKINNY_MAX_ROWS_ENV, value)
        with pytest.raises(SkinnyMaxRowsSettingError, match="from 32 to 1024 \\(unset: 256\\)"):
            skinny_max_rows()


def test_wide_max_weight_setting(monkeypatch) -> None:
    """Unset keeps the measured 6 MiB; 1 to 16 MiB are taken; anything else is refused with the range."""
    monkeypatch.delenv(WIDE_MAX_MIB_ENV, raising=False)
    assert wide_max_weight_bytes() == WIDE_MAX_WEIGHT_BYTES == 6 << 20
    for value in ("1", "12", " 16 "):
        monkeypatch.setenv(WIDE_MAX_MIB_ENV, value)
        assert wide_max_weight_bytes() == int(value) << 20
    for value in ("0", "17", "6.5", "big", "-1", ""):
        monkeypatch.setenv(WIDE_MAX_MIB_ENV, value)
        with pytest.raises(SkinnyMaxRowsSettingError, match="in MiB from 1 to 16 \\(unset: 6\\)"):
            wide_max_weight_bytes()


def test_wide_weight_limit_is_the_layers_setting() -> None:
    """A SkinnyLinear's own `wide_max_weight_bytes` decides which weights take wide calls (a Llama-1B's 8 MiB o
    projection stays on F.linear past 32 rows by default and takes the kernel once the limit is raised)."""
    skinny, kernel, _ = _stand_in(max_rows=256)
    weight = torch.empty(2048, 2048, dtype=torch.bfloat16)  # 8 MiB of bf16
    wide, narrow = torch.empty(64, 2048, dtype=torch.bfloat16), torch.empty(DECODE_ROWS, 2048, dtype=torch.bfloat16)
    assert not skinny.takes(wide, weight) and skinny.takes(narrow, weight)
    raised = dataclasses.replace(skinny, wide_max_weight_bytes=8 << 20)
    assert raised.takes(wide, weight) and not dataclasses.replace(raised, max_rows=32).takes(wide, weight)


def test_wide_calls_take_the_kernel_only_for_weights_l2_can_hold() -> None:
    """Past DECODE_ROWS rows the kernel's row blocks each read the weight again: a weight of at most
    WIDE_MAX_WEIGHT_BYTES takes it (a small model's projections), a larger one (an LM head) stays on F.linear;
    up to DECODE_ROWS rows any weight does."""
    gen = torch.Generator().manual_seed(3)
    skinny, kernel, gated = _stand_in(max_rows=256)
    small = torch.randn(24, 16, generator=gen)
    big = torch.empty(WIDE_MAX_WEIGHT_BYTES // (4 * 16) + 1, 16)  # fp32: just past the limit
    big.normal_(generator=gen)
    wide, narrow = torch.randn(DECODE_ROWS + 8, 16, generator=gen), torch.randn(DECODE_ROWS, 16, generator=gen)
    for x, weight in ((wide, small), (wide, big), (narrow, big)):
        torch.testing.assert_close(linear(x, weight, None, skinny), F.linear(x, weight))
    assert kernel.rows == [DECODE_ROWS + 8, DECODE_ROWS]  # not the wide call on the big weight
    assert skinny.takes(wide, small) and not skinny.takes(wide, big) and skinny.takes(narrow, big)
    gate_up = torch.empty(2 * big.shape[0], 16).normal_(generator=gen)
    linear_silu_and_mul(wide, gate_up, None, skinny, silu_and_mul_ref)
    assert gated.rows == []  # F.linear, then the activation
