"""EngineConfig validation: every bad value or combination is a ConfigError naming the field."""

from __future__ import annotations

import json

import pytest
import torch

from asyncspec import LLM, EngineConfig, SamplingParams
from asyncspec.config import make_config
from asyncspec.errors import ConfigError
from tests.conftest import TARGET_MODEL


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": True}, "max_num_seqs"),
        ({"long_prefill_token_threshold": 1.5}, "long_prefill_token_threshold"),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
        ({"num_kv_blocks": 0}, "num_kv_blocks"),
        ({"kv_cache_bytes": 10.0}, "kv_cache_bytes"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"seed": "1"}, "seed"),
        ({"dtype": "float8"}, "dtype"),
        ({"dtype": "bf16"}, "dtype"),
        ({"generation_config": "off"}, "generation_config"),
        ({"device": "tpu"}, "device"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": "0.5"}, "gpu_memory_utilization"),
        ({"enable_prefix_caching": "false"}, "enable_prefix_caching"),
        ({"enforce_eager": "yes"}, "enforce_eager"),
        ({"worker_process": 1}, "worker_process"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
        ({"load_format": "pt"}, "load_format"),
        ({"async_scheduling": "yes"}, "async_scheduling"),
        ({"max_num_batched_tokens": 8, "max_num_seqs": 16}, "max_num_batched_tokens"),
        ({"long_prefill_token_threshold": 64, "enable_chunked_prefill": False}, "long_prefill_token_threshold"),
        ({"speculative_method": "eagle", "num_speculative_tokens": 4}, "speculative_method"),
        ({"speculative_method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"speculative_method": "ngram", "num_speculative_tokens": 9}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2}, "num_speculative_tokens"),
        ({"draft_model": "models/stdlib-coder-draft"}, "draft_model"),
        (
            {"speculative_method": "ngram", "num_speculative_tokens": 4, "max_num_batched_tokens": 128},
            "max_num_batched_tokens",
        ),
        ({"speculative_method": "draft_model", "num_speculative_tokens": 4, "model": "/tmp/some-model"}, "draft_model"),
        ({"speculative_method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        (
            {
                "speculative_method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 3,
            },
            "prompt_lookup_max",
        ),
        (  # a memory blow-up at the first step, not at start-up
            {"speculative_method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 10**8},
            "prompt_lookup_max must be <= 256",
        ),
    ],
)
def test_bad_config_values_are_config_errors(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**kwargs)


@pytest.mark.parametrize(
    "device, async_scheduling, expected",
    [
        ("cpu", None, False),
        ("cuda", None, True),
        ("cuda:1", None, True),
        ("cuda", False, False),
        ("cpu", True, True),
    ],
)
def test_async_scheduling_defaults_to_on_with_cuda_only(device, async_scheduling, expected):
    """Unset, the asynchronous loop runs on CUDA (measured faster there) and the synchronous one, the
    reference, on the CPU; an explicit choice always wins."""
    config = EngineConfig(device=device, async_scheduling=async_scheduling)
    assert config.use_async_scheduling is expected


def test_async_scheduling_follows_the_device_chosen_when_unset(monkeypatch):
    """With no device given the engine picks CUDA when there is one, and the loop follows it."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert EngineConfig().use_async_scheduling is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert EngineConfig().use_async_scheduling is True


def test_unknown_option_is_named():
    with pytest.raises(ConfigError, match="max_num_sequences"):
        make_config("m", max_num_sequences=4)


def test_offline_generate_is_not_limited_by_the_online_queue_cap():
    llm = LLM(str(TARGET_MODEL), device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=16, max_num_waiting=2)
    outs = llm.generate([[5, 6, 7]] * 5, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [2] * 5
    assert llm.stats()["num_free_kv_blocks"] == 16


@pytest.mark.parametrize(("value", "on"), [("", False), ("0", False), ("false", False), ("1", True), ("on", True)])
def test_debug_invariants_switch_reads_false_as_off(monkeypatch, value, on):
    from asyncspec.engine.engine_core import _debug_invariants_switch

    monkeypatch.setenv("ASYNCSPEC_DEBUG_INVARIANTS", value)
    assert _debug_invariants_switch() is on


def test_debug_invariants_switch_refuses_a_typo(monkeypatch):
    from asyncspec.engine.engine_core import _debug_invariants_switch

    monkeypatch.setenv("ASYNCSPEC_DEBUG_INVARIANTS", "ture")
    with pytest.raises(ConfigError, match="ASYNCSPEC_DEBUG_INVARIANTS must be 0 or 1"):
        _debug_invariants_switch()


@pytest.mark.parametrize("checkpoint", ["float16", "bfloat16", "float32", None])
def test_dtype_spellings_and_auto_follow_vllm(tmp_path, checkpoint):
    """ "half"/"float" are vLLM's names; "auto" on cuda keeps a float16 checkpoint in float16 and runs the others
    in bfloat16 (float32 ones included, as vLLM on a card with bfloat16); the cpu computes in float32."""
    config = {"architectures": ["LlamaForCausalLM"]} | ({"dtype": checkpoint} if checkpoint else {})
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = str(tmp_path)
    assert EngineConfig(model=model, dtype="half").torch_dtype == torch.float16
    assert EngineConfig(model=model, dtype="float").torch_dtype == torch.float32
    expected = torch.float16 if checkpoint == "float16" else torch.bfloat16
    assert EngineConfig(model=model, device="cuda", dtype="auto").torch_dtype == expected
    assert EngineConfig(model=model, device="cuda").torch_dtype == torch.bfloat16
    assert EngineConfig(model=model, device="cpu", dtype="auto").torch_dtype == torch.float32
