"""ModelConfig: the subset of a Hugging Face config.json the engine needs, validated once."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import Any, Literal, overload

import torch

from asyncspec.errors import ModelLoadError
from asyncspec.layers.attention import allocate_paged_kv_cache

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

# Required keys of each supported rope scaling type (besides rope_type itself).
_ROPE_TYPES: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
# transformers' defaults where a config leaves these keys out (its config classes, 5.x).
_MAX_POSITION_DEFAULTS = {"MistralForCausalLM": 131072, "Qwen2ForCausalLM": 32768, "Qwen3ForCausalLM": 32768}
# Qwen's applies only where use_sliding_window is set.
_SLIDING_WINDOW_DEFAULTS = {"MistralForCausalLM": 4096, "Qwen2ForCausalLM": 4096, "Qwen3ForCausalLM": 4096}
_HEAD_DIM_DEFAULTS = {"Qwen3ForCausalLM": 128}  # the others default to hidden_size // num_attention_heads
# The config keys each architecture's transformers config class takes: the others it ignores, and so must we.
_TAKES_ATTENTION_BIAS = ("LlamaForCausalLM", "Qwen3ForCausalLM")
_TAKES_MLP_BIAS = ("LlamaForCausalLM",)
_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_LAYER_TYPES = ("full_attention", "sliding_attention")
# generation_config.json key -> SamplingParams field: vLLM's `get_diff_sampling_param` keys.
_GENERATION_SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
_QWEN_MAX_WINDOW_LAYERS_DEFAULT = 28


@dataclass
class ModelConfig:
    """Architecture hyper-parameters of one decoder-only model."""

    architecture: str
    """The config.json `architectures[0]`, e.g. "LlamaForCausalLM"."""
    vocab_size: int
    """Rows of the embedding and of the LM head."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the gated MLP."""
    num_hidden_layers: int
    """Number of decoder layers."""
    num_attention_heads: int
    """Query heads per layer."""
    num_key_value_heads: int
    """KV heads per layer (GQA when fewer than the query heads)."""
    head_dim: int
    """Width of one attention head."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: dict[str, Any] | None = None
    """None for plain RoPE, else {"rope_type": "linear"|"llama3", ...its parameters}."""
    max_position_embeddings: int = 2048
    """Longest position the model supports (sizes the RoPE cache)."""
    tie_word_embeddings: bool = False
    """The LM head reuses the embedding matrix."""
    attention_bias: bool = False
    """q/k/v projections carry a bias."""
    o_proj_bias: bool = False
    """The output projection carries a bias (Llama/Qwen3 attention_bias; never Qwen2)."""
    mlp_bias: bool = False
    """The MLP projections carry a bias (Llama's mlp_bias)."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k before RoPE (Qwen3)."""
    hidden_act: str = "silu"
    """MLP activation; only silu is supported."""
    sliding_window: int | None = None
    """Attention window in tokens, or None for full attention."""
    layer_types: list[str] | None = None
    """Per-layer "full_attention"/"sliding_attention"; None means every layer uses `sliding_window`."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token id, if any."""
    eos_token_ids: list[int] = field(default_factory=list)
    """Every token id that ends generation (config.json and generation_config.json merged)."""
    torch_dtype: str | None = None
    """The checkpoint's dtype as written in config.json, if given."""
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    """The sampling parameters generation_config.json sets (under SamplingParams names: temperature, top_p,
    top_k, min_p, repetition_penalty, max_tokens), as written: unchecked until the engine takes them."""
    model_type: str | None = None
    """The config.json model_type, for information."""
    generation_config_error: str | None = None
    """Why generation_config.json, present, could not be read (not JSON, not an object); None when it was read
    or is absent. The engine refuses to start on it where it would take the file's sampling defaults
    (generation_config="auto") and ignores the file otherwise, as vLLM does."""

    def kv_heads_per_rank(self, tensor_parallel_size: int = 1) -> int:
        """KV heads one tensor-parallel rank holds (one replicated head when there are more ranks
        than heads)."""
        return max(1, self.num_key_value_heads // tensor_parallel_size)

    def kv_bytes_per_token(self, dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
        """Bytes of K and V one token occupies across all layers (on one rank)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        heads = self.kv_heads_per_rank(tensor_parallel_size)
        return 2 * self.num_hidden_layers * heads * self.head_dim * itemsize

    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        tensor_parallel_size: int = 1,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This model's paged KV tensors (this rank's heads): one (k_cache, v_cache) pair per layer."""
        heads = self.kv_heads_per_rank(tensor_parallel_size)
        return allocate_paged_kv_cache(
            self.num_hidden_layers, num_blocks, block_size, heads, self.head_dim, dtype, device
        )

    def sliding_window_for_layer(self, layer_idx: int) -> int | None:
        """The attention window of one layer, or None if it attends to everything."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer_idx] == "sliding_attention":
            return self.sliding_window
        return None

    @classmethod
    def from_pretrained(cls, path: str) -> ModelConfig:
        """Read and validate `path/config.json` (and generation_config.json when present)."""
        if not os.path.isdir(path):
            raise ModelLoadError(f"model directory {path!r} does not exist or is not a directory")
        cfg_path = os.path.join(path, "config.json")
        cfg = _read_json(cfg_path, required=True)
        gen_path = os.path.join(path, "generation_config.json")
        try:
            gen = _read_json(gen_path, required=False) or {}
        except ModelLoadError as e:
            return replace(cls.from_dict(cfg, source=cfg_path), generation_config_error=str(e))
        return cls.from_dict(cfg, generation_config=gen, source=cfg_path, generation_source=gen_path)

    @classmethod
    def from_dict(
        cls,
        cfg: dict[str, Any],
        generation_config: dict[str, Any] | None = None,
        source: str = "config.json",
        generation_source: str = "generation_config.json",
    ) -> ModelConfig:
        """Build from an already parsed config.json dict; `source` names it in errors (`generation_source` the
        generation config)."""
        try:
            return cls._from_dict(cfg, generation_config, source, generation_source)
        except ModelLoadError:
            raise
        except _NamedValueError as e:
            raise ModelLoadError(f"{source}: {e}") from None
        except (TypeError, ValueError) as e:
            # A value of a key read without _number: the key is not known here, the file is.
            raise ModelLoadError(f"{source}: a value has the wrong type or is null: {e}") from None

    @classmethod
    def _from_dict(
        cls, cfg: dict[str, Any], generation_config: dict[str, Any] | None, source: str, generation_source: str
    ) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if not archs:
            raise ModelLoadError(f"{source}: no 'architectures' entry; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{source}: architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        # auto_map / trust_remote_code are deliberately ignored: no remote code is ever executed.
        model_type = cfg.get("model_type")
        if model_type is not None and model_type != _MODEL_TYPES[arch]:
            # transformers builds the model of model_type, this engine the one of the architecture: refuse rather
            # than pick one reading silently (biases, windows and defaults differ).
            raise ModelLoadError(
                f"{source}: model_type {model_type!r} does not match architecture {arch!r} "
                f"(expected model_type {_MODEL_TYPES[arch]!r})"
            )
        required = ("hidden_size", "num_attention_heads", "vocab_size", "intermediate_size", "num_hidden_layers")
        for key in required:
            value = cfg.get(key)
            if key in cfg and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ModelLoadError(f"{source}: {key} must be a positive integer, got {value!r}")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            kwargs: dict[str, Any] = dict(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
            )
        except KeyError as e:
            raise ModelLoadError(f"{source}: required key {e.args[0]!r} is missing") from None
        kv_heads = _number(int, "num_key_value_heads", cfg.get("num_key_value_heads") or heads, minimum=1)
        head_dim = _number(
            int, "head_dim", cfg.get("head_dim") or _HEAD_DIM_DEFAULTS.get(arch) or hidden // heads, minimum=1
        )
        if heads % kv_heads != 0:
            raise ModelLoadError(
                f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"{source}: hidden_act={act!r} is not supported (only 'silu')")
        max_pos = _number(
            int,
            "max_position_embeddings",
            _value_or(cfg, "max_position_embeddings", _MAX_POSITION_DEFAULTS.get(arch, 2048)),
            minimum=1,
        )
        rope_theta, rope_scaling = _parse_rope(cfg, max_pos, source)

        is_qwen2, is_qwen3 = arch == "Qwen2ForCausalLM", arch == "Qwen3ForCausalLM"
        attn_bias = True if is_qwen2 else arch in _TAKES_ATTENTION_BIAS and bool(cfg.get("attention_bias", False))
        sliding, layer_types = _parse_sliding_window(cfg, arch, int(cfg["num_hidden_layers"]), source)
        eos = _token_ids("eos_token_id", cfg.get("eos_token_id"))
        try:
            generation_eos = _token_ids("eos_token_id", (generation_config or {}).get("eos_token_id"))
        except _NamedValueError as e:
            raise ModelLoadError(f"{generation_source}: {e}") from None
        eos += [token for token in generation_eos if token not in eos]
        sampling_defaults = _sampling_defaults(generation_config or {})
        return cls(
            architecture=arch,
            **kwargs,
            num_key_value_heads=int(kv_heads),
            head_dim=int(head_dim),
            rms_norm_eps=_number(float, "rms_norm_eps", _value_or(cfg, "rms_norm_eps", 1e-6), minimum=0),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attn_bias,
            o_proj_bias=False if is_qwen2 else attn_bias,
            mlp_bias=arch in _TAKES_MLP_BIAS and bool(cfg.get("mlp_bias", False)),
            qk_norm=is_qwen3,
            hidden_act=act,
            sliding_window=sliding,
            layer_types=layer_types,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            model_type=model_type,
            sampling_defaults=sampling_defaults,
        )


def _sampling_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json's sampling keys under SamplingParams' names, those it sets (not null), unchecked:
    the engine checks them where it takes them (generation_config="auto"). As vLLM reads the file under
    transformers 5, whose GenerationConfig defaults are all None: a top_k of 50 written there is taken."""
    return {
        name: generation_config[key]
        for key, name in _GENERATION_SAMPLING_KEYS.items()
        if generation_config.get(key) is not None
    }


class _NamedValueError(ValueError):
    """A config.json value of the wrong type, its key named."""


def _number(kind: type[int] | type[float], key: str, value: Any, minimum: float | None = None) -> Any:
    """`value` as an int or a float (an integral float taken as an int), at least `minimum` where given, or a
    _NamedValueError naming `key`."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise _NamedValueError(f"{key} must be a number, got {value!r}")
    if minimum is not None and value < minimum:
        raise _NamedValueError(f"{key} must be at least {minimum}, got {value!r}")
    if kind is int:
        if value != int(value):
            raise _NamedValueError(f"{key} must be an integer, got {value!r}")
        return int(value)
    return float(value)


def _value_or(cfg: dict[str, Any], key: str, default: Any) -> Any:
    """The key's value, or the default where it is missing or null (transformers' reading of both)."""
    value = cfg.get(key)
    return default if value is None else value


@overload
def _read_json(path: str, required: Literal[True]) -> dict[str, Any]: ...
@overload
def _read_json(path: str, required: bool) -> dict[str, Any] | None: ...
def _read_json(path: str, required: bool) -> dict[str, Any] | None:
    if not os.path.isfile(path):
        if required:
            raise ModelLoadError(f"{path} not found: a model directory needs a Hugging Face config.json")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot be read as JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _parse_rope(cfg: dict[str, Any], max_pos: int, source: str) -> tuple[float, dict[str, Any] | None]:
    """Accept both transformers-5 `rope_parameters` and the older `rope_theta` + `rope_scaling` keys."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    if isinstance(params, dict) and params:
        if any(isinstance(v, dict) for v in params.values()):
            raise ModelLoadError(f"{source}: per-layer-type rope_parameters are not supported")
        if isinstance(scaling, dict) and scaling and _rope_kind(scaling) != _rope_kind(params):
            # transformers lets rope_scaling win here (and then resets rope_theta): neither reading is safe.
            raise ModelLoadError(
                f"{source}: rope_parameters {params} and rope_scaling {scaling} disagree; keep one of them"
            )
        params = dict(params)
    else:
        params = dict(scaling or {})
    theta = _number(float, "rope_theta", params.pop("rope_theta", _value_or(cfg, "rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    factor = _value_or(params, "partial_rotary_factor", _value_or(cfg, "partial_rotary_factor", 1.0))
    if _number(float, "partial_rotary_factor", factor) != 1.0:
        raise ModelLoadError(f"{source}: partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return theta, None
    if rope_type not in _ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: rope_type {rope_type!r} is not supported; supported: default, {', '.join(_ROPE_TYPES)}"
        )
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", max_pos)
    missing = [k for k in _ROPE_TYPES[rope_type] if k not in params]
    if missing:
        raise ModelLoadError(f"{source}: rope_type {rope_type!r} needs {', '.join(missing)}")
    for key in _ROPE_TYPES[rope_type]:
        value = params[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ModelLoadError(f"{source}: rope {rope_type!r} {key} must be a positive number, got {value!r}")
    scaling = {"rope_type": rope_type}
    scaling.update({k: params[k] for k in _ROPE_TYPES[rope_type]})
    return theta, scaling


def _rope_kind(params: dict[str, Any]) -> dict[str, Any]:
    """A RoPE dict without its theta, its type under one key: two spellings of one scaling compare equal."""
    kind = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
    kind["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return kind


def _parse_sliding_window(
    cfg: dict[str, Any], arch: str, num_layers: int, source: str
) -> tuple[int | None, list[str] | None]:
    # Missing keys take transformers' defaults for the architecture (a present null stays null).
    window = cfg.get("sliding_window", _SLIDING_WINDOW_DEFAULTS.get(arch))
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        # Qwen ships a sliding_window value but only uses it when use_sliding_window is set.
        if not cfg.get("use_sliding_window", False) or window is None:
            return None, None
        types = cfg.get("layer_types")
        if types is None:
            start = _number(
                int, "max_window_layers", _value_or(cfg, "max_window_layers", _QWEN_MAX_WINDOW_LAYERS_DEFAULT)
            )
            types = ["sliding_attention" if i >= start else "full_attention" for i in range(num_layers)]
        if not isinstance(types, list) or len(types) != num_layers or any(t not in _LAYER_TYPES for t in types):
            raise ModelLoadError(
                f"{source}: layer_types must list one of {', '.join(_LAYER_TYPES)} for each of the {num_layers} "
                f"layers, got {types!r}"
            )
        return _checked_window(window, source), list(types)
    if arch == "MistralForCausalLM" and window is not None:
        return _checked_window(window, source), None
    return None, None


def _checked_window(window: Any, source: str) -> int:
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ModelLoadError(f"{source}: sliding_window must be a positive integer (or null for none), got {window!r}")
    return window


def _token_ids(key: str, value: Any) -> list[int]:
    """A token id or a list of them (null: none), each a non-negative integer, in order without repeats."""
    out: list[int] = []
    for x in value if isinstance(value, list) else ([] if value is None else [value]):
        token = _number(int, key, x, minimum=0)
        if token not in out:
            out.append(token)
    return out
