"""ModelConfig.from_pretrained against transformers' own config classes and hand-written config.json files."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from asyncspec.errors import ModelLoadError
from asyncspec.models.model_config import SUPPORTED_ARCHITECTURES, ModelConfig

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
}


FAMILIES = [
    (LlamaConfig, "LlamaForCausalLM"),
    (MistralConfig, "MistralForCausalLM"),
    (Qwen2Config, "Qwen2ForCausalLM"),
    (Qwen3Config, "Qwen3ForCausalLM"),
]


def _write(tmp_path, cfg: dict, gen: dict | None = None) -> str:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    if gen is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    return str(tmp_path)


@pytest.mark.parametrize("hf_cls,arch", FAMILIES)
def test_fields_match_transformers_config(tmp_path, hf_cls, arch) -> None:
    hf = hf_cls(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        eos_token_id=7,
        bos_token_id=6,
        architectures=[arch],
    )
    hf.save_pretrained(str(tmp_path))
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    assert cfg.architecture == arch
    for name in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "bos_token_id",
    ):
        assert getattr(cfg, name) == getattr(hf, name), name
    assert cfg.head_dim == (getattr(hf, "head_dim", None) or 64 // 8)
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"] and cfg.rope_scaling is None
    assert cfg.eos_token_ids == [7]
    assert cfg.attention_bias == (arch == "Qwen2ForCausalLM")
    assert cfg.o_proj_bias is False
    assert cfg.qk_norm == (arch == "Qwen3ForCausalLM")
    # Mistral defaults to a 4096 window; Qwen ignores its window unless use_sliding_window.
    assert cfg.sliding_window == (4096 if arch == "MistralForCausalLM" else None)


def test_defaults_for_optional_keys(tmp_path) -> None:
    cfg = ModelConfig.from_pretrained(_write(tmp_path, BASE))
    assert cfg.num_key_value_heads == 8 and cfg.head_dim == 8
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert cfg.eos_token_ids == [] and cfg.torch_dtype is None and cfg.sliding_window is None


def test_legacy_rope_keys_and_llama3_scaling(tmp_path) -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = ModelConfig.from_pretrained(
        _write(tmp_path, {**BASE, "rope_theta": 500000.0, "rope_scaling": scaling, "torch_dtype": "bfloat16"})
    )
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == scaling and cfg.torch_dtype == "bfloat16"


def test_rope_parameters_form_and_linear_with_old_type_key(tmp_path) -> None:
    cfg = ModelConfig.from_pretrained(
        _write(tmp_path, {**BASE, "rope_parameters": {"rope_theta": 1000.0, "rope_type": "linear", "factor": 2.0}})
    )
    assert cfg.rope_theta == 1000.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    cfg = ModelConfig.from_pretrained(_write(tmp_path, {**BASE, "rope_scaling": {"type": "linear", "factor": 3.0}}))
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 3.0}


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "yarn", "factor": 4.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "llama3", "factor": 8.0},
    ],
)
def test_unsupported_or_incomplete_rope_is_rejected(tmp_path, rope) -> None:
    with pytest.raises(ModelLoadError, match=rope["rope_type"]):
        ModelConfig.from_pretrained(_write(tmp_path, {**BASE, "rope_scaling": rope}))


def test_rope_scaling_beside_rope_parameters_must_agree(tmp_path) -> None:
    """A transformers-5 config (rope_parameters) with a rope_scaling added by hand, as model cards ask for long
    context: transformers reads rope_scaling, the older key, first. A scaling that disagrees is refused, never
    dropped; the same scaling spelled either way loads."""
    params = {"rope_theta": 1e6, "rope_type": "default"}
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    with pytest.raises(ModelLoadError, match="rope_parameters .* rope_scaling .* disagree"):
        ModelConfig.from_pretrained(_write(tmp_path, {**BASE, "rope_parameters": params, "rope_scaling": yarn}))
    linear = {"rope_theta": 1e6, "rope_type": "linear", "factor": 2.0}
    cfg = ModelConfig.from_pretrained(
        _write(tmp_path, {**BASE, "rope_parameters": linear, "rope_scaling": {"type": "linear", "factor": 2.0}})
    )
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("hf_cls,arch", FAMILIES)
def test_keys_left_out_take_transformers_defaults(tmp_path, hf_cls, arch) -> None:
    """max_position_embeddings, Mistral's sliding_window and Qwen's max_window_layers, when a config omits them."""
    extra = {"use_sliding_window": True, "sliding_window": 16} if arch.startswith("Qwen") else {}
    hf = hf_cls(**{**BASE, "num_hidden_layers": 30, **extra, "architectures": [arch]})
    cfg = ModelConfig.from_pretrained(
        _write(tmp_path, {**BASE, "num_hidden_layers": 30, **extra, "architectures": [arch]})
    )
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    windows = [cfg.sliding_window_for_layer(i) for i in range(30)]
    if arch == "MistralForCausalLM":
        assert windows == [hf.sliding_window] * 30 == [4096] * 30
    elif arch.startswith("Qwen"):
        assert windows == [16 if i >= hf.max_window_layers else None for i in range(30)]
        assert windows[27:] == [None, 16, 16]
    else:
        assert windows == [None] * 30


def test_eos_ids_merge_config_and_generation_config(tmp_path) -> None:
    path = _write(tmp_path, {**BASE, "eos_token_id": [5, 9]}, gen={"eos_token_id": [9, 11]})
    assert ModelConfig.from_pretrained(path).eos_token_ids == [5, 9, 11]
    path = _write(tmp_path, {**BASE, "eos_token_id": 2}, gen={"eos_token_id": 3})
    assert ModelConfig.from_pretrained(path).eos_token_ids == [2, 3]


def test_sampling_defaults_are_the_sampling_keys_generation_config_sets(tmp_path) -> None:
    """Llama-3-Instruct's generation_config.json with a top_k: its sampling keys are taken under SamplingParams'
    names (max_new_tokens as max_tokens), do_sample is not one, a null is not set; vLLM under transformers 5
    (GenerationConfig defaults all None) takes an explicit top_k of 50 too. Unchecked here: the engine checks
    them where it takes them."""
    gen = {
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 50,
        "min_p": None,
        "max_new_tokens": 100,
        "eos_token_id": [1, 2],
    }
    cfg = ModelConfig.from_pretrained(_write(tmp_path, BASE, gen=gen))
    assert cfg.sampling_defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 50, "max_tokens": 100}
    cfg = ModelConfig.from_pretrained(_write(tmp_path, BASE, gen={"top_p": 0.0, "repetition_penalty": 1.0}))
    assert cfg.sampling_defaults == {"top_p": 0.0, "repetition_penalty": 1.0}
    (tmp_path / "generation_config.json").unlink()
    assert ModelConfig.from_pretrained(str(tmp_path)).sampling_defaults == {}


@pytest.mark.parametrize(
    "change,match",
    [
        ({"vocab_size": None}, "vocab_size must be a positive integer, got None"),
        ({"hidden_size": "64"}, "hidden_size must be a positive integer"),
        ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer, got 0"),
        ({"rms_norm_eps": "small"}, "rms_norm_eps must be a number, got 'small'"),
        ({"max_position_embeddings": [1]}, r"max_position_embeddings must be a number, got \[1\]"),
        ({"max_position_embeddings": 2048.5}, "max_position_embeddings must be an integer, got 2048.5"),
        ({"num_key_value_heads": "2"}, "num_key_value_heads must be a number"),
        ({"num_key_value_heads": -2}, "num_key_value_heads must be at least 1, got -2"),
        ({"head_dim": -64}, "head_dim must be at least 1, got -64"),
        ({"max_position_embeddings": -5}, "max_position_embeddings must be at least 1, got -5"),
        ({"max_position_embeddings": 0}, "max_position_embeddings must be at least 1, got 0"),
        ({"rms_norm_eps": -1}, "rms_norm_eps must be at least 0, got -1"),
        ({"eos_token_id": "</s>"}, "eos_token_id must be a number, got '</s>'"),
        ({"eos_token_id": [2, 2.5]}, "eos_token_id must be an integer, got 2.5"),
        ({"eos_token_id": -1}, "eos_token_id must be at least 0, got -1"),
        ({"rope_theta": None, "rope_scaling": {"rope_type": "linear", "factor": 2, "rope_theta": "1e4"}}, "rope_theta"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "'linear' factor must be a positive number, got 0"),
        ({"rope_scaling": {"rope_type": "linear", "factor": None}}, "factor must be a positive number, got None"),
    ],
)
def test_nulls_and_wrong_types_are_load_errors_naming_the_file(tmp_path, change, match) -> None:
    with pytest.raises(ModelLoadError, match=f"config.json: .*{match}"):
        ModelConfig.from_pretrained(_write(tmp_path, {**BASE, **change}))


@pytest.mark.parametrize("eos", ["</s>", [1, None], True])
def test_a_bad_eos_id_in_generation_config_is_a_load_error_naming_that_file(tmp_path, eos) -> None:
    path = _write(tmp_path, BASE, gen={"eos_token_id": eos})
    with pytest.raises(ModelLoadError, match=r"generation_config.json: eos_token_id must be a number"):
        ModelConfig.from_pretrained(path)


def test_an_unreadable_generation_config_is_recorded_not_raised(tmp_path) -> None:
    """The engine decides (it refuses under generation_config="auto" only); config.json is still read whole."""
    path = _write(tmp_path, {**BASE, "eos_token_id": 7})
    (tmp_path / "generation_config.json").write_text("{not json")
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.eos_token_ids == [7] and cfg.sampling_defaults == {}
    assert "generation_config.json: cannot be read as JSON" in (cfg.generation_config_error or "")
    assert ModelConfig.from_pretrained(_write(tmp_path, BASE, gen={})).generation_config_error is None


def test_a_null_partial_rotary_factor_is_the_default(tmp_path) -> None:
    """transformers reads a null as absent (1.0), as for the other optional keys."""
    cfg = ModelConfig.from_pretrained(_write(tmp_path, {**BASE, "partial_rotary_factor": None}))
    assert cfg.rope_scaling is None


def test_qwen_sliding_window_layers(tmp_path) -> None:
    hf = Qwen2Config(
        num_hidden_layers=4,
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=16,
        max_window_layers=2,
        architectures=["Qwen2ForCausalLM"],
    )
    hf.save_pretrained(str(tmp_path))
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    assert [cfg.sliding_window_for_layer(i) for i in range(4)] == [None, None, 16, 16]


def test_unknown_architecture_names_it_and_the_supported_list(tmp_path) -> None:
    with pytest.raises(ModelLoadError) as info:
        ModelConfig.from_pretrained(
            _write(
                tmp_path,
                {**BASE, "architectures": ["GPT2LMHeadModel"], "auto_map": {"AutoModelForCausalLM": "evil.Model"}},
            )
        )
    assert "GPT2LMHeadModel" in str(info.value)
    assert all(a in str(info.value) for a in SUPPORTED_ARCHITECTURES)


def test_unsupported_activation(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="gelu"):
        ModelConfig.from_pretrained(_write(tmp_path, {**BASE, "hidden_act": "gelu"}))


def test_missing_directory_and_config(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="does-not-exist"):
        ModelConfig.from_pretrained(str(tmp_path / "does-not-exist"))
    with pytest.raises(ModelLoadError, match="config.json"):
        ModelConfig.from_pretrained(str(tmp_path))


def test_missing_required_key(tmp_path) -> None:
    cfg = dict(BASE)
    del cfg["hidden_size"]
    with pytest.raises(ModelLoadError, match="hidden_size"):
        ModelConfig.from_pretrained(_write(tmp_path, cfg))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_bytes_per_token(tmp_path, dtype) -> None:
    cfg = ModelConfig.from_pretrained(_write(tmp_path, {**BASE, "num_key_value_heads": 2}))
    itemsize = 4 if dtype == torch.float32 else 2
    assert cfg.kv_bytes_per_token(dtype) == 2 * 3 * 2 * 8 * itemsize


@pytest.mark.parametrize("hf_cls,arch", FAMILIES)
def test_keys_a_family_ignores_and_its_own_defaults_read_as_transformers_reads_them(tmp_path, hf_cls, arch) -> None:
    """Qwen's sliding window without a `sliding_window` key (4096 from layer max_window_layers on), Qwen3's head_dim
    without its key (128), and attention_bias / mlp_bias only where the family's transformers model reads them
    (Llama both, Qwen3 attention_bias; Mistral none; Qwen2 always its q/k/v biases)."""
    written = {
        **BASE,
        "architectures": [arch],
        "num_hidden_layers": 30,
        "use_sliding_window": True,
        "attention_bias": True,
        "mlp_bias": True,
    }
    hf = hf_cls(**written)
    cfg = ModelConfig.from_pretrained(_write(tmp_path, written))
    assert cfg.head_dim == {"Qwen3ForCausalLM": 128}.get(arch, 8) == (getattr(hf, "head_dim", None) or 8)
    windows = [cfg.sliding_window_for_layer(i) for i in range(30)]
    if arch.startswith("Qwen"):
        assert hf.sliding_window == 4096
        assert windows == [4096 if t == "sliding_attention" else None for t in hf.layer_types]
        assert windows[27:] == [None, 4096, 4096]
    elif arch == "MistralForCausalLM":
        assert windows == [hf.sliding_window] * 30 == [4096] * 30
    else:
        assert windows == [None] * 30
    assert cfg.attention_bias == (arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"))
    assert cfg.mlp_bias == (arch == "LlamaForCausalLM")


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 0}, "sliding_window must be a positive"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": -3}, "sliding_window must be a positive"),
        (
            {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "layer_types": ["sliding_attention"]},
            "layer_types must list",
        ),
        (
            {
                "architectures": ["Qwen2ForCausalLM"],
                "use_sliding_window": True,
                "layer_types": ["chunked_attention"] * 3,
            },
            "layer_types must list",
        ),
        ({"model_type": "mistral", "sliding_window": 8}, "model_type 'mistral' does not match"),
        ({"architectures": ["Qwen2ForCausalLM"], "model_type": "llama"}, "model_type 'llama' does not match"),
    ],
)
def test_configs_the_engine_would_misread_are_refused(tmp_path, extra, message) -> None:
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_pretrained(_write(tmp_path, {**BASE, **extra}))


def test_null_optional_keys_take_their_defaults(tmp_path) -> None:
    cfg = ModelConfig.from_pretrained(_write(tmp_path, {**BASE, "rms_norm_eps": None, "max_position_embeddings": None}))
    assert cfg.rms_norm_eps == 1e-6 and cfg.max_position_embeddings == 2048
