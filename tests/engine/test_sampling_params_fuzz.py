"""Property: any SamplingParams a client can build is either refused with a typed error naming a
field, or served to completion by the AsyncEngine, and never disturbs a well-behaved neighbour.

Values of every field are drawn from the edges of what the engine holds (int64 and float32 limits,
subnormals, NaN, inf, wrong types, huge lists), mixed with ordinary ones.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncspec import AsyncEngine, SamplingParams
from asyncspec.config import make_config
from asyncspec.errors import AsyncSpecError, InvalidRequestError, InvalidSamplingParamsError, RequestFailedError
from tests.conftest import TARGET_MODEL, load_prompts
from tests.engine.engine_helpers import (
    assert_ids_in_vocab,
    bundled_llm,
    wait_kv_free,
)

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = dict(device="cpu", dtype="float32", max_model_len=48, num_kv_blocks=24, max_num_batched_tokens=64)
NEIGHBOUR = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]

EDGE_VALUES = [
    0,
    1,
    -1,
    2,
    3,
    20,
    21,
    2**31 - 1,
    2**31,
    2**32 + 1,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64,
    -(2**63),
    -(2**63) - 1,
    10**30,
    10**400,
    0.0,
    -0.0,
    1e-46,
    5e-324,
    1e-38,
    1e-5,
    0.5,
    1.0,
    1.5,
    2.0,
    2.5,
    1e4,
    3.4e38,
    3.5e38,
    1e39,
    1e308,
    float("nan"),
    float("inf"),
    float("-inf"),
    -1e39,
    True,
    False,
    None,
    "",
    "1",
    "\n",
    b"x",
    [],
    [1],
    {},
    (0,),
    1j,
]
scalar = st.sampled_from(EDGE_VALUES) | st.integers() | st.floats() | st.floats(0.0, 2.0) | st.integers(-2, 40)
listish = (
    st.lists(st.sampled_from(EDGE_VALUES) | st.integers(0, 8191) | st.text(max_size=4), max_size=6)
    | st.text(max_size=3)
    | st.just(list(range(8192)))  # every token id: with min_tokens, nothing is left to sample
)
ORDINARY = {
    "temperature": st.floats(0.0, 2.0),
    "top_p": st.floats(0.05, 1.0),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0.0, 0.5),
    "seed": st.none() | st.integers(-(2**63), 2**63 - 1),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(0.5, 2.0),
    "max_tokens": st.none() | st.integers(1, 64),
    "min_tokens": st.integers(0, 4),
    "ignore_eos": st.booleans(),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 8191), max_size=3),
    "include_stop_str_in_output": st.booleans(),
    "logprobs": st.none() | st.integers(0, 20),
    "skip_special_tokens": st.booleans(),
    "n": st.just(1),
    "prompt_logprobs": st.none(),
}
assert set(ORDINARY) == set(FIELDS), "every SamplingParams field is fuzzed"


def _value(name: str) -> st.SearchStrategy:
    wild = (listish | scalar) if name in ("stop", "stop_token_ids") else scalar
    return ORDINARY[name] | wild


# A few fields per draw, half of them ordinary, so that a fair share of the draws is valid and
# really gets served.
wild_kwargs = st.lists(st.sampled_from(FIELDS), max_size=4, unique=True).flatmap(
    lambda names: st.fixed_dictionaries({name: _value(name) for name in names})
)


@pytest.fixture(scope="module")
def engine(one_thread):
    eng = AsyncEngine(make_config(str(TARGET_MODEL), **CONFIG))
    yield eng
    asyncio.run(eng.shutdown())


@pytest.fixture(scope="module")
def outcomes() -> dict[str, int]:
    return {"refused": 0, "served": 0, "refused_by_engine": 0, "failed_alone": 0}


@pytest.fixture(scope="module")
def prompts():
    return [p[:12] for p in load_prompts(2)]


@pytest.fixture(scope="module")
def neighbour_alone(prompts, one_thread):
    return bundled_llm(**CONFIG).generate(prompts[:1], NEIGHBOUR)[0].token_ids


def _named_field(error: Exception) -> str:
    match = re.search(r"SamplingParams\.(\w+)", str(error))
    assert match, f"the error does not name a field: {error}"
    return match.group(1)


async def _serve_beside_neighbour(engine, prompts, params):
    async def collect(prompt, p, request_id):
        return [d async for d in engine.generate(prompt, p, request_id=request_id)]

    neighbour = asyncio.create_task(collect(prompts[0], NEIGHBOUR, "neighbour"))
    await asyncio.sleep(0)
    try:
        wild: list | Exception = await collect(prompts[1], params, "wild")
    except (InvalidSamplingParamsError, InvalidRequestError, RequestFailedError) as e:
        wild = e
    return await neighbour, wild, await wait_kv_free(engine)


@settings(
    max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(kwargs=wild_kwargs)
def test_any_sampling_params_are_refused_by_name_or_served(engine, prompts, neighbour_alone, outcomes, kwargs):
    try:
        params = SamplingParams(**kwargs)
    except InvalidSamplingParamsError as e:
        outcomes["refused"] += 1
        name = _named_field(e)
        assert name in kwargs, (name, kwargs)
        if name != "min_tokens":  # min_tokens > max_tokens is about two fields
            with pytest.raises(InvalidSamplingParamsError, match=name):
                SamplingParams(**{name: kwargs[name]})
        return
    except TypeError as e:  # only for names that are not fields; every drawn name is one
        raise AssertionError(f"untyped error for {kwargs}: {e!r}") from e

    neighbour, wild, _ = asyncio.run(asyncio.wait_for(_serve_beside_neighbour(engine, prompts, params), 60))
    assert [t for d in neighbour for t in d.token_ids] == neighbour_alone
    if isinstance(wild, AsyncSpecError):
        if isinstance(wild, InvalidSamplingParamsError):
            assert _named_field(wild) in kwargs  # engine limits: stop ids outside the vocabulary
            outcomes["refused_by_engine"] += 1
        elif isinstance(wild, RequestFailedError):
            assert "no valid token" in str(wild)  # every candidate token blocked
            outcomes["failed_alone"] += 1
        else:
            raise AssertionError(f"unexpected error for {kwargs}: {wild!r}")
        return
    outcomes["served"] += 1
    assert wild and wild[-1].finish_reason in ("stop", "length")
    assert all(d.finish_reason is None for d in wild[:-1])
    tokens = [t for d in wild for t in d.token_ids]
    assert_ids_in_vocab(tokens)
    if params.max_tokens is not None:
        assert len(tokens) <= params.max_tokens
    assert len(prompts[1]) + len(tokens) <= CONFIG["max_model_len"]


def test_the_property_served_many_requests(outcomes):
    """Guards the property above against vacuity: many draws were valid and really served."""
    assert outcomes["served"] >= 20 and outcomes["refused"] >= 20, outcomes
