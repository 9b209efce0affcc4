"""The q|k|v projection with RoPE and the KV-cache write in its epilogue (`skinny_linear_rotary`): bit for bit the
plain skinny kernel then `rotary_kv_write`, under TRITON_INTERPRET=1 on the CPU (every code path forced by a
config, padding rows, a tiny model's layers) and compiled on a GPU (the Llama-1B and 8B shapes, eager and in a
CUDA graph).

As in test_skinny_linear.py, `TestInterpreted` runs in-process only where TRITON_INTERPRET=1 was set before triton
was imported, otherwise in a child pytest started by `test_interpreter_suite`.
"""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from asyncspec.kernels.skinny_linear_triton import SkinnyConfig  # noqa: E402
from asyncspec.layers.attention import TORCH_REFERENCE  # noqa: E402
from tests.kernels.test_rotary_kv_write import run_tiny_model  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1" and isinstance(triton.language.zeros, InterpretedFunction)
MIN_INTERPRETED_TESTS = 40
NAN = float("nan")

# FMA and tensor-core tiles, whole and split (summed by the last program, or by a second kernel: then the two
# kernels run), a K tail, a ragged last column block.
CONFIGS = [
    None,
    SkinnyConfig(block_n=16, block_k=64),
    SkinnyConfig(block_n=8, block_k=32, split_k=3),
    SkinnyConfig(block_n=4, block_k=32, split_k=2),  # two pairs a program
    SkinnyConfig(block_n=32, block_k=32, split_k=2, serial_split=False),
    SkinnyConfig(block_n=16, block_k=32, use_dot=True),
    SkinnyConfig(block_n=32, block_k=64, split_k=2, use_dot=True),
]


def make_operands(gen: torch.Generator, m: int, heads: int, kv_heads: int, head_dim: int, k: int, dtype, device="cpu"):
    """x, W, bias, positions (a garbage one past the cache), cos/sin caches, NaN-poisoned caches, slots (-1 on one
    row: a padding row writes nothing)."""
    n = (heads + 2 * kv_heads) * head_dim
    max_position, blocks, block_size = 64, m + 4, 4  # more slots than rows
    ops = dict(
        x=(torch.randn(m, k, generator=gen) + 0.1).to(dtype),
        weight=(torch.randn(n, k, generator=gen) * k**-0.5 * 3).to(dtype),
        bias=torch.randn(n, generator=gen).to(dtype),
        positions=torch.randint(0, max_position, (m + 2,), generator=gen),
        cos_cache=torch.randn(max_position, head_dim // 2, generator=gen),
        # A view of wider rows: its row stride is not cos's.
        sin_cache=torch.randn(max_position, head_dim, generator=gen)[:, : head_dim // 2],
        k_cache=torch.full((blocks, block_size, kv_heads, head_dim), NAN, dtype=dtype),
        v_cache=torch.full((blocks, block_size, kv_heads, head_dim), NAN, dtype=dtype),
        slot_mapping=torch.randperm(blocks * block_size, generator=gen)[: m + 2],
    )
    if m > 1:
        ops["slot_mapping"][m - 1] = -1
        ops["positions"][0] = 10**6  # clamped, as the rotary kernel clamps them
        ops["positions"][m - 1] = -5
    return {name: t.to(device) for name, t in ops.items()}


def two_kernels(ops: dict, heads: int, kv_heads: int, config=None, with_bias=True):
    """The unfused path on copies of the caches: the plain projection, then `rotary_kv_write` on its views."""
    from asyncspec.kernels import skinny_linear_triton
    from asyncspec.kernels.rotary_kv_write_triton import rotary_kv_write

    x, weight = ops["x"], ops["weight"]
    m, head_dim = x.shape[0], weight.shape[0] // (heads + 2 * kv_heads)
    counters = skinny_linear_triton.make_split_counters(x.device)
    qkv = skinny_linear_triton.skinny_linear(
        x, weight, ops["bias"] if with_bias else None, config=config, counters=counters
    )
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    k_cache, v_cache = ops["k_cache"].clone(), ops["v_cache"].clone()
    q_rot = rotary_kv_write(
        q.view(m, heads, head_dim),
        k.view(m, kv_heads, head_dim),
        v.view(m, kv_heads, head_dim),
        ops["positions"],
        ops["cos_cache"],
        ops["sin_cache"],
        k_cache,
        v_cache,
        ops["slot_mapping"],
    )
    return q_rot, k_cache, v_cache


def fused(ops: dict, heads: int, kv_heads: int, config=None, with_bias=True, q_out=None):
    from asyncspec.kernels import skinny_linear_triton

    k_cache, v_cache = ops["k_cache"].clone(), ops["v_cache"].clone()
    q_rot = skinny_linear_triton.skinny_linear_rotary(
        ops["x"],
        ops["weight"],
        ops["bias"] if with_bias else None,
        num_heads=heads,
        num_kv_heads=kv_heads,
        positions=ops["positions"],
        cos_cache=ops["cos_cache"],
        sin_cache=ops["sin_cache"],
        k_cache=k_cache,
        v_cache=v_cache,
        slot_mapping=ops["slot_mapping"],
        q_out=q_out,
        config=config,
        counters=skinny_linear_triton.make_split_counters(ops["x"].device),
    )
    return q_rot, k_cache, v_cache


def _count_unfused(monkeypatch) -> list[int]:
    """Records each call that fell back to the two kernels (`_RopeOperands.unfused`)."""
    from asyncspec.kernels import skinny_linear_triton

    calls: list[int] = []
    unfused = skinny_linear_triton._RopeOperands.unfused

    def counting(self, qkv):
        calls.append(qkv.shape[0])
        return unfused(self, qkv)

    monkeypatch.setattr(skinny_linear_triton._RopeOperands, "unfused", counting)
    return calls


def assert_bit_equal(got: tuple, expected: tuple) -> None:
    for a, b in zip(got, expected, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.skipif(INTERPRETING, reason="TestInterpreted runs in this process")
def test_interpreter_suite(interpreted_suites) -> None:
    interpreted_suites.check(__file__, MIN_INTERPRETED_TESTS, ())


class TestInterpreted:
    # Collected only where triton interprets; elsewhere test_interpreter_suite runs it in a child process.
    __test__ = INTERPRETING

    # 40 rows: two row blocks of the tensor-core kernel (the FMA kernel never serves such calls).
    @pytest.mark.parametrize(
        ("m", "config"),
        [(m, c) for m in (1, 3, 5) for c in CONFIGS] + [(40, c) for c in CONFIGS if c is None or c.use_dot],
        ids=str,
    )
    @pytest.mark.parametrize("with_bias", [False, True])
    def test_equals_the_projection_then_the_rotary_kernel(self, config, m: int, with_bias: bool, monkeypatch) -> None:
        """q rotated, and k rotated and v in their slots, bit for bit, from one kernel (two only for a split
        summed by a second kernel); a slot of -1 keeps its NaNs."""
        unfused = _count_unfused(monkeypatch)
        ops = make_operands(torch.Generator().manual_seed(m), m, 4, 2, 16, 96, torch.bfloat16)
        got = fused(ops, 4, 2, config, with_bias)
        assert len(unfused) == (config is not None and config.split_k > 1 and not config.serial_split)
        expected = two_kernels(ops, 4, 2, config, with_bias)
        assert_bit_equal(got, expected)
        assert not got[0].isnan().any()
        written = int((ops["slot_mapping"][:m] >= 0).sum())
        assert int((~got[1].isnan()).all(-1).all(-1).sum()) == written  # k of every real row, and no other slot

    @pytest.mark.parametrize(
        ("heads", "kv_heads", "head_dim"), [(8, 8, 8), (6, 2, 32), (2, 1, 64), (3, 1, 16), (2, 1, 80)]
    )
    def test_head_layouts(self, heads: int, kv_heads: int, head_dim: int, monkeypatch) -> None:
        """No GQA, a group of 3, one KV head of 64, N = 80 (a ragged last column block of 32-wide tiles), heads of
        80 (a tile spans two heads): each pair's head and column come from the lane's index."""
        unfused = _count_unfused(monkeypatch)
        ops = make_operands(torch.Generator().manual_seed(head_dim), 2, heads, kv_heads, head_dim, 64, torch.bfloat16)
        configs = (
            None,
            SkinnyConfig(block_n=32, block_k=32),
            SkinnyConfig(block_n=32, block_k=32, split_k=2),
            SkinnyConfig(block_n=16, block_k=32, use_dot=True),
            SkinnyConfig(block_n=64, block_k=32, use_dot=True),
        )
        for config in configs:
            assert_bit_equal(fused(ops, heads, kv_heads, config), two_kernels(ops, heads, kv_heads, config))
        assert unfused == []

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    def test_other_dtypes_run_the_two_kernels(self, dtype) -> None:
        ops = make_operands(torch.Generator().manual_seed(7), 3, 4, 2, 16, 96, dtype)
        assert_bit_equal(fused(ops, 4, 2), two_kernels(ops, 4, 2))

    def test_q_out_is_written_in_place(self) -> None:
        """A q_out whose heads are strided (a view of wider rows): written through its strides, nothing else."""
        ops = make_operands(torch.Generator().manual_seed(8), 2, 4, 2, 16, 96, torch.bfloat16)
        wide = torch.full((2, 4, 40), NAN, dtype=torch.bfloat16)
        q_out = wide[:, :, 4:20]
        got = fused(ops, 4, 2, q_out=q_out)
        assert got[0] is q_out
        assert_bit_equal(got, two_kernels(ops, 4, 2))
        assert wide[:, :, :4].isnan().all() and wide[:, :, 20:].isnan().all()

    def test_bad_operands_raise_and_write_nothing(self) -> None:
        from asyncspec.kernels import skinny_linear_triton

        ops = make_operands(torch.Generator().manual_seed(9), 2, 4, 2, 16, 96, torch.bfloat16)
        k_before = ops["k_cache"].clone()

        def call(**changes):
            args = dict(ops, num_heads=4, num_kv_heads=2) | changes
            x, weight = args.pop("x"), args.pop("weight")
            return skinny_linear_triton.skinny_linear_rotary(x, weight, **args)

        bad = {
            "(num_heads + 2 * num_kv_heads) * head_dim rows": dict(num_heads=5),
            "even head_dim": dict(weight=ops["weight"][:88]),  # 8 heads of 11
            "cos/sin caches [max_position, 8]": dict(cos_cache=ops["cos_cache"][:, :4]),
            "k_cache and v_cache must be": dict(v_cache=ops["v_cache"][:, :, :1]),
            "at least 2 entries": dict(positions=ops["positions"][:1]),
            "q_out must be": dict(q_out=torch.empty(2, 4, 8, dtype=torch.bfloat16)),
            "with a dense last dim, got (2, 4, 16)": dict(
                q_out=torch.empty(2, 16, 4, dtype=torch.bfloat16).transpose(1, 2)
            ),
            "cos_cache needs a dense last dim": dict(cos_cache=ops["cos_cache"].t().contiguous().t()),
        }
        for message, changes in bad.items():
            with pytest.raises(ValueError, match=re.escape(message)):
                call(**changes)
        torch.testing.assert_close(ops["k_cache"], k_before, rtol=0, atol=0, equal_nan=True)

    def test_tiny_model_layers_are_bit_exact(self, monkeypatch) -> None:
        """A bf16 tiny Llama whose projections take the skinny kernel (attention on the torch reference, RoPE on
        the Triton kernel): with the rotary epilogue its hidden states and caches equal those of the projection
        then the rotary kernel, bit for bit, and every layer's q|k|v call took the epilogue."""
        from asyncspec.kernels.rotary_kv_write_triton import rotary_kv_write
        from asyncspec.layers import linear as linear_module
        from tests.kernels import test_rotary_kv_write

        backend = dataclasses.replace(TORCH_REFERENCE, name="triton_rotary", rotary_kv_write=rotary_kv_write)
        calls = test_rotary_kv_write.tiny_models_on_the_skinny_kernel(monkeypatch, "rotary_kernel")
        # The norm fold (on by default) needs the epilogue and rounds differently: off on both sides.
        monkeypatch.setenv(linear_module.NORM_FOLD_ENV, "0")
        monkeypatch.setenv(linear_module.ROTARY_IN_LINEAR_ENV, "0")
        baseline, baseline_caches = run_tiny_model("llama3", torch.bfloat16, fused_rotary=True, backend=backend)
        assert calls == []
        monkeypatch.delenv(linear_module.ROTARY_IN_LINEAR_ENV)
        got, got_caches = run_tiny_model("llama3", torch.bfloat16, fused_rotary=True, backend=backend)
        assert calls == [10, 10, 4, 4]  # two layers: prefills of 8 tokens and 2 padding rows, then 2 decodes
        for a, b in zip(got + got_caches, baseline + baseline_caches, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


# ------------------------------------------------------------------------------------------------ gpu


@pytest.mark.gpu
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "hidden"), [(32, 8, 64, 2048), (32, 8, 128, 4096)])
# FMA tiles (1, 2), tensor-core tiles (5-32; 160 and 640 in row blocks: k = 4 verifications of 32 and 128 requests)
@pytest.mark.parametrize("m", [1, 2, 5, 16, 32, 160, 640])
def test_gpu_equals_the_unfused_path(heads: int, kv_heads: int, head_dim: int, hidden: int, m: int) -> None:
    """The Llama-1B and 8B q|k|v shapes: bit for bit the projection then the rotary kernel, eager and replayed
    from a CUDA graph (which leaves the split counters at zero)."""
    from asyncspec.kernels import skinny_linear_triton

    ops = make_operands(torch.Generator().manual_seed(m), m, heads, kv_heads, head_dim, hidden, torch.bfloat16, "cuda")
    expected = two_kernels(ops, heads, kv_heads)
    assert_bit_equal(fused(ops, heads, kv_heads), expected)
    counters = skinny_linear_triton.make_split_counters(ops["x"].device)
    q_out = torch.empty(m, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    k_cache, v_cache = ops["k_cache"].clone(), ops["v_cache"].clone()
    kwargs = {name: ops[name] for name in ("positions", "cos_cache", "sin_cache", "slot_mapping")}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        skinny_linear_triton.skinny_linear_rotary(
            ops["x"],
            ops["weight"],
            ops["bias"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            k_cache=k_cache,
            v_cache=v_cache,
            q_out=q_out,
            counters=counters,
            **kwargs,
        )
    q_out.fill_(NAN)
    k_cache.copy_(ops["k_cache"])
    v_cache.copy_(ops["v_cache"])
    graph.replay()
    torch.cuda.synchronize()
    assert_bit_equal((q_out, k_cache, v_cache), expected)
    assert counters.count_nonzero() == 0
