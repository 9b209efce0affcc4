"""RoPE fused with the paged KV-cache write: the torch reference against the model's separate ops
(RotaryEmbedding + apply_rotary + write_kv_cache_ref), the Triton kernel against the reference (bf16/fp16 bit
for bit, fp32 to 1e-6) under TRITON_INTERPRET=1 on the CPU and compiled on a GPU, and tiny models whose layers
take the fused path against the separate ops.

As in test_triton_kernels.py, `TestInterpreted` runs in-process only where TRITON_INTERPRET=1 was set before
triton was imported, otherwise in a child pytest started by `test_interpreter_suite`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import pytest
import torch

from asyncspec.kernels.kv_cache_write import write_kv_cache_ref
from asyncspec.kernels.rotary_kv_write import rotary_kv_write_ref
from asyncspec.kernels.slot_mapping import compute_slot_mapping_ref
from asyncspec.layers.attention import TORCH_REFERENCE, AttentionBackend
from asyncspec.layers.attention_metadata import AttentionMetadata
from asyncspec.layers.rotary import RotaryEmbedding, apply_rotary
from asyncspec.models.llama import LlamaForCausalLM
from asyncspec.models.loader import load_model
from asyncspec.models.model_config import ModelConfig

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # a bare GPU box may lack hypothesis; only one interpreter test needs it
    given = None

MAX_POSITION = 8192
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}
SENTINEL = -7.5  # exact in every dtype: a cache slot the kernel must not touch keeps it
BLOCK_SIZE = 4
GARBAGE_POSITION = 10**6 + 7  # what a padding row may carry; the kernel clamps it


@functools.cache
def rope(head_dim: int, llama3: bool = True, device: str = "cpu") -> RotaryEmbedding:
    """fp32 cos/sin caches over MAX_POSITION positions (llama3 scaling past 1024, so > 4096 is scaled)."""
    theta, scaling = (500000.0, LLAMA3) if llama3 else (10000.0, None)
    return RotaryEmbedding(head_dim, MAX_POSITION, theta, scaling).to(device)


@dataclass
class Case:
    """One call's inputs: q/k/v are strided views of a fused QKV output, as LlamaAttention has them."""

    qkv: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    rope: RotaryEmbedding

    def caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh copies of the (sentinel-filled) caches."""
        return self.k_cache.clone(), self.v_cache.clone()

    @property
    def clamped_positions(self) -> torch.Tensor:
        return self.positions.clamp(0, MAX_POSITION - 1)


def make_case(
    gen: torch.Generator,
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    *,
    cache_dtype: torch.dtype | None = None,
    num_pad: int = 2,
    garbage_pad_positions: bool = False,
    llama3: bool = True,
    device: str = "cpu",
) -> Case:
    """Positions spread over [0, MAX_POSITION) (0 and the last one included), distinct slots over a shuffled
    pool with spares, and `num_pad` padding rows (slot -1) placed first, in the middle and last."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = (torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen) * 3).to(device=device, dtype=dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=gen)
    positions[: min(2, num_tokens)] = torch.tensor([0, MAX_POSITION - 1])[: min(2, num_tokens)]
    num_slots = (num_tokens // BLOCK_SIZE + 3) * BLOCK_SIZE
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    pad_rows = torch.tensor([0, num_tokens // 2, num_tokens - 1])[: min(num_pad, num_tokens)]
    slots[pad_rows] = -1
    if garbage_pad_positions:
        positions[pad_rows] = GARBAGE_POSITION
    shape = (num_slots // BLOCK_SIZE, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.full(shape, SENTINEL, dtype=cache_dtype or dtype, device=device)
    return Case(
        qkv,
        q.view(num_tokens, num_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
        positions.to(device),
        slots.to(device),
        k_cache,
        k_cache.clone(),
        rope(head_dim, llama3, device),
    )


def model_ops(case: Case, positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """The model's separate ops: cos/sin gathered and cast once, q and k rotated, then the KV write."""
    cos, sin = case.rope(positions, case.q.dtype)
    q_rot, k_rot = apply_rotary(case.q, cos, sin), apply_rotary(case.k, cos, sin)
    write_kv_cache_ref(k_rot, case.v, k_cache, v_cache, case.slots)
    return q_rot


def call(fn, case: Case, positions: torch.Tensor, k_cache, v_cache, q_out=None) -> torch.Tensor:
    r = case.rope
    return fn(case.q, case.k, case.v, positions, r.cos_cache, r.sin_cache, k_cache, v_cache, case.slots, q_out=q_out)


def assert_untouched_slots(case: Case, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Every slot no valid row maps to still holds the sentinel (slot -1 rows wrote nothing)."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    written = set(case.slots[case.slots >= 0].tolist())
    untouched = sorted(set(range(num_slots)) - written)
    for cache in (k_cache, v_cache):
        assert cache.reshape(num_slots, -1)[untouched].eq(SENTINEL).all()


SHAPES = [(4, 2, 64), (6, 2, 80), (4, 4, 96), (8, 1, 128)]  # (heads, kv heads, head dim): GQA, MHA, MQA
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


# ------------------------------------------------------------------------------------------- reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
def test_reference_is_the_model_path(dtype, heads, kv_heads, head_dim) -> None:
    case = make_case(torch.Generator().manual_seed(head_dim), 19, heads, kv_heads, head_dim, dtype, num_pad=3)
    expected_caches, got_caches = case.caches(), case.caches()
    expected = model_ops(case, case.positions, *expected_caches)
    qkv_before = case.qkv.clone()
    got = call(rotary_kv_write_ref, case, case.positions, *got_caches)
    assert got.dtype == dtype and got.shape == case.q.shape
    assert torch.equal(got, expected)
    assert torch.equal(got_caches[0], expected_caches[0]) and torch.equal(got_caches[1], expected_caches[1])
    assert torch.equal(case.qkv, qkv_before)  # inputs untouched without q_out
    assert_untouched_slots(case, *got_caches)


def test_reference_in_place_and_mixed_cache_dtype() -> None:
    """q_out=q rotates in place; an fp32 cache gets the bf16 k_rot widened, as `.to(k_cache.dtype)` does."""
    case = make_case(torch.Generator().manual_seed(1), 9, 4, 2, 64, torch.bfloat16, cache_dtype=torch.float32)
    expected_caches, got_caches = case.caches(), case.caches()
    expected = model_ops(case, case.positions, *expected_caches)
    got = call(rotary_kv_write_ref, case, case.positions, *got_caches, q_out=case.q)
    assert got is case.q and torch.equal(case.q, expected)
    assert torch.equal(got_caches[0], expected_caches[0]) and torch.equal(got_caches[1], expected_caches[1])


def test_reference_rounds_each_op_in_bf16() -> None:
    """The bit-exact contract has teeth: one fp32 rotation rounded once differs from torch's op-by-op bf16."""
    case = make_case(torch.Generator().manual_seed(2), 64, 8, 2, 128, torch.bfloat16)
    q_rot = call(rotary_kv_write_ref, case, case.positions, *case.caches())
    cos = case.rope.cos_cache[case.positions].to(torch.bfloat16).float()[:, None, :]
    sin = case.rope.sin_cache[case.positions].to(torch.bfloat16).float()[:, None, :]
    x1, x2 = case.q.float().chunk(2, dim=-1)
    once = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(torch.bfloat16)
    assert not torch.equal(q_rot, once)
    torch.testing.assert_close(q_rot, once, atol=0.07, rtol=0.02)


# ---------------------------------------------------------------------------------------------- triton

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1" and isinstance(triton.language.zeros, InterpretedFunction)
MIN_INTERPRETED_TESTS = 25


@pytest.mark.skipif(INTERPRETING, reason="TestInterpreted runs in this process")
def test_interpreter_suite(interpreted_suites) -> None:
    interpreted_suites.check(__file__, MIN_INTERPRETED_TESTS, ("ASYNCSPEC_ATTENTION_BACKEND",))


def check_kernel(fn, case: Case, *, in_place: bool = False) -> None:
    """The kernel against the reference (at clamped positions), into a NaN-poisoned q_out or in place."""
    exact = case.q.dtype != torch.float32
    positions = case.clamped_positions
    expected_caches, got_caches = case.caches(), case.caches()
    expected = call(rotary_kv_write_ref, case, positions, *expected_caches)
    kv_before = case.qkv[:, case.q.shape[1] * case.q.shape[2] :].clone()
    q_out = case.q if in_place else torch.full_like(case.q, float("nan"))
    got = call(fn, case, case.positions, *got_caches, q_out=q_out)
    assert got is q_out
    if exact:
        assert torch.equal(got, expected)
        assert torch.equal(got_caches[0], expected_caches[0]) and torch.equal(got_caches[1], expected_caches[1])
    else:
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got_caches[0], expected_caches[0], atol=1e-6, rtol=1e-6)
        assert torch.equal(got_caches[1], expected_caches[1])  # v is copied, never computed
    assert torch.equal(case.qkv[:, case.q.shape[1] * case.q.shape[2] :], kv_before)  # k/v inputs untouched
    assert_untouched_slots(case, *got_caches)


@pytest.fixture(scope="module")
def fused():
    """The kernel's entry point, checked to be running in the interpreter (not silently compiled)."""
    from asyncspec.kernels import rotary_kv_write_triton

    assert isinstance(rotary_kv_write_triton._rotary_kv_write_kernel, InterpretedFunction)
    return rotary_kv_write_triton.rotary_kv_write


class TestInterpreted:
    # Collected only where triton interprets; elsewhere test_interpreter_suite runs it in a child process.
    __test__ = INTERPRETING

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
    def test_matches_reference(self, fused, dtype, heads, kv_heads, head_dim) -> None:
        gen = torch.Generator().manual_seed(heads * 1000 + head_dim)
        check_kernel(fused, make_case(gen, 21, heads, kv_heads, head_dim, dtype, num_pad=3))

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_in_place(self, fused, dtype) -> None:
        check_kernel(fused, make_case(torch.Generator().manual_seed(3), 13, 6, 2, 80, dtype), in_place=True)

    def test_contiguous_inputs_and_default_rope(self, fused) -> None:
        """Qwen3's q/k come out of the per-head norm contiguous; plain RoPE (no scaling)."""
        case = make_case(torch.Generator().manual_seed(4), 11, 4, 2, 64, torch.bfloat16, llama3=False)
        case.q, case.k = case.q.contiguous(), case.k.contiguous()
        check_kernel(fused, case)

    @pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
    def test_cache_dtype_differs(self, fused, dtype, cache_dtype) -> None:
        """k_rot and v are rounded once to the cache dtype, as the reference's `.to(k_cache.dtype)`."""
        case = make_case(torch.Generator().manual_seed(5), 9, 4, 2, 64, dtype, cache_dtype=cache_dtype)
        positions = case.clamped_positions
        expected_caches, got_caches = case.caches(), case.caches()
        call(rotary_kv_write_ref, case, positions, *expected_caches)
        call(fused, case, positions, *got_caches)
        assert torch.equal(got_caches[1], expected_caches[1])
        # Exact even from fp32 activations: the interpreter, like the GPU without FMA, rounds as torch does.
        assert torch.equal(got_caches[0], expected_caches[0])

    def test_padding_rows_with_garbage_positions(self, fused) -> None:
        """Padding rows may carry any position: clamped, no stray load, and (slot -1) nothing written."""
        gen = torch.Generator().manual_seed(6)
        check_kernel(fused, make_case(gen, 10, 4, 2, 64, torch.bfloat16, num_pad=3, garbage_pad_positions=True))

    def test_all_padding_and_empty(self, fused) -> None:
        case = make_case(torch.Generator().manual_seed(7), 3, 4, 2, 64, torch.bfloat16, num_pad=3)
        k_cache, v_cache = case.caches()
        call(fused, case, case.positions, k_cache, v_cache)
        assert k_cache.eq(SENTINEL).all() and v_cache.eq(SENTINEL).all()
        empty = make_case(torch.Generator().manual_seed(8), 0, 4, 2, 64, torch.bfloat16, num_pad=0)
        assert call(fused, empty, empty.positions, *empty.caches()).shape == (0, 4, 64)

    def test_int32_positions_and_slots(self, fused) -> None:
        case = make_case(torch.Generator().manual_seed(9), 7, 4, 2, 64, torch.float16)
        expected_caches, got_caches = case.caches(), case.caches()
        expected = call(rotary_kv_write_ref, case, case.positions, *expected_caches)
        case.slots = case.slots.to(torch.int32)
        got = call(fused, case, case.positions.to(torch.int32), *got_caches)
        assert torch.equal(got, expected) and torch.equal(got_caches[0], expected_caches[0])

    if given is not None:

        @settings(max_examples=10, deadline=None, derandomize=True)
        @given(
            num_tokens=st.integers(1, 12),
            kv_heads=st.sampled_from([1, 2, 3]),
            group=st.sampled_from([1, 2, 4]),
            head_dim=st.sampled_from([2, 16, 48, 64, 80, 96, 112, 128]),
            dtype=st.sampled_from(DTYPES),
            num_pad=st.integers(0, 3),
        )
        def test_random_shapes(self, fused, num_tokens, kv_heads, group, head_dim, dtype, num_pad) -> None:
            gen = torch.Generator().manual_seed(num_tokens * 100 + head_dim)
            case = make_case(gen, num_tokens, kv_heads * group, kv_heads, head_dim, dtype, num_pad=num_pad)
            check_kernel(fused, case)

    @pytest.mark.parametrize("family", ["llama3", "qwen3"])
    def test_model_fused_rotary_is_bit_exact(self, fused, family) -> None:
        """bf16 tiny model, every layer on the fused Triton kernel (attention itself on the torch reference):
        the same hidden states and KV caches, bit for bit, as the separate ops."""
        mixed = dataclasses.replace(TORCH_REFERENCE, name="triton_rotary", rotary_kv_write=fused)
        baseline, baseline_caches = run_tiny_model(family, torch.bfloat16, fused_rotary=False, backend=TORCH_REFERENCE)
        got, got_caches = run_tiny_model(family, torch.bfloat16, fused_rotary=True, backend=mixed)
        for a, b in zip(got + got_caches, baseline + baseline_caches, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)

    def test_model_triton_backend_matches_torch(self, fused, monkeypatch) -> None:
        """ASYNCSPEC_ATTENTION_BACKEND=triton, fp32: every kernel Triton, RoPE + KV write fused (no separate
        write_kv launch), against the torch backend."""
        from asyncspec.kernels import kv_cache_write_triton, rotary_kv_write_triton
        from asyncspec.layers.attention import BACKEND_ENV

        calls = []
        monkeypatch.setattr(
            rotary_kv_write_triton, "rotary_kv_write", lambda *a, **kw: calls.append(1) or fused(*a, **kw)
        )
        monkeypatch.setattr(kv_cache_write_triton, "write_kv_cache", lambda *a, **kw: pytest.fail("separate KV write"))
        monkeypatch.setenv(BACKEND_ENV, "torch")
        expected, expected_caches = run_tiny_model("llama3", torch.float32)
        monkeypatch.setenv(BACKEND_ENV, "triton")
        got, got_caches = run_tiny_model("llama3", torch.float32)
        assert len(calls) == 2 * 2  # two steps, two layers
        # Layer 2's K/V carry layer 1's attention, whose Triton kernel sums in another order: close, not equal.
        for a, b in zip(got + got_caches, expected + expected_caches, strict=True):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5, equal_nan=True)


# --------------------------------------------------------------------------------------- tiny models


def tiny_config(family: str) -> ModelConfig:
    """Two layers, GQA; llama3: scaled RoPE, qwen3: per-head q/k norm (contiguous q/k into the kernel)."""
    common = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITION,
        rms_norm_eps=1e-5,
    )
    if family == "llama3":
        return ModelConfig("LlamaForCausalLM", head_dim=16, rope_theta=500000.0, rope_scaling=LLAMA3, **common)
    return ModelConfig("Qwen3ForCausalLM", head_dim=32, qk_norm=True, attention_bias=True, **common)


def tiny_model(family: str, dtype: torch.dtype, device: str = "cpu") -> LlamaForCausalLM:
    """Dummy weights, widened so that activations (and RoPE's roundings) are not all tiny."""
    model = load_model("", tiny_config(family), dtype, torch.device(device), load_format="dummy")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen).to(device=device, dtype=dtype)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)
    return model


def tiny_models_on_the_skinny_kernel(monkeypatch, kernel_field: str) -> list[int]:
    """From now on `tiny_model` builds models whose linear layers take the skinny kernel (as the engine sets it up,
    from the env at each build), with its `kernel_field` (e.g. "rotary_kernel") recording the rows of every call;
    returns that record."""
    import dataclasses

    from asyncspec.layers import linear as linear_module
    from tests.kernels import test_rotary_kv_write

    calls: list[int] = []
    build = test_rotary_kv_write.tiny_model

    def tiny_model_on_the_kernel(family, dtype, device="cpu"):
        model = build(family, dtype, device)
        skinny = linear_module.make_skinny_linear(torch.device(device))
        kernel = getattr(skinny, kernel_field)
        if kernel is not None:
            recording = lambda x, *a, **kw: calls.append(x.shape[0]) or kernel(x, *a, **kw)  # noqa: E731
            skinny = dataclasses.replace(skinny, **{kernel_field: recording})
        linear_module.use_skinny_linear(model, skinny)
        return model

    monkeypatch.setattr(test_rotary_kv_write, "tiny_model", tiny_model_on_the_kernel)
    return calls


def run_tiny_model(
    family: str,
    dtype: torch.dtype,
    *,
    fused_rotary: bool | None = None,
    backend: AttentionBackend | None = None,
    device: str = "cpu",
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two steps over NaN-poisoned paged caches: prefills of 5 and 3 tokens (the second at RoPE positions past
    4096), then a decode of each, with padding rows (slot -1). Returns the hidden states and the caches.

    fused_rotary / backend, when given, override the model's own selection (from the device and the env)."""
    model = tiny_model(family, dtype, device)
    config = model.config
    if fused_rotary is not None:
        model.model._fused_rotary = fused_rotary
    if backend is not None:
        for layer in model.model.decoder_layers:
            layer.self_attn.attn.backend = backend
    shape = (8, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    caches = [
        (torch.full(shape, float("nan"), dtype=dtype, device=device), torch.full(shape, float("nan"), dtype=dtype))
        for _ in range(config.num_hidden_layers)
    ]
    caches = [(k, v.to(device)) for k, v in caches]
    block_tables = torch.tensor([[5, 1, 6], [2, 7, 0]], dtype=torch.int32, device=device)
    # Request 1's RoPE positions start at 5000 while its cache holds only this test's keys: the slots and the
    # attention follow the request-local index, which is all the kernels need to agree on.
    rope_starts, num_pad = [0, 5000], 2
    gen = torch.Generator().manual_seed(1)
    hidden = []
    for first, lens in ([0, 0], [5, 3]), ([5, 3], [1, 1]):
        local = [i for f, n in zip(first, lens, strict=True) for i in range(f, f + n)]
        rope_positions = [r + i for r, f, n in zip(rope_starts, first, lens, strict=True) for i in range(f, f + n)]
        qsl = torch.tensor([0, lens[0], lens[0] + lens[1]], dtype=torch.int32, device=device)
        seq_lens = [f + n for f, n in zip(first, lens, strict=True)]
        md = AttentionMetadata(
            slot_mapping=compute_slot_mapping_ref(
                block_tables, qsl, torch.tensor(local + [0] * num_pad, device=device), BLOCK_SIZE
            ),
            query_start_loc=qsl,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=block_tables,
            max_query_len=max(lens),
            max_seq_len=max(seq_lens),
            block_size=BLOCK_SIZE,
        )
        ids = torch.randint(0, config.vocab_size, (sum(lens) + num_pad,), generator=gen).to(device)
        positions = torch.tensor(rope_positions + [0] * num_pad, device=device)
        with torch.no_grad():
            hidden.append(model(ids, positions, caches, md)[: sum(lens)])
    return hidden, [c for pair in caches for c in pair]


# ------------------------------------------------------------------------------------------------ gpu


def _compile_for_h100(dtype: str, cache_dtype: str):
    """The kernel compiled for sm_90 on this host (no GPU needed): what the interpreter cannot check."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from asyncspec.kernels import rotary_kv_write_triton

    fn = rotary_kv_write_triton._rotary_kv_write_kernel
    pointers = {"positions_ptr": "*i64", "slot_mapping_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    signature = {}
    for name in fn.arg_names:
        if name.endswith("_ptr"):
            signature[name] = pointers.get(name, f"*{cache_dtype}" if "cache" in name else f"*{dtype}")
        else:
            signature[name] = "constexpr" if name.startswith("BLOCK_") else "i32"
    constexprs = {(fn.arg_names.index(n),): v for n, v in {"BLOCK_H": 32, "BLOCK_KVH": 8, "BLOCK_HALF": 64}.items()}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "enable_fp_fusion": False})


@pytest.mark.skipif(INTERPRETING, reason="compiles the kernel: needs triton not in interpreter mode")
@pytest.mark.parametrize("dtype,cache_dtype", [("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32"), ("bf16", "fp32")])
def test_compiles_for_sm90_without_fma(dtype: str, cache_dtype: str, sm90_compiler) -> None:
    """Compiled, both grid parts share one scf.if, and no product may be fused into an FMA (fp16 would be, as
    fma.rn.f16, without enable_fp_fusion=False): each product must be rounded before the sum, as in torch."""
    ptx = _compile_for_h100(dtype, cache_dtype).asm["ptx"]
    assert "fma." not in ptx
    assert ptx.count("mul.rn.") + ptx.count("mul.f") > 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (64, 8, 128), (32, 32, 80), (28, 4, 128)])
def test_gpu_matches_reference(dtype, heads, kv_heads, head_dim) -> None:
    from asyncspec.kernels.rotary_kv_write_triton import rotary_kv_write

    gen = torch.Generator().manual_seed(heads + head_dim)
    case = make_case(gen, 4099, heads, kv_heads, head_dim, dtype, num_pad=3, device="cuda")
    check_kernel(rotary_kv_write, case)
    check_kernel(rotary_kv_write, case, in_place=True)


@pytest.mark.gpu
def test_gpu_no_sync_and_cuda_graph() -> None:
    """Shapes only on the host: the launch neither syncs nor breaks a CUDA graph, and a replay is exact."""
    from asyncspec.kernels.rotary_kv_write_triton import rotary_kv_write

    case = make_case(torch.Generator().manual_seed(10), 256, 32, 8, 128, torch.bfloat16, device="cuda")
    k_cache, v_cache = case.caches()
    q_out = torch.empty_like(case.q)
    call(rotary_kv_write, case, case.positions, k_cache, v_cache, q_out=q_out)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call(rotary_kv_write, case, case.positions, k_cache, v_cache, q_out=q_out)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(rotary_kv_write, case, case.positions, k_cache, v_cache, q_out=q_out)
    k_cache.fill_(SENTINEL)
    v_cache.fill_(SENTINEL)
    q_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    expected_caches = case.caches()
    expected = call(rotary_kv_write_ref, case, case.positions, *expected_caches)
    assert torch.equal(q_out, expected)
    assert torch.equal(k_cache, expected_caches[0]) and torch.equal(v_cache, expected_caches[1])


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_gpu_model_fused_rotary_is_bit_exact(family) -> None:
    """bf16 on the GPU: the layers' fused kernel (torch attention) against the separate ops, bit for bit."""
    from asyncspec.kernels.rotary_kv_write_triton import rotary_kv_write

    mixed = dataclasses.replace(TORCH_REFERENCE, name="triton_rotary", rotary_kv_write=rotary_kv_write)
    kw = dict(device="cuda")
    baseline, baseline_caches = run_tiny_model(
        family, torch.bfloat16, fused_rotary=False, backend=TORCH_REFERENCE, **kw
    )
    got, got_caches = run_tiny_model(family, torch.bfloat16, fused_rotary=True, backend=mixed, **kw)
    for a, b in zip(got + got_caches, baseline + baseline_caches, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
