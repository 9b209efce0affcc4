"""asyncspec: an asynchronous LLM inference engine with built-in speculative decoding."""

from asyncspec.config import EngineConfig
from asyncspec.engine.async_engine import AsyncEngine
from asyncspec.engine.llm import LLM
from asyncspec.outputs import RequestOutput
from asyncspec.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncEngine", "EngineConfig", "SamplingParams", "RequestOutput"]
