"""Engine configuration. Each field is documented once; the CLI flags are the same names with dashes."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from asyncspec.errors import ConfigError

MAX_SPECULATIVE_TOKENS = 8
"""Largest k: budgets, lookahead slots and draft buffers are sized for k + 1 tokens per request."""
MAX_SCHEDULER_STEPS = 16
"""Most decode steps one plan may run back to back (num_scheduler_steps)."""
AUTO_SCHEDULER_STEPS = 4
"""The ceiling of adaptive multi-step plans (num_scheduler_steps=None on CUDA): enough to hide the host's work
per plan behind a small model's steps (the bundled target at batch 64 needed 2 to 3 on an H200), few enough that
a request arriving while the batch is full waits at most three more steps."""
BUNDLED_TARGET, BUNDLED_DRAFT = "stdlib-coder-target", "stdlib-coder-draft"
"""Directory names of the embedded default pair (models/)."""


def bundled_model_path(name: str = BUNDLED_TARGET) -> str:
    """The embedded model's directory: models/<name> of this checkout whatever the working directory,
    else the relative path (an installed wheel carries no models)."""
    path = Path(__file__).resolve().parents[1] / "models" / name
    return str(path) if path.is_dir() else f"models/{name}"


def is_bundled_target(model: str) -> bool:
    """Whether `model` is the bundled target with its bundled draft beside it (the draft is its default)."""
    path = Path(model)
    return path.name == BUNDLED_TARGET and (path.resolve().parent / BUNDLED_DRAFT).is_dir()


_BOOL_FIELDS = (
    "skip_tokenizer_init",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "adaptive_speculation",
    "enforce_eager",
    "worker_process",
    "freeze_gc",
    "speculate_with_prompts",
)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_ALIASES = {"float": "float32", "half": "float16"}  # vLLM's spellings


def _checkpoint_dtype(model: str) -> str | None:
    """The dtype config.json names (transformers 5's "dtype" or the older "torch_dtype"), None where it names
    none or cannot be read (the model's loading reports that)."""
    try:
        with open(Path(model) / "config.json", encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    value = cfg.get("torch_dtype") or cfg.get("dtype")  # ModelConfig's order
    return value if isinstance(value, str) else None


@dataclass
class EngineConfig:
    """Everything needed to build an engine. `LLM(**kwargs)` takes these fields flattened."""

    model: str = dataclasses.field(default_factory=bundled_model_path)
    """Path to a Hugging Face model directory (config.json + safetensors weights); default: the bundled target."""
    tokenizer: str | None = None
    """Directory holding tokenizer.json; defaults to `model`."""
    device: str | None = None
    """"cpu" or "cuda[:N]"; None picks cuda when a GPU is present, else cpu."""
    dtype: str | None = None
    """"float32", "float16" or "bfloat16" (vLLM's "float" and "half" too); None picks bfloat16 on cuda and
    float32 on cpu; "auto" on cuda keeps a float16 checkpoint in float16 (its config.json's dtype), else as None."""
    generation_config: Literal["auto", "none", "vllm"] = "auto"
    """"auto": the sampling parameters the model's generation_config.json recommends (temperature, top_p, top_k,
    min_p, repetition_penalty, max_new_tokens) are the defaults of requests that leave them unset (a gRPC field
    not set; `LLM.generate` without sampling params), as vLLM's `--generation-config auto`. "none" (or vLLM's
    name for it, "vllm"): the engine's own defaults (temperature 1, no truncation); a generation_config.json that
    cannot be read stops "auto" at start-up and is ignored (with a warning) otherwise."""
    load_format: Literal["safetensors", "dummy"] = "safetensors"
    """"dummy" initialises random weights of the model's config (benchmarks of large shapes)."""
    skip_tokenizer_init: bool = False
    """Start without a tokenizer: prompts must be token ids and outputs carry no text."""
    seed: int = 0
    """Seed of the default random generator (unseeded requests, dummy weights)."""
    max_model_len: int | None = None
    """Longest sequence (prompt + output) a request may reach; None uses the model's limit."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    num_kv_blocks: int | None = None
    """Size of the KV pool in blocks; None sizes it from `kv_cache_bytes` or free memory."""
    kv_cache_bytes: int | None = None
    """Size of the KV pool in bytes (used when `num_kv_blocks` is None)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the GPU's total memory this engine may use (weights, activations, graphs, KV pool). Memory
    that other processes hold is not counted against it, but the share must be free at start-up."""
    max_num_seqs: int = 64
    """Most requests in one step."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (decode tokens, draft tokens and prefill chunks together)."""
    enable_chunked_prefill: bool = True
    """Split prompts that do not fit the remaining token budget into chunks across steps."""
    long_prefill_token_threshold: int = 0
    """Largest prefill chunk one request gets per step; 0 means only the token budget limits it."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes across requests."""
    prefix_sharing_wait_tokens: int = 256
    """With prefix caching: a waiting request whose prompt shares at least this many tokens, past what the cache
    holds, with prompts that running requests are computing (a burst with one system prompt) waits for their
    blocks, a plan or a few, and hits them, rather than compute the same tokens; it keeps its slot in the batch, and
    the requests behind it go on in the slots left. The wait costs it about two steps of time to first token, worth
    it where computing the shared tokens again costs as much (a few hundred tokens on a GPU). 0 admits it at once
    (it computes them again)."""
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """"fcfs" serves in arrival order; "priority" serves lower `priority` values first."""
    max_num_waiting: int = 4096
    """Most requests waiting beyond the free running slots (max_num_seqs less those running) before new ones are
    refused with QueueFullError (RESOURCE_EXHAUSTED over gRPC)."""
    max_stop_strings: int = 16
    """Most stop strings one request may give."""
    speculative_method: Literal["draft_model", "ngram"] | None = None
    """Speculative decoding proposer: "draft_model", "ngram" (prompt lookup), or None (off)."""
    draft_model: str | None = None
    """Draft model directory for "draft_model"; None uses the bundled draft when `model` is the bundled target."""
    num_speculative_tokens: int = 0
    """Draft tokens proposed and verified per step (k), 1 to 8 with a speculative_method; 0 without."""
    prompt_lookup_min: int = 2
    """Shortest n-gram the "ngram" proposer matches against earlier tokens."""
    prompt_lookup_max: int = 5
    """Longest n-gram the "ngram" proposer tries first (at most 256)."""
    adaptive_speculation: bool = True
    """Choose the drafts verified per step (0, 1, k/2 or k) from the batch size, the measured acceptance and
    the step costs measured at CUDA-graph capture; False (or no graphs) always verifies num_speculative_tokens."""
    num_scheduler_steps: int | None = None
    """Greedy decode steps planned and launched together (1 to 16) while every running request is a plain greedy
    decode (no penalties, logprobs or min_tokens) and no waiting request could be admitted: the host plans,
    collects and reconciles once per that many steps, so that a model whose step is shorter than the host's
    work per step (a small model at a high batch) keeps the GPU busy. Tokens then stream that many at a time,
    and a request arriving while the batch is full waits for the run. With speculation only plans that verify
    nothing and propose nothing (the policy chose k = 0 for them and the next plan) take several steps; the
    draft model catches up on them in its next pass. 1 plans every step. None (automatic): in the asynchronous
    loop on CUDA, as many as the host needs to stay ahead of the device, measured as it runs (up to 4; 1 while
    the device is the slower side); otherwise 1."""
    admission_delay_runs: int = 2
    """Under load (at least max_num_seqs / 8 requests running, and fewer than that many admissible: the smaller of
    the waiting requests and the free slots), how many multi-step decode runs in a row may leave waiting requests
    waiting, so that they are admitted in waves: a plan that admits a request computes its prompt chunk and runs one
    step, and where plans take several steps (the host's work sets the pace), requests that end every few steps (as
    speculating ones do) would otherwise hold every plan to that one step. A request waits at most that many runs
    more for its first token. 0 admits as soon as a slot frees (vLLM's behaviour)."""
    speculate_with_prompts: bool = False
    """With adaptive speculation: the decodes of a plan that also computes prompt chunks (admissions, chunked
    prompts) verify the drafts proposed for them, as vLLM's do, and the plan before proposes them at the policy's k.
    False (the default): such plans verify none, and a plan admitting a wave drops the drafts its decodes hold. Their
    verification and draft step run outside the decode graphs, about 2.5 ms more host work a plan at 128 streams,
    which made it slower at every load measured (the bundled pair on an H100, 2026-12-07; before the greedy
    verification beside unfinished prompt chunks stopped taking the full sampler). Tokens are the same."""
    async_scheduling: bool | None = None
    """Plan and launch step N+1 while step N runs (optimistically: every draft accepted), reconciling
    when N's results land; False runs one step at a time (the reference loop); None: on with CUDA, off
    on the CPU (see `use_async_scheduling`)."""
    enforce_eager: bool = False
    """Run every step eagerly: no CUDA graphs (they are captured on CUDA with the Triton backend)."""
    cuda_graph_max_batch_size: int | None = None
    """Largest batch replayed from a CUDA graph (buckets 1, 2, 4, 8, 16, ...); None: max_num_seqs."""
    cuda_graph_max_tokens: int | None = None
    """Largest step, in tokens, of a mixed batch (prompt chunks, with or without decodes) replayed from a CUDA
    graph (token buckets 64, 128, 256, ... up to it); 0 runs such steps eagerly; None: max_num_batched_tokens.
    Uniform decode and verification steps use the batch-size graphs either way."""
    tensor_parallel_size: int = 1
    """GPUs (or CPU processes) one model is split across, one worker process each (NCCL on cuda,
    gloo on cpu); on cuda they are cuda:<first> to cuda:<first + size - 1>."""
    worker_process: bool = False
    """Run the model in a worker process of its own even with tensor_parallel_size=1 (as tensor
    parallelism does): the model's launches then never share a Python interpreter lock with the
    scheduler and a server's streams; each step crosses a pipe."""
    freeze_gc: bool = True
    """Once start-up is done (weights, KV pool, CUDA graphs, warm-up), collect and then freeze (gc.freeze) every
    object alive, in this process and in each worker process, as vLLM's engine core does: Python's full garbage
    collections then scan only the objects made since, where they scanned everything torch and the engine hold,
    a pause of tens of milliseconds in a random step (a 13.9 ms collection in one closed batch of 32 of the bundled
    pair without it on an H100, 2026-12-07; none over 0.23 ms with it). A reference cycle among frozen objects is
    freed only once they are released: at `shutdown`, or when another engine starts in the process. False leaves the
    collector alone."""

    def __post_init__(self) -> None:
        self._validate()

    # -- derived values -------------------------------------------------------------
    @property
    def torch_device(self) -> torch.device:
        if self.device is None:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype is None or self.dtype == "auto":
            if self.torch_device.type != "cuda":
                return torch.float32
            if self.dtype == "auto" and _checkpoint_dtype(self.model) == "float16":
                return torch.float16
            return torch.bfloat16
        return _DTYPES[_DTYPE_ALIASES.get(self.dtype, self.dtype)]

    @property
    def use_async_scheduling(self) -> bool:
        """Whether the engine runs the asynchronous loop. Unset, it does on CUDA, where it measured faster
        than the synchronous loop at every batch size on fast host cores (docs/benchmarks.md, with the one
        exception seen: a host-bound tiny model pinned to two slow cores). On the CPU a worker thread
        plays the device and competes with the scheduler for the interpreter and the cores, so the
        synchronous loop, the reference, stays the default there."""
        if self.async_scheduling is None:
            return self.torch_device.type == "cuda"
        return self.async_scheduling

    @property
    def adaptive_scheduler_steps(self) -> bool:
        """Whether the engine chooses each plan's step count from measured host and device time
        (num_scheduler_steps=None in the asynchronous loop on CUDA)."""
        return self.num_scheduler_steps is None and self.use_async_scheduling and self.torch_device.type == "cuda"

    @property
    def max_scheduler_steps(self) -> int:
        """The most decode steps one plan may run: num_scheduler_steps, or with None the adaptive ceiling
        (AUTO_SCHEDULER_STEPS) where the engine adapts, else 1."""
        if self.num_scheduler_steps is not None:
            return self.num_scheduler_steps
        return AUTO_SCHEDULER_STEPS if self.adaptive_scheduler_steps else 1

    @property
    def max_draft_lag(self) -> int:
        """Most tokens a request's draft-model KV may fall behind the target's (decode steps at k = 0 skip the
        draft; its next pass feeds them all): the draft's input buffers hold that catch-up for every request.
        0 without a draft model."""
        if self.speculative_method != "draft_model":
            return 0
        return max(1, self.max_num_batched_tokens // self.max_num_seqs)

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model

    @property
    def num_lookahead_tokens(self) -> int:
        """Slots reserved per decode beyond the committed token (k draft tokens)."""
        return self.num_speculative_tokens if self.speculative_method else 0

    # -- validation -------------------------------------------------------------------
    def _validate(self) -> None:
        if self.dtype is not None and self.dtype not in (*_DTYPES, *_DTYPE_ALIASES, "auto"):
            raise ConfigError(
                f"dtype must be one of {sorted(_DTYPES)}, {', '.join(map(repr, _DTYPE_ALIASES))}, 'auto' or None, "
                f"got {self.dtype!r}"
            )
        if self.device is not None:
            try:
                dev = torch.device(self.device)
            except (RuntimeError, TypeError) as e:
                raise ConfigError(f"device {self.device!r} is not a valid torch device: {e}") from None
            if dev.type not in ("cpu", "cuda"):
                raise ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ConfigError(f"async_scheduling must be True, False or None (CUDA: on), got {self.async_scheduling!r}")
        for name in _BOOL_FIELDS:
            # A string would pass every truth test: "false" would turn the option on.
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.generation_config not in ("auto", "none", "vllm"):
            raise ConfigError(f"generation_config must be 'auto', 'none' or 'vllm', got {self.generation_config!r}")
        if self.load_format not in ("safetensors", "dummy"):
            raise ConfigError(f"load_format must be 'safetensors' or 'dummy', got {self.load_format!r}")
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_num_waiting",
            "max_stop_strings",
            "tensor_parallel_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in (
            "long_prefill_token_threshold",
            "seed",
            "num_speculative_tokens",
            "admission_delay_runs",
            "prefix_sharing_wait_tokens",
        ):
            _check_int(name, getattr(self, name), minimum=0)
        if self.num_scheduler_steps is not None:
            _check_int("num_scheduler_steps", self.num_scheduler_steps, minimum=1)
            if self.num_scheduler_steps > MAX_SCHEDULER_STEPS:
                raise ConfigError(
                    f"num_scheduler_steps must be at most {MAX_SCHEDULER_STEPS} (or None: automatic), "
                    f"got {self.num_scheduler_steps}"
                )
        for name in ("num_kv_blocks", "kv_cache_bytes", "max_model_len", "cuda_graph_max_batch_size"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1)
        if self.cuda_graph_max_tokens is not None:
            _check_int("cuda_graph_max_tokens", self.cuda_graph_max_tokens, minimum=0)
        if self.long_prefill_token_threshold > 0 and not self.enable_chunked_prefill:
            raise ConfigError("long_prefill_token_threshold > 0 chunks prompts: it needs enable_chunked_prefill=True")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is below max_num_seqs={self.max_num_seqs}: "
                "every running request needs at least one token per step"
            )
        utilization = self.gpu_memory_utilization
        if isinstance(utilization, bool) or not isinstance(utilization, int | float) or not 0.0 < utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be a number in (0, 1], got {utilization!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        self._validate_speculative()

    def _validate_speculative(self) -> None:
        method, k = self.speculative_method, self.num_speculative_tokens
        if method not in (None, "draft_model", "ngram"):
            raise ConfigError(f"speculative_method must be 'draft_model', 'ngram' or None, got {method!r}")
        if method is None:
            if k != 0:
                raise ConfigError(f"num_speculative_tokens={k} needs a speculative_method ('draft_model' or 'ngram')")
            if self.draft_model is not None:
                raise ConfigError("draft_model is set but speculative_method is not 'draft_model'")
            return
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}] with speculative_method="
                f"{method!r}, got {k}"
            )
        if method == "ngram":
            if self.draft_model is not None:
                raise ConfigError("draft_model is only used with speculative_method='draft_model'")
            _check_int("prompt_lookup_min", self.prompt_lookup_min, minimum=1)
            _check_int("prompt_lookup_max", self.prompt_lookup_max, minimum=self.prompt_lookup_min)
            if self.prompt_lookup_max > MAX_PROMPT_LOOKUP:
                # The proposer compares every position's n-gram: memory and time grow as tokens x n per step.
                raise ConfigError(
                    f"prompt_lookup_max must be <= {MAX_PROMPT_LOOKUP} (each step compares n-grams of that length "
                    f"at every position of every sequence), got {self.prompt_lookup_max}"
                )
        elif self.draft_model is None and not is_bundled_target(self.model):
            raise ConfigError(
                "speculative_method='draft_model' needs draft_model=<directory> (the bundled draft is the "
                "default only for the bundled target)"
            )
        needed = self.max_num_seqs * (k + 1)
        if self.max_num_batched_tokens < needed:
            raise ConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} cannot hold a decode step of "
                f"max_num_seqs={self.max_num_seqs} requests with {k} draft tokens each: it needs "
                f"max_num_seqs * (num_speculative_tokens + 1) = {needed}; raise max_num_batched_tokens "
                f"to {needed} or lower max_num_seqs"
            )

    @property
    def draft_model_path(self) -> str | None:
        """The draft directory in use: `draft_model`, or the bundled draft beside the bundled target."""
        if self.speculative_method != "draft_model":
            return None
        if self.draft_model is not None:
            return self.draft_model
        return str(Path(self.model).resolve().parent / BUNDLED_DRAFT)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


MAX_PROMPT_LOOKUP = 256
"""The longest n-gram the "ngram" proposer may try."""


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


def make_config(model: str | None = None, **kwargs: object) -> EngineConfig:
    """Builds an EngineConfig from flattened keyword arguments, naming unknown ones."""
    unknown = sorted(set(kwargs) - set(EngineConfig.field_names()))
    if unknown:
        raise ConfigError(f"unknown engine option(s) {unknown}; valid options: {EngineConfig.field_names()}")
    if model is not None:
        kwargs["model"] = model
    return EngineConfig(**kwargs)  # type: ignore[arg-type]
