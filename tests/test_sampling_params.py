"""SamplingParams validation: every bad value is refused with a message naming the field."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncspec import sampling_params as sp_module
from asyncspec.errors import InvalidSamplingParamsError
from asyncspec.sampling_params import MAX_STOP_STRINGS, MIN_REPETITION_PENALTY, SamplingParams

NAN, INF = float("nan"), float("inf")

BAD_VALUES = [
    ("temperature", -0.1),
    ("temperature", NAN),
    ("temperature", INF),
    ("temperature", True),
    ("temperature", "1.0"),
    ("temperature", None),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", -0.5),
    ("top_p", NAN),
    ("top_p", False),
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_k", 3.0),
    ("top_k", True),
    ("top_k", None),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("min_p", NAN),
    ("min_p", INF),
    ("seed", 2**63),
    ("seed", -(2**63) - 1),
    ("seed", 1.0),
    ("seed", True),
    ("seed", "7"),
    ("presence_penalty", 2.01),
    ("presence_penalty", -2.01),
    ("presence_penalty", NAN),
    ("frequency_penalty", 2.5),
    ("frequency_penalty", -INF),
    ("frequency_penalty", True),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", INF),
    ("repetition_penalty", NAN),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 1.0),
    ("max_tokens", True),
    ("max_tokens", INF),
    ("min_tokens", -1),
    ("min_tokens", 2.0),
    ("min_tokens", False),
    ("ignore_eos", 1),
    ("ignore_eos", "yes"),
    ("include_stop_str_in_output", None),
    ("skip_special_tokens", 0),
    ("stop", [""]),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", [1]),
    ("stop", 5),
    ("stop", b"x"),
    ("stop", ["x" * 1025]),
    ("stop", [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", 3),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", 1.0),
    ("logprobs", True),
    ("n", 2),
    ("n", 0),
    ("n", 1.0),
    ("n", True),
    ("prompt_logprobs", 0),
    ("prompt_logprobs", 5),
    # Values that passed validation and then failed in the worker's int64 / float32 device tables
    # (regression: one of them used to end every stream of the AsyncEngine).
    ("top_k", 2**63),
    ("top_k", 2**100),
    ("temperature", 1e39),
    ("temperature", 3.5e38),
    ("repetition_penalty", 1e39),
    ("repetition_penalty", 1e-38),
    ("repetition_penalty", 1e-46),
    ("repetition_penalty", 5e-324),
    ("top_p", 1e-46),
    ("max_tokens", 2**63),
    ("min_tokens", 2**64),
    ("stop_token_ids", [2**63]),
    ("temperature", 10**400),
    ("min_p", 10**400),
]


@pytest.mark.parametrize("name,value", BAD_VALUES, ids=[f"{n}={v!r}"[:40] for n, v in BAD_VALUES])
def test_bad_value_raises_naming_field(name: str, value: object) -> None:
    with pytest.raises(InvalidSamplingParamsError) as info:
        SamplingParams(**{name: value})
    assert name in str(info.value)
    assert "must be" in str(info.value)


def test_edge_of_device_ranges_is_accepted() -> None:
    """The largest values the device tables hold pass: the bounds are the tables', not tighter."""
    p = SamplingParams(
        top_k=2**63 - 1,
        temperature=3.4e38,
        seed=-(2**63),
        max_tokens=2**63 - 1,
        repetition_penalty=sp_module.MIN_REPETITION_PENALTY,
        stop_token_ids=[2**63 - 1],
    )
    assert p.top_k == 2**63 - 1 and p.max_tokens == 2**63 - 1


def test_fields_changed_after_construction_are_checked_again_by_the_engine() -> None:
    p = SamplingParams()
    p.top_k = 2**63
    with pytest.raises(InvalidSamplingParamsError, match="top_k"):
        p.validate_for_engine(max_stop_strings=MAX_STOP_STRINGS, vocab_size=8192)


def test_message_names_value_and_range() -> None:
    with pytest.raises(InvalidSamplingParamsError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(InvalidSamplingParamsError, match=r"temperature .*got nan"):
        SamplingParams(temperature=NAN)


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(InvalidSamplingParamsError, match="min_tokens must be <= max_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    SamplingParams(max_tokens=None, min_tokens=10_000)
    SamplingParams(max_tokens=5, min_tokens=5)


def test_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        SamplingParams(top_k=-7)


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1.0, 1.0, 0, 0.0, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.ignore_eos, p.logprobs) == (16, 0, False, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.include_stop_str_in_output and p.skip_special_tokens
    assert not p.is_greedy and not p.uses_penalties
    assert (p.n, p.prompt_logprobs) == (1, None)


def test_vllm_fields_it_does_not_support_are_refused_with_what_to_do_instead() -> None:
    """n > 1 and prompt_logprobs, vLLM's, are taken only at their defaults: the error says what to do, not Python's
    unexpected keyword argument."""
    with pytest.raises(InvalidSamplingParamsError, match=r"n must be 1 .*submit the prompt several times"):
        SamplingParams(n=4, seed=3)
    with pytest.raises(InvalidSamplingParamsError, match=r"prompt_logprobs must be None .*not supported\), got 1"):
        SamplingParams(prompt_logprobs=1)
    assert SamplingParams(n=1, prompt_logprobs=None).n == 1


def test_normalisation() -> None:
    p = SamplingParams(stop="###", stop_token_ids=(5, 6), temperature=1, top_k=-1)
    assert p.stop == ["###"] and p.stop_token_ids == [5, 6]
    assert isinstance(p.temperature, float)
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]


def test_helpers() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy
    p = SamplingParams(stop=["a", "abcd"], stop_token_ids=[7])
    assert p.max_stop_str_len == 4 and SamplingParams().max_stop_str_len == 0
    assert p.all_stop_token_ids([0, 1]) == {0, 1, 7}
    assert SamplingParams(stop_token_ids=[7], ignore_eos=True).all_stop_token_ids([0]) == {7}
    assert SamplingParams(repetition_penalty=1.1).uses_penalties


def test_validate_for_engine() -> None:
    many = [f"s{i}" for i in range(MAX_STOP_STRINGS)]
    p = SamplingParams(stop=many, stop_token_ids=[0, 8191])
    p.validate_for_engine(max_stop_strings=MAX_STOP_STRINGS, vocab_size=8192)
    with pytest.raises(InvalidSamplingParamsError, match="stop must be at most 4 strings"):
        p.validate_for_engine(max_stop_strings=4, vocab_size=8192)
    with pytest.raises(
        InvalidSamplingParamsError, match=r"stop_token_ids\[1\] must be a token id in \[0, 8000\), got 8191"
    ):
        p.validate_for_engine(max_stop_strings=32, vocab_size=8000)


def test_module_limit_can_be_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sp_module, "MAX_STOP_STRINGS", 64)
    SamplingParams(stop=[f"s{i}" for i in range(40)]).validate_for_engine(64, 100)


valid_params = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.floats(0.0, 100.0),
        "top_p": st.floats(1e-40, 1.0),
        "top_k": st.integers(-1, 100_000),
        "min_p": st.floats(0.0, 1.0),
        "seed": st.none() | st.integers(-(2**63), 2**63 - 1),
        "presence_penalty": st.floats(-2.0, 2.0),
        "frequency_penalty": st.floats(-2.0, 2.0),
        "repetition_penalty": st.floats(sp_module.MIN_REPETITION_PENALTY, 10.0),
        "ignore_eos": st.booleans(),
        "stop": st.none()
        | st.text(min_size=1, max_size=1024)
        | st.lists(st.text(min_size=1, max_size=50), max_size=MAX_STOP_STRINGS),
        "stop_token_ids": st.lists(st.integers(0, 2**31), max_size=8),
        "include_stop_str_in_output": st.booleans(),
        "logprobs": st.none() | st.integers(0, 20),
        "skip_special_tokens": st.booleans(),
    },
)


@settings(max_examples=300, deadline=None)
@given(kwargs=valid_params, max_tokens=st.none() | st.integers(1, 1 << 20), data=st.data())
def test_valid_values_never_raise(kwargs: dict, max_tokens: int | None, data: st.DataObject) -> None:
    min_tokens = data.draw(st.integers(0, max_tokens if max_tokens is not None else 1 << 20))
    p = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, **kwargs)
    assert isinstance(p.stop, list) and all(isinstance(s, str) and s for s in p.stop)
    assert math.isfinite(p.temperature)
    assert p.max_stop_str_len <= 1024


def test_a_long_bad_value_is_quoted_short() -> None:
    """An error quotes at most 200 characters of the value (a gRPC status must stay under 16 KiB)."""
    with pytest.raises(InvalidSamplingParamsError, match=r"stop_token_ids must be .*\.\.\. \(10002 characters\)$") as e:
        SamplingParams(stop_token_ids="x" * 10000)  # type: ignore[arg-type]
    assert len(str(e.value)) < 400


def test_the_minimum_repetition_penalty_is_accepted_as_a_float32() -> None:
    """The gRPC field is a float32: the documented minimum 1e-4 arrives as 9.9999997e-05."""
    as_float32 = float(np.float32(MIN_REPETITION_PENALTY))
    assert as_float32 < MIN_REPETITION_PENALTY
    assert SamplingParams(repetition_penalty=as_float32).repetition_penalty == as_float32
    with pytest.raises(InvalidSamplingParamsError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=float(np.nextafter(np.float32(MIN_REPETITION_PENALTY), np.float32(0))))
