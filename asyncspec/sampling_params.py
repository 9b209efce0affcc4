"""SamplingParams: vLLM-compatible per-request sampling options, validated up front.

Every check raises InvalidSamplingParamsError naming the field, the value and the allowed
range, so the gRPC layer can turn it into INVALID_ARGUMENT without guessing.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncspec.errors import InvalidSamplingParamsError

MAX_STOP_STRINGS = 16
"""Default limit on stop strings per request; the engine re-checks its own via validate_for_engine."""
MAX_STOP_STR_LEN = 1024
"""Longest stop string in characters (it bounds the detokenizer's look-back window)."""
MAX_LOGPROBS = 20
"""Most top-n logprobs a request may ask for."""
SAMPLING_EPS = 1e-5
"""Temperatures below this are treated as greedy (dividing by them would overflow)."""
MIN_REPETITION_PENALTY = 1e-4
"""Smallest repetition penalty: a seen logit is divided by it, and a smaller divisor would push
logits of ordinary magnitude towards float32 overflow (a NaN softmax row)."""
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""Range of every integer field: the worker keeps them in int64 device tables."""
FLOAT32_MAX = float(np.finfo(np.float32).max)
"""Largest magnitude of every real field: the worker keeps them in float32 device tables."""


_MAX_VALUE_REPR = 200
"""Characters of a bad value an error quotes: a list of thousands of ids would not fit a gRPC status."""


def _err(name: str, value: Any, allowed: str) -> InvalidSamplingParamsError:
    text = repr(value)
    if len(text) > _MAX_VALUE_REPR:
        text = f"{text[:_MAX_VALUE_REPR]}... ({len(text)} characters)"
    return InvalidSamplingParamsError(f"SamplingParams.{name} must be {allowed}, got {text}")


def _real(name: str, value: Any, allowed: str) -> float:
    """Accepts int/float (not bool: True is almost always a typo); rejects NaN, inf and anything
    a float32 device table cannot hold."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _err(name, value, f"a number ({allowed})")
    try:
        value = float(value)
    except OverflowError:  # an int too large for a float
        raise _err(name, value, f"a finite float32 number ({allowed})") from None
    if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        raise _err(name, value, f"a finite float32 number ({allowed})")
    return value


def _int(name: str, value: Any, allowed: str) -> int:
    """Accepts integers (not bool, not float: 3.0 for an integer field is a client bug worth
    surfacing) that an int64 device table can hold."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _err(name, value, f"an integer ({allowed})")
    value = int(value)
    if not INT64_MIN <= value <= INT64_MAX:
        raise _err(name, value, f"a 64-bit signed integer ({allowed})")
    return value


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _err(name, value, "a bool")
    return value


@dataclass
class SamplingParams:
    """How to sample one request's tokens and when to stop (field names and defaults as vLLM)."""

    temperature: float = 1.0
    """Softmax temperature, >= 0; 0 (anything below 1e-5) means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to >= top_p, in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's, in [0, 1]."""
    seed: int | None = None
    """Seed of this request's own generator (any 64-bit signed integer): its tokens then do not
    depend on batch neighbours. All 64 bits count: distinct seeds give distinct streams on every
    device (see `asyncspec.layers.sampler.make_generator` for how the seed becomes generator state)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted once per earlier occurrence of a token in the output, in [-2, 2]."""
    repetition_penalty: float = 1.0
    """Divides positive / multiplies negative logits of prompt and output tokens, >= 1e-4 (1 = off)."""
    max_tokens: int | None = 16
    """Most tokens to generate, >= 1; None means up to max_model_len."""
    min_tokens: int = 0
    """EOS and stop token ids are blocked, and stop strings ignored, until this many tokens exist."""
    ignore_eos: bool = False
    """Keep generating past EOS tokens (stop_token_ids still stop)."""
    stop: list[str] = field(default_factory=list)
    """Strings that end generation when they appear in the output; a single str or None is accepted."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation (in addition to EOS); None is accepted."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the output text."""
    logprobs: int | None = None
    """Return the sampled token's logprob plus this many top logprobs (0..20); None = none."""
    skip_special_tokens: bool = True
    """Leave special tokens (e.g. <|endoftext|>) out of the output text."""
    n: int = 1
    """Completions per request: 1 only (vLLM's field, taken so that its refusal is clear); for several, submit the
    prompt several times, each with its own seed (the prefix cache computes the prompt once)."""
    prompt_logprobs: int | None = None
    """Logprobs of the prompt's own tokens: None only (vLLM's field; not supported)."""

    def __post_init__(self) -> None:
        self.temperature = _real("temperature", self.temperature, ">= 0; 0 means greedy")
        if self.temperature < 0:
            raise _err("temperature", self.temperature, ">= 0 (0 means greedy)")
        self.top_p = _real("top_p", self.top_p, "in (0, 1]")
        # float32 is what the device table holds: 1e-46 > 0 would become top_p = 0 there.
        if not 0.0 < self.top_p <= 1.0:
            raise _err("top_p", self.top_p, "in (0, 1]")
        if np.float32(self.top_p) == 0:
            raise _err("top_p", self.top_p, "in (0, 1] and not 0 as a float32 (>= 1e-45)")
        self.top_k = _int("top_k", self.top_k, ">= 1, or 0 / -1 to disable")
        if self.top_k < -1:
            raise _err("top_k", self.top_k, ">= 1, or 0 / -1 to disable")
        self.min_p = _real("min_p", self.min_p, "in [0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise _err("min_p", self.min_p, "in [0, 1]")
        if self.seed is not None:
            self.seed = _int("seed", self.seed, f"in [{INT64_MIN}, {INT64_MAX}] or None")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _real(name, getattr(self, name), "in [-2, 2]")
            if not -2.0 <= value <= 2.0:
                raise _err(name, value, "in [-2, 2]")
            setattr(self, name, value)
        allowed = f">= {MIN_REPETITION_PENALTY} (1 = off)"
        self.repetition_penalty = _real("repetition_penalty", self.repetition_penalty, allowed)
        # Compared as the float32 the device table holds: 1e-4 sent as a float32 (gRPC) reads 9.9999997e-05.
        if np.float32(self.repetition_penalty) < np.float32(MIN_REPETITION_PENALTY):
            raise _err("repetition_penalty", self.repetition_penalty, allowed)
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens, ">= 1 or None")
            if self.max_tokens < 1:
                raise _err("max_tokens", self.max_tokens, ">= 1 or None")
        self.min_tokens = _int("min_tokens", self.min_tokens, ">= 0")
        if self.min_tokens < 0:
            raise _err("min_tokens", self.min_tokens, ">= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _err("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _bool(name, getattr(self, name))
        self.stop = self._normalise_stop(self.stop)
        self._check_num_stop_strings(MAX_STOP_STRINGS)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        one = "1 (one completion a request: submit the prompt several times, each with its own seed, for several)"
        if _int("n", self.n, one) != 1:
            raise _err("n", self.n, one)
        self.n = 1
        if self.prompt_logprobs is not None:
            raise _err("prompt_logprobs", self.prompt_logprobs, "None (prompt logprobs are not supported)")
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs, f"in [0, {MAX_LOGPROBS}] or None")
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise _err("logprobs", self.logprobs, f"in [0, {MAX_LOGPROBS}] or None")

    @staticmethod
    def _normalise_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise _err("stop", stop, "a string, a list of strings or None")
        for i, s in enumerate(stop):
            if not isinstance(s, str):
                raise _err(f"stop[{i}]", s, "a string")
            if not s:
                raise _err(f"stop[{i}]", s, "a non-empty string")
            if len(s) > MAX_STOP_STR_LEN:
                raise _err(
                    f"stop[{i}]", f"{s[:32]}... ({len(s)} chars)", f"a string of at most {MAX_STOP_STR_LEN} chars"
                )
        return list(stop)

    @staticmethod
    def _normalise_stop_token_ids(ids: Any) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            raise _err("stop_token_ids", ids, "a list of non-negative integers or None")
        out = []
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= int(t) <= INT64_MAX:
                raise _err(f"stop_token_ids[{i}]", t, "a non-negative integer (a token id)")
            out.append(int(t))
        return out

    def _check_num_stop_strings(self, limit: int) -> None:
        if len(self.stop) > limit:
            raise _err("stop", f"{len(self.stop)} strings", f"at most {limit} strings")

    def validate_for_engine(self, max_stop_strings: int, vocab_size: int) -> None:
        """Checks the limits that depend on the engine (its stop-string cap, the vocabulary), after
        validating every field again: the dataclass is mutable, and a field changed after
        construction must not reach the worker's device tables unchecked."""
        self.__post_init__()
        self._check_num_stop_strings(max_stop_strings)
        for i, t in enumerate(self.stop_token_ids):
            if not 0 <= t < vocab_size:
                raise _err(f"stop_token_ids[{i}]", t, f"a token id in [0, {vocab_size})")

    # -- helpers ----------------------------------------------------------------------
    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def multi_step_decodable(self) -> bool:
        """Whether a greedy decode step samples this request whole (the argmax, nothing the sampler adds): the
        condition for running several decode steps per plan (EngineConfig.num_scheduler_steps)."""
        return self.is_greedy and not self.uses_penalties and self.logprobs is None and self.min_tokens == 0

    def all_stop_token_ids(self, eos_token_ids: Iterable[int]) -> frozenset[int]:
        """Token ids that end this request: stop_token_ids plus EOS unless ignore_eos."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.update(eos_token_ids)
        return frozenset(ids)

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)
