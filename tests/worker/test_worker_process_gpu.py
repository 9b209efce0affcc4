"""worker_process=True on one GPU: the model in a worker process of its own computes exactly what the
in-process runner does (fp32 greedy, CUDA graphs on, the draft model and the asynchronous loop)."""

from __future__ import annotations

import gc

import pytest
import torch

from asyncspec import LLM, SamplingParams
from asyncspec.worker.tp_executor import TensorParallelExecutor
from tests.conftest import DRAFT_MODEL, TARGET_MODEL, load_prompts

pytestmark = pytest.mark.gpu

CONFIG = dict(
    dtype="float32",
    max_model_len=1024,
    max_num_seqs=8,
    gpu_memory_utilization=0.3,
    async_scheduling=True,
    speculative_method="draft_model",
    draft_model=str(DRAFT_MODEL),
    num_speculative_tokens=4,
)


def test_worker_process_on_one_gpu_equals_in_process() -> None:
    prompts = load_prompts(8)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    llm = LLM(str(TARGET_MODEL), **CONFIG)
    reference = [o.token_ids for o in llm.generate(prompts, params)]
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()  # the worker process counts memory held here as taken
    with LLM(str(TARGET_MODEL), worker_process=True, **CONFIG) as llm:
        assert isinstance(llm.engine.engine_core.runner, TensorParallelExecutor)
        assert [o.token_ids for o in llm.generate(prompts, params)] == reference
        stats = llm.stats()
        assert stats["cuda_graph_replays"] > 20 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
