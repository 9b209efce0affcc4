"""Issue 8, "the GPU step at the speed of the GPU": how far each decode step is from the card's memory roofline,
asyncspec eager vs CUDA graphs, with and without speculation, next to Hugging Face transformers on the same card.

Run from the repository root (the device copy is not pip-installed: the script maps `asyncspec.kernels` onto
`kernels/` itself, so the `ln -sfn ../kernels asyncspec/kernels` of the other benchmarks is optional). All of
it takes ~20 minutes on an H100, so it is split over device calls of < 9 minutes, each writing its own file
(every part of every model by default; `--models` and `--parts` select), merged afterwards on any machine:

    python3 benchmarks/gpu_step_speed.py --models bundled --output $OUT/step_speed_bundled.json   # ~5-6 min
    python3 benchmarks/gpu_step_speed.py --models llama-1b --output $OUT/step_speed_1b.json       # ~5 min
    python3 benchmarks/gpu_step_speed.py --models llama-8b --parts bandwidth,asyncspec \
        --output $OUT/step_speed_8b_a.json                                                         # ~5 min
    python3 benchmarks/gpu_step_speed.py --models llama-8b --parts startup,hf \
        --output $OUT/step_speed_8b_b.json                                                         # ~4-5 min

    # no measuring: merge the calls' files (same card only; a later row of the same model and part wins)
    python benchmarks/gpu_step_speed.py --merge-from step_speed_bundled.json step_speed_1b.json \
        step_speed_8b_a.json step_speed_8b_b.json --output benchmarks/results/gpu_step_speed.json

    # plots (docs/img/) and markdown tables for docs/benchmarks.md
    python benchmarks/plot_step_speed.py benchmarks/results/gpu_step_speed.json --out docs/img/

    # CPU, tiny settings: every code path and the JSON schema (tests/test_benchmark_smoke.py runs it)
    python benchmarks/gpu_step_speed.py --smoke --output /tmp/step_speed_smoke.json

`--merge` instead adds a run's rows to the --output file already there (when it travels between calls). A run
starts no configuration after `--deadline-s` (default 540 s) and gives each configuration's process at most
`--timeout` (360 s) or the time left, so one call stays under 9 minutes; the file is rewritten after every
configuration (a cut-off run keeps what it measured), and skipped parts are printed at the end with the
`--models/--parts` that rerun them (merge that file in too).

Models (bf16): `bundled` = models/stdlib-coder-target (15.7M, real weights, with its draft
models/stdlib-coder-draft); `llama-1b` = the Llama-3.2-1B shape and `llama-8b` = the Llama-3.1-8B shape, both
with random weights (asyncspec `load_format="dummy"`, transformers `from_config`, seeded). The dummy shapes
have no draft: their speculation is n-gram (prompt lookup) only, and with random weights the acceptance says
nothing about a real model: those rows measure the overhead of speculating.

Parts (`--parts`, comma-separated, default `bandwidth,all`; the groups `asyncspec`, `fixed-k`, `hf` and `all`
(= asyncspec, startup, hf) expand to the parts that apply to each model; every part but `bandwidth` runs once
per model, each in a fresh process, a failure recorded as {"error": ...} while the rest go on):
- `bandwidth`: read bandwidth of the card, the roofline's denominator: `x.sum()` and `x.amax()` over a 3 GiB bf16
  tensor, median of 10 after 3 warm-ups, CUDA events; the faster of the two.
- `eager`, `graphed` (enforce_eager True / False; both with the synchronous loop), `eager-ngram`,
  `graphed-ngram` (ngram, k=4), `eager-draft`, `graphed-draft` (bundled only: draft_model k=4); with CUDA
  graphs the engine's adaptive speculation (its default) picks k in {0, 1, 2, 4} per step, eager always
  verifies 4; the opt-in group `fixed-k` adds `graphed-ngram-fixed` and `graphed-draft-fixed`
  (adaptive_speculation=False: always 4); the opt-in group `async` adds `async`, `async-ngram`,
  `async-draft`: the graphed configurations with async_scheduling=True (the asynchronous loop, the CUDA
  default).
  Each measures, at gpu_memory_utilization 0.5:
  - `tpot`: batch-1 wall TPOT = (time of a 128-token generation - time of a 1-token one) / 127, medians of 3
    alternated runs of each, after one untimed 1-token call and `--warmup-runs` (3) untimed 128-token ones;
  - `windows`: steady-decode windows at batch B (1 and 64; for `graphed` the sweep 1, 2, 4, 8, 16, 32, 64):
    B requests are submitted and stepped until every one has its first token, 3 more steps, then 32 steps are
    timed (wall, no profiler); then a second engine, built after torch.profiler starts, runs the same window
    and profiles 32 more steps (CUDA activity: CUPTI slows every launch once attached, so nothing timed runs in
    a process where it has started): GPU ms per step = sum
    of the CUDA ops' self device time / steps, kernels per step, GPU-busy fraction = GPU ms / wall ms per step,
    tokens per step (speculation), GPU and wall ms per generated token, the mean context for the KV roofline;
  - `throughput`: concurrency 1, 8, 32, 64, 128 (prompts submitted at once, cycled from the JSONL), 128 new
    tokens each, one timed run after a 16-token warm-up at the same concurrency: end-to-end tok/s, and the
    decode-phase tok/s B * 127 / (time(128 tokens) - time(1 token)) at the same concurrency;
  - start-up seconds (LLM construction), KV capacity.
- `startup`: LLM construction (CUDA graphs, no speculation) at the engine default gpu_memory_utilization 0.9:
  seconds, KV capacity in tokens, KV bytes per stream (after the speed parts, so Triton's cache is warm).
- `hf-static` (transformers `generate`, static cache, compiled, batch-1 TPOT as above), `hf-assisted` (bundled
  only: assisted generation with the bundled draft, 4 tokens per round, batch 1, as gpu_spec_decode.py),
  `hf-batch` (`generate_batch`, continuous batching with CUDA graphs, 32 and 128 streams, each its own process).

Roofline (computed from the JSON, also by plot_step_speed.py): bytes read per decode step = every weight once
(a tied embedding is read once, as the lm_head; an untied one only for the batch's rows, counted as 0) plus the
live KV, B * context * layers * 2 * kv_heads * head_dim * 2 bytes; roofline ms = bytes / bandwidth.

Modest sizes, to fit the device calls: 128 new tokens per request, decode windows of 32 steps, one timed
throughput run per concurrency. Expected durations on one H100 (estimates from earlier runs' step times, not
measured yet; the deadline guards the rest): bandwidth 15 s; per asyncspec configuration 20-40 s (bundled),
30-45 s (1B), 60-90 s (8B); startup 15-30 s; hf-static 1-2.5 min (static-cache compilation), hf-assisted
~30 s, hf-batch 30-90 s per stream count. The opt-in `fixed-k` group adds one or two asyncspec configurations
(run it as its own call: `--models bundled,llama-1b,llama-8b --parts fixed-k`, ~4 min).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

PROCESS_START = time.perf_counter()
"""When this process imported the script (before torch): start-up figures from the process's start."""
REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "benchmarks" / "data" / "prompts-code.jsonl"
TARGET = REPO / "models" / "stdlib-coder-target"
DRAFT = REPO / "models" / "stdlib-coder-draft"
SCHEMA = "asyncspec.gpu_step_speed/1"

LLAMA_1B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "rope_theta": 500000.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}
"""The Llama-3.2-1B shape (defined here, where the parent process and the plot script import no torch;
the other benchmarks import it)."""
LLAMA_8B: dict[str, Any] = {
    **LLAMA_1B,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": False,
}
"""The Llama-3.1-8B shape: vocab 128256, untied embeddings, llama3 rope scaling, rope_theta 500000."""
# Smoke only: a tiny random-weight shape that exercises the dummy-weight paths on the CPU in seconds.
TINY_DUMMY: dict[str, Any] = {
    **LLAMA_1B,
    "vocab_size": 8192,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 0,
}

MODELS: dict[str, dict[str, Any]] = {
    "bundled": {"label": "stdlib-coder-target (15.7M, real weights)", "dummy": False, "has_draft": True},
    "llama-1b": {"label": "Llama-3.2-1B shape (random weights)", "dummy": True, "has_draft": False},
    "llama-8b": {"label": "Llama-3.1-8B shape (random weights)", "dummy": True, "has_draft": False},
    "tiny-dummy": {"label": "tiny random shape (smoke only)", "dummy": True, "has_draft": False},
}
K = 4
_NGRAM = {"speculative_method": "ngram", "num_speculative_tokens": K}
_DRAFT = {"speculative_method": "draft_model", "num_speculative_tokens": K}
_SYNC = {"async_scheduling": False}
ASYNCSPEC_CONFIGS: dict[str, dict[str, Any]] = {
    # The synchronous loop (async_scheduling=False; the CUDA default is the asynchronous one, the async rows).
    "graphed": {"enforce_eager": False, **_SYNC},
    "graphed-ngram": {"enforce_eager": False, **_NGRAM, "adaptive_speculation": True, **_SYNC},
    "graphed-draft": {"enforce_eager": False, **_DRAFT, "adaptive_speculation": True, **_SYNC},
    "eager": {"enforce_eager": True, **_SYNC},
    # Without CUDA graphs the engine has no step costs to adapt k to: eager speculation always verifies k.
    "eager-ngram": {"enforce_eager": True, **_NGRAM, **_SYNC},
    "eager-draft": {"enforce_eager": True, **_DRAFT, **_SYNC},
    # Opt-in (group `fixed-k`): CUDA graphs with a fixed k = 4, what the adaptive policy is measured against.
    "graphed-ngram-fixed": {"enforce_eager": False, **_NGRAM, "adaptive_speculation": False, **_SYNC},
    "graphed-draft-fixed": {"enforce_eager": False, **_DRAFT, "adaptive_speculation": False, **_SYNC},
    # Opt-in (group `async-all`): the asynchronous loop (issue 9), next to the graphed rows above.
    "async": {"enforce_eager": False, "async_scheduling": True},
    "async-ngram": {"enforce_eager": False, **_NGRAM, "adaptive_speculation": True, "async_scheduling": True},
    "async-draft": {"enforce_eager": False, **_DRAFT, "adaptive_speculation": True, "async_scheduling": True},
}
"""asyncspec configurations (LLM keyword arguments), in the order they run: graphed first, the figures that
matter most if a deadline cuts the run short. Speculation with CUDA graphs picks k per step (0, 1, 2 or 4:
`adaptive_speculation`, the engine default) unless the name ends in -fixed."""
HF_PARTS = ("hf-static", "hf-assisted", "hf-batch")
PART_ORDER = ("bandwidth", *ASYNCSPEC_CONFIGS, "startup", *HF_PARTS)
GROUPS = {
    "asyncspec": [c for c in ASYNCSPEC_CONFIGS if not c.endswith("-fixed") and not c.startswith("async")],
    "fixed-k": [c for c in ASYNCSPEC_CONFIGS if c.endswith("-fixed")],
    "async-all": [c for c in ASYNCSPEC_CONFIGS if c.startswith("async")],
    "hf": list(HF_PARTS),
}
GROUPS["all"] = [*GROUPS["asyncspec"], "startup", *HF_PARTS]


def model_config(model: str) -> dict[str, Any]:
    """The model's config.json content (the bundled one read from disk, the dummy shapes from above)."""
    if model == "bundled":
        return json.loads((TARGET / "config.json").read_text())
    return {"llama-1b": LLAMA_1B, "llama-8b": LLAMA_8B, "tiny-dummy": TINY_DUMMY}[model]


def applies(model: str, part: str) -> bool:
    """Draft-model speculation and assisted generation need the bundled draft."""
    return MODELS[model]["has_draft"] or not ("-draft" in part or part == "hf-assisted")


def expand_parts(spec: str) -> list[str]:
    """`--parts` names and groups -> the parts to run, in PART_ORDER."""
    wanted: set[str] = set()
    for name in (s.strip() for s in spec.split(",") if s.strip()):
        if name in GROUPS:
            wanted.update(GROUPS[name])
        elif name in PART_ORDER:
            wanted.add(name)
        else:
            raise SystemExit(f"unknown part {name!r}; parts: {', '.join(PART_ORDER)}; groups: {', '.join(GROUPS)}")
    return [p for p in PART_ORDER if p in wanted]


# -- roofline arithmetic (pure: used by the parent, the plot script and the tests) ------------------------------
def shape_of(cfg: dict[str, Any]) -> dict[str, Any]:
    """The fields of a Llama config that set the bytes a decode step reads."""
    heads = cfg["num_attention_heads"]
    return {
        "vocab_size": cfg["vocab_size"],
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.get("num_key_value_heads", heads),
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
    }


def param_count(shape: dict[str, Any]) -> int:
    """All parameters (an untied lm_head included)."""
    return read_params(shape) + (0 if shape["tie_word_embeddings"] else shape["vocab_size"] * shape["hidden_size"])


def read_params(shape: dict[str, Any]) -> int:
    """Parameters one decode step reads: every layer's weights, the final norm and the lm_head (a tied embedding
    is that lm_head, read once; an untied embedding is read only for the batch's rows: negligible, counted 0)."""
    h, hd = shape["hidden_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * shape["intermediate_size"] + 2 * h
    return shape["num_hidden_layers"] * per_layer + h + shape["vocab_size"] * h


def kv_bytes_per_token(shape: dict[str, Any], dtype_bytes: int) -> int:
    """K and V of every layer for one token."""
    return shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * shape["head_dim"] * dtype_bytes


def roofline_ms(weight_bytes: int, kv_per_token: int, batch: int, context: float, gb_s: float | None) -> float | None:
    """Bytes a decode step must read (weights once, plus the batch's live KV) over the read bandwidth."""
    if not gb_s:
        return None
    return (weight_bytes + batch * context * kv_per_token) / (gb_s * 1e9) * 1e3


# -- child side: measurements (torch imported here only) ------------------------------------------------------
def _import_asyncspec() -> Any:
    """asyncspec from this checkout; maps asyncspec.kernels onto kernels/ where the tree is not installed."""
    import importlib
    import importlib.util

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    asyncspec = importlib.import_module("asyncspec")
    try:
        importlib.import_module("asyncspec.kernels")
    except ImportError:
        spec = importlib.util.spec_from_file_location(
            "asyncspec.kernels", REPO / "kernels" / "__init__.py", submodule_search_locations=[str(REPO / "kernels")]
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["asyncspec.kernels"] = module
        spec.loader.exec_module(module)
        asyncspec.kernels = module
    return asyncspec


def load_prompts(n: int) -> list[list[int]]:
    """The first n benchmark prompts (token ids), cycled when the file has fewer."""
    with open(PROMPTS) as f:
        prompts = [json.loads(line)["prompt_token_ids"] for line in f if line.strip()]
    return [prompts[i % len(prompts)] for i in range(n)]


class Clock:
    """Wall time with the device drained at each reading."""

    def __init__(self, device: str) -> None:
        import torch

        self.cuda = device.startswith("cuda")
        self._torch = torch

    def __call__(self) -> float:
        if self.cuda:
            self._torch.cuda.synchronize()
        return time.perf_counter()

    def timed(self, fn: Callable[[], object]) -> float:
        """Seconds of one call, the device drained before and after."""
        t0 = self()
        fn()
        return self() - t0

    def median(self, fn: Callable[[], object], trials: int) -> tuple[float, list[float]]:
        times = []
        for _ in range(trials):
            t0 = self()
            fn()
            times.append(self() - t0)
        return statistics.median(times), times


def profile_totals(prof: Any) -> dict[str, float]:
    """Sums over a torch.profiler run: GPU time of the CUDA ops (kernels, copies, memsets), their counts, and the
    host's cudaGraphLaunch calls."""
    gpu_us, ops, kernels, graph_launches = 0.0, 0, 0, 0
    for e in prof.key_averages():
        if e.device_type.name == "CUDA":
            gpu_us += e.self_device_time_total
            ops += e.count
            if not e.key.startswith(("Memcpy", "Memset", "[memory]")):
                kernels += e.count
        elif e.key == "cudaGraphLaunch":
            graph_launches += e.count
    return {"gpu_us": gpu_us, "gpu_ops": ops, "kernels": kernels, "graph_launches": graph_launches}


def device_busy_seconds(prof: Any) -> float:
    """The union of the profiled device events' intervals (asyncspec's own trace summary). Summed durations
    overcount under programmatic dependent launch: a kernel's programs start early and wait inside its
    predecessor's time, so the sum can pass the wall time; the union cannot."""
    from asyncspec.worker.profiler import summarize_trace

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "window.json")
        prof.export_chrome_trace(path)
        trace = json.loads(Path(path).read_text())
    return summarize_trace(trace, "engine", path).device_busy_seconds


def _dtype_name(device: str, smoke: bool) -> str:
    return "float32" if smoke or not device.startswith("cuda") else "bfloat16"


def model_dir(model: str) -> str:
    """A directory the engine can load: the bundled target, or a temporary one holding only config.json."""
    if not MODELS[model]["dummy"]:
        return str(TARGET)
    path = tempfile.mkdtemp(prefix=f"step-speed-{model}-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    (Path(path) / "config.json").write_text(json.dumps(model_config(model)))
    return path


def engine_kwargs(model: str, part: str, s: dict[str, Any], utilization: float) -> dict[str, Any]:
    """LLM keyword arguments of one configuration."""
    spec = ASYNCSPEC_CONFIGS.get(part, {"enforce_eager": False})
    k = spec.get("num_speculative_tokens", 0)
    kwargs: dict[str, Any] = {
        "device": s["device"],
        "dtype": _dtype_name(s["device"], s["smoke"]),
        "max_model_len": s["max_model_len"],
        "max_num_seqs": s["max_num_seqs"],
        "max_num_batched_tokens": max(s["max_num_batched_tokens"], s["max_num_seqs"] * (k + 1)),
        "enable_prefix_caching": False,
        "gpu_memory_utilization": utilization,
        # Token-id prompts and no text output, as transformers' generate: no detokenization in the step loop.
        "skip_tokenizer_init": True,
        **spec,
    }
    if MODELS[model]["dummy"]:
        kwargs["load_format"] = "dummy"
    if s["smoke"]:
        kwargs["num_kv_blocks"] = s["smoke_kv_blocks"]  # the CPU pool would otherwise take a quarter of the RAM
    return kwargs


def construct(asyncspec: Any, model: str, kwargs: dict[str, Any], clock: Clock) -> tuple[Any, float, float]:
    """The engine, its construction seconds and the seconds since the process started."""
    path = model_dir(model)
    t0 = time.perf_counter()  # no device sync first: CUDA's initialisation is part of a cold start
    llm = asyncspec.LLM(path, **kwargs)
    return llm, clock() - t0, clock() - PROCESS_START


def engine_facts(llm: Any) -> dict[str, Any]:
    """Pool size and the weight bytes of the engine's own model (a cross-check of the analytic roofline)."""
    runner = llm.engine.engine_core.runner
    stats = llm.stats()
    seen: set[int] = set()
    total = read = 0
    params = 0
    for name, p in runner.model.named_parameters(remove_duplicate=False):
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        nbytes = p.numel() * p.element_size()
        params += p.numel()
        total += nbytes
        untied_embedding = name.endswith("embed_tokens.weight") and not runner.model_config.tie_word_embeddings
        read += 0 if untied_embedding else nbytes
    block_size = runner.config.block_size
    return {
        "num_kv_blocks": stats["num_kv_blocks"],
        "block_size": block_size,
        "kv_capacity_tokens": stats["num_kv_blocks"] * block_size,
        "kv_pool_bytes_per_token": runner.bytes_per_block // block_size,
        "param_count_engine": params,
        "weight_bytes_engine": total,
        "weight_bytes_read_per_step_engine": read,
        "uses_cuda_graphs": bool(runner.uses_cuda_graphs),
    }


def _spec_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    keys = ("num_steps", "num_generation_tokens", "spec_num_drafts", "spec_num_accepted_tokens")
    d: dict[str, Any] = {k: after[k] - before[k] for k in keys}
    d["num_device_steps"] = after.get("num_device_steps", 0) - before.get("num_device_steps", 0)
    d["cuda_graph_replays"] = after.get("cuda_graph_replays", 0) - before.get("cuda_graph_replays", 0)
    d["cuda_graph_eager_forwards"] = after.get("cuda_graph_eager_forwards", 0) - before.get(
        "cuda_graph_eager_forwards", 0
    )
    d["acceptance_length"] = (
        1.0 + d["spec_num_accepted_tokens"] / d["spec_num_drafts"] if d["spec_num_drafts"] else None
    )
    # Steps per verified k (the adaptive policy's choices), where the engine counts them.
    ks = sorted({key for key in (*before, *after) if key.startswith("spec_steps_with_k_")})
    d["steps_per_k"] = {key.rsplit("_", 1)[1]: after.get(key, 0) - before.get(key, 0) for key in ks}
    return d


def _step_timing_delta(before: dict[str, float], after: dict[str, float], steps: int, wall: float) -> dict:
    """The engine's own step timing over a window (llm.stats(); absent in older checkouts): CPU planning,
    launch-to-launch gap and device idle between steps (CUDA events), per step and as a share of wall time."""
    if "device_idle_seconds_total" not in after:
        return {}

    def per_step_ms(key: str) -> float:
        return (after[key] - before[key]) / steps * 1e3

    idle = after["device_idle_seconds_total"] - before["device_idle_seconds_total"]
    return {
        "scheduling_ms_per_step": per_step_ms("step_scheduling_seconds_total"),
        "update_ms_per_step": per_step_ms("step_update_seconds_total"),
        "launch_gap_ms_per_step": per_step_ms("step_launch_gap_seconds_total"),
        "device_idle_ms_per_step": per_step_ms("device_idle_seconds_total"),
        "device_idle_fraction": idle / wall if wall > 0 else None,
    }


def decode_window(llm: Any, asyncspec: Any, batch: int, s: dict[str, Any], profiled: bool = True) -> dict:
    """Steady decode at `batch` requests: every prompt prefilled, then `window_steps` engine steps timed and, with
    `profiled`, as many profiled (GPU time from the CUDA activity; null on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    clock = Clock(s["device"])
    engine = llm.engine
    k = (llm.config.num_speculative_tokens or 0) if llm.config.speculative_method else 0
    steps, warm = s["window_steps"], 3
    # Enough tokens that no request finishes inside the windows (both run, when profiled), even if every draft
    # is accepted and every engine step is a plan of the most decode steps; but within max_model_len.
    per_step = (k + 1) * llm.config.max_scheduler_steps
    prompts = load_prompts(batch)
    room = engine.max_model_len - max(len(p) for p in prompts) - 1
    max_tokens = min(2 + (warm + 2 * steps + 2) * per_step, room)
    params = asyncspec.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tag = f"win{batch}-{time.monotonic_ns()}"
    reqs = [engine.make_request(p, params, f"{tag}-{i}") for i, p in enumerate(prompts)]
    for r in reqs:
        engine.add_request(r, stream_deltas=False, enforce_queue_limit=False)
    try:
        for _ in range(10_000):  # prefill (chunked over several steps at large batches)
            if all(r.num_output_tokens > 0 for r in reqs):
                break
            engine.step()
        else:
            raise RuntimeError("prefill did not finish in 10000 steps")
        for _ in range(warm):
            engine.step()

        def window() -> tuple[float, list[float], int, float]:
            before = sum(r.num_output_tokens for r in reqs)
            ctx = statistics.fmean(r.num_tokens for r in reqs)
            per_step = []
            t0 = clock()
            for _ in range(steps):
                ts = time.perf_counter()
                engine.step()
                per_step.append(time.perf_counter() - ts)
            wall = clock() - t0
            ctx = (ctx + statistics.fmean(r.num_tokens for r in reqs)) / 2
            return wall, per_step, sum(r.num_output_tokens for r in reqs) - before, ctx

        s0 = llm.stats()
        wall, per_step, tokens, ctx = window()
        s1 = llm.stats()
        cuda = s["device"].startswith("cuda") and profiled
        if profiled:
            device_steps_before = llm.stats().get("num_device_steps", 0)
            with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
                pwall, _, ptokens, _ = window()
            # The profiler slows the host, and the adaptive loop may then plan two or more device steps at once
            # (an H100's 32-stream window, 2026-12-06): the profiled figures are per device step, not per call.
            psteps = int(llm.stats().get("num_device_steps", 0) - device_steps_before) or steps
            totals = profile_totals(prof)  # on the CPU too (the code path), but only CUDA activity counts
            union_s = device_busy_seconds(prof)  # likewise: no device events on the CPU
        else:
            pwall, psteps = None, steps
        finished = sum(r.is_finished for r in reqs)
    finally:
        engine.abort_requests([r.request_id for r in reqs if not r.is_finished])
    wall_ms = wall / steps * 1e3
    per_seq = tokens / steps / batch
    out: dict[str, Any] = {
        "batch": batch,
        "steps": steps,
        "wall_ms_per_step": wall_ms,
        "wall_ms_per_device_step": None,
        "median_step_ms": statistics.median(per_step) * 1e3,
        "tokens": tokens,
        "tokens_per_step_per_seq": per_seq,
        "wall_ms_per_token": wall_ms / per_seq if per_seq else None,
        "decode_tok_s": tokens / wall if wall > 0 else None,
        "mean_context_tokens": ctx,
        "finished_during_windows": finished,
        "profiled_device_steps": psteps if pwall is not None else None,
        "profiled_wall_s": pwall,
        "profiled_wall_ms_per_step": pwall / psteps * 1e3 if pwall is not None else None,
        "gpu_ms_per_step": None,
        "gpu_ms_per_token": None,
        "kernels_per_step": None,
        "gpu_ops_per_step": None,
        "graph_launches_per_step": None,
        "gpu_busy_fraction": None,
        "gpu_busy_fraction_profiled": None,
        "gpu_busy_union_ms_per_step": None,
        "gpu_busy_fraction_union": None,
        **{f"timed_{k2}": v for k2, v in _spec_delta(s0, s1).items()},
        **_step_timing_delta(s0, s1, steps, wall),
    }
    out["wall_ms_per_device_step"] = wall / (out.get("timed_num_device_steps") or steps) * 1e3
    if finished:
        out["window_warning"] = f"{finished} of {batch} requests finished inside the windows: steps ran fewer rows"
    if cuda:
        gpu_ms = totals["gpu_us"] / 1e3 / psteps
        pper_seq = ptokens / psteps / batch
        out.update(
            gpu_ms_per_step=gpu_ms,
            gpu_ms_per_token=gpu_ms / pper_seq if pper_seq else None,
            kernels_per_step=totals["kernels"] / psteps,
            gpu_ops_per_step=totals["gpu_ops"] / psteps,
            graph_launches_per_step=totals["graph_launches"] / psteps,
            gpu_busy_fraction=gpu_ms / out["wall_ms_per_device_step"] if wall else None,
            gpu_busy_fraction_profiled=gpu_ms / out["profiled_wall_ms_per_step"],
        )
        if union_s > 0:
            union_ms = union_s * 1e3 / psteps
            out.update(
                gpu_busy_union_ms_per_step=union_ms,
                gpu_busy_fraction_union=union_ms / out["profiled_wall_ms_per_step"],
            )
        # A traced graph replay shows every layer's kernels (several each); far fewer means the profiler saw only
        # the launch, and the GPU time is an undercount.
        layers = llm.engine.model_config.num_hidden_layers
        replayed = totals["graph_launches"] or out["timed_cuda_graph_replays"]
        if replayed and out["kernels_per_step"] < 2 * layers:
            out["profiler_warning"] = "graph kernels look untraced: GPU ms per step is an undercount"
    return out


def bench_asyncspec(model: str, part: str, s: dict[str, Any]) -> dict:
    """One asyncspec configuration: batch-1 TPOT, decode windows, throughput per concurrency.

    Everything timed runs in an engine built before the profiler ever starts: once CUPTI is attached, every
    later launch in the process pays for it (a batch-1 TPOT measured 3 % slower on the Llama-1B shape and 10-75 %
    on the bundled target, H200, 2026-12-01). The windows' GPU times come from a second engine built after
    the profiler's start (Kineto must start before any CUDA graph is captured, or replays show no kernels:
    pytorch#100441), and their GPU-busy fraction is that GPU time over the first engine's wall time."""
    import torch

    asyncspec = _import_asyncspec()
    cuda = s["device"].startswith("cuda")
    kwargs = engine_kwargs(model, part, s, s["speed_gpu_memory_utilization"])
    clock = Clock(s["device"])
    llm, startup_s, since_process_start_s = construct(asyncspec, model, kwargs, clock)
    row: dict[str, Any] = {"engine_kwargs": kwargs, "startup_s": startup_s, **engine_facts(llm)}
    row["ready_since_process_start_s"] = since_process_start_s
    if cuda:
        row["memory_allocated_after_start"] = torch.cuda.memory_allocated()
    n = s["new_tokens"]
    full = asyncspec.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    one = asyncspec.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    warm = asyncspec.SamplingParams(temperature=0.0, max_tokens=min(n, 16), ignore_eos=True)
    prompts = load_prompts(max(s["concurrency"] + s["window_batches"] + [1]))

    # Batch-1 TPOT by subtraction. The first timed runs of a process measured slower than the later ones (up to
    # 1.6x on an H100 host), so several untimed full runs come first.
    llm.generate([prompts[0]], one)
    for _ in range(s.get("warmup_runs", 1)):
        llm.generate([prompts[0]], full)
    # Alternated (full, one, full, one, ...), so that a drift of the host's speed moves both alike; the counters
    # are read around each full run, outside its timing.
    full_runs, one_runs, deltas = [], [], []
    for _ in range(s["trials"]):
        st0 = llm.stats()
        full_runs.append(clock.timed(lambda: llm.generate([prompts[0]], full)))
        deltas.append(_spec_delta(st0, llm.stats()))
        one_runs.append(clock.timed(lambda: llm.generate([prompts[0]], one)))
    t_full, t_one = statistics.median(full_runs), statistics.median(one_runs)
    drafts = sum(d["spec_num_drafts"] for d in deltas)
    b1 = {
        "num_steps": sum(d["num_steps"] for d in deltas),
        "acceptance_length": 1.0 + sum(d["spec_num_accepted_tokens"] for d in deltas) / drafts if drafts else None,
    }
    row["tpot"] = {
        "tpot_ms": (t_full - t_one) / (n - 1) * 1e3,
        "full_s": full_runs,
        "prefill_only_s": one_runs,
        "steps_per_generation": b1["num_steps"] / s["trials"],
        "acceptance_length": b1["acceptance_length"],
    }

    # Throughput per concurrency (before the windows: every batch shape's kernels are compiled by then).
    row["throughput"] = {}
    for c in s["concurrency"]:
        batch = prompts[:c]
        try:
            llm.generate(batch, warm)  # untimed, same batch: compiles what this shape needs
            last: list = []

            def timed_full(b: list[list[int]] = batch, last: list = last) -> None:
                last[:] = llm.generate(b, full)

            st0 = llm.stats()
            t_full, full_runs = clock.median(timed_full, s["throughput_trials"])
            st1 = llm.stats()
            t_one, one_runs = clock.median(lambda b=batch: llm.generate(b, one), s["throughput_trials"])
            generated = sum(len(o.token_ids) for o in last)
            delta = _spec_delta(st0, st1)
            row["throughput"][str(c)] = {
                "streams": c,
                "e2e_tok_s": generated / t_full,
                "decode_tok_s": c * (n - 1) / (t_full - t_one) if t_full > t_one else None,
                "full_s": full_runs,
                "prefill_only_s": one_runs,
                "generated": generated,
                "mean_prompt_tokens": statistics.fmean(len(p) for p in batch),
                "steps_per_run": delta["num_steps"] / s["throughput_trials"],
                "acceptance_length": delta["acceptance_length"],
                "cuda_graph_replays": delta["cuda_graph_replays"],
                "cuda_graph_eager_forwards": delta["cuda_graph_eager_forwards"],
            }
        except Exception as e:  # noqa: BLE001 - one concurrency failing (e.g. out of memory) keeps the others
            row["throughput"][str(c)] = {"error": f"{type(e).__name__}: {e}"[-2000:]}
            if cuda:
                torch.cuda.empty_cache()

    batches = s["sweep_batches"] if part == "graphed" else s["window_batches"]
    row["windows"] = {}
    for b in sorted(set(batches)):
        try:
            row["windows"][str(b)] = decode_window(llm, asyncspec, b, s, profiled=False)
        except Exception as e:  # noqa: BLE001
            row["windows"][str(b)] = {"error": f"{type(e).__name__}: {e}"[-2000:]}
    row["stats_final"] = {k: v for k, v in llm.stats().items() if not k.startswith("spec_accepted_at")}
    if row["windows"]:
        del llm
        gc.collect()  # the traced engine sizes its KV pool from the memory this one frees
        if cuda:
            torch.cuda.empty_cache()
        profile_windows(asyncspec, model, kwargs, row["windows"], s)
    return row


def _wall_ms_per_device_step(window: dict[str, Any]) -> float | None:
    """A window's wall ms per device step: per `engine.step` call where the window predates the field (one
    device step a call unless multi-step plans ran)."""
    value = window.get("wall_ms_per_device_step")
    return value if value is not None else window.get("wall_ms_per_step")


# The GPU-time fields of a window, taken from the traced engine's run of it.
_TRACED_FIELDS = (
    "profiled_device_steps",
    "profiled_wall_s",
    "profiled_wall_ms_per_step",
    "gpu_busy_union_ms_per_step",
    "gpu_busy_fraction_union",
    "gpu_ms_per_step",
    "gpu_ms_per_token",
    "kernels_per_step",
    "gpu_ops_per_step",
    "graph_launches_per_step",
    "gpu_busy_fraction_profiled",
    "profiler_warning",
)
_TRACED_RENAMED = {"window_warning": "traced_window_warning"}


def profile_windows(asyncspec: Any, model: str, kwargs: dict[str, Any], windows: dict[str, dict], s: dict) -> None:
    """Fills the GPU-time fields of `windows` (timed in an untraced engine) from a second engine built after the
    profiler's start; the busy fraction is its GPU ms per step over the untraced wall ms per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA if s["device"].startswith("cuda") else ProfilerActivity.CPU]):
        pass
    llm = asyncspec.LLM(model_dir(model), **kwargs)
    for b, window in windows.items():
        if "error" in window:
            continue
        try:
            traced = decode_window(llm, asyncspec, int(b), s, profiled=True)
        except Exception as e:  # noqa: BLE001
            window["traced_error"] = f"{type(e).__name__}: {e}"[-2000:]
            continue
        window.update({key: traced[key] for key in _TRACED_FIELDS if key in traced})
        window.update({new: traced[old] for old, new in _TRACED_RENAMED.items() if old in traced})
        gpu_ms = traced["gpu_ms_per_step"]  # per device step
        wall_ms = _wall_ms_per_device_step(window)
        window["gpu_busy_fraction"] = gpu_ms / wall_ms if gpu_ms is not None and wall_ms else None
        window["traced_wall_ms_per_step"] = traced["wall_ms_per_step"]


def bench_startup(model: str, s: dict[str, Any]) -> dict:
    """Construction at the default gpu_memory_utilization (CUDA graphs on, no speculation) and KV capacity."""
    import torch

    asyncspec = _import_asyncspec()
    kwargs = engine_kwargs(model, "startup", s, s["startup_gpu_memory_utilization"])
    clock = Clock(s["device"])
    llm, startup_s, since_process_start_s = construct(asyncspec, model, kwargs, clock)
    facts = engine_facts(llm)
    prompts = load_prompts(max(s["concurrency"]))
    bench_len = statistics.fmean(len(p) for p in prompts) + s["new_tokens"]
    per_token = facts["kv_pool_bytes_per_token"]
    out = llm.generate([prompts[0]], asyncspec.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    row = {
        "engine_kwargs": kwargs,
        "startup_s": startup_s,
        "ready_since_process_start_s": since_process_start_s,
        **facts,
        "benchmark_stream_tokens": bench_len,
        "kv_bytes_per_stream_at_benchmark_length": per_token * bench_len,
        "kv_bytes_per_stream_at_max_model_len": per_token * s["max_model_len"],
        "streams_at_benchmark_length": int(facts["kv_capacity_tokens"] // bench_len),
        "generated_after_start": len(out[0].token_ids),
        "startup_phases": {k: v for k, v in llm.stats().items() if k.startswith("startup_")},
    }
    if s["device"].startswith("cuda"):
        free, total = torch.cuda.mem_get_info()
        row.update(
            gpu_total_bytes=total,
            gpu_free_bytes=free,
            memory_allocated=torch.cuda.memory_allocated(),
            memory_reserved=torch.cuda.memory_reserved(),
        )
    return row


def bench_bandwidth(s: dict[str, Any]) -> dict:
    """Read bandwidth: a reduction over a large bf16 tensor, timed with CUDA events (perf_counter on the CPU)."""
    import torch

    cuda = s["device"].startswith("cuda")
    nbytes = s["bandwidth_bytes"]
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=s["device"]).uniform_(-1, 1)
    out: dict[str, Any] = {"tensor_bytes": x.numel() * x.element_size()}
    for name, fn in (("sum", torch.sum), ("amax", torch.amax)):
        times = []
        for i in range(3 + s["bandwidth_trials"]):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn(x)
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                fn(x)
                ms = (time.perf_counter() - t0) * 1e3
            if i >= 3:
                times.append(ms)
        med = statistics.median(times)
        out[f"{name}_ms"] = times
        out[f"{name}_GB_s"] = out["tensor_bytes"] / (med / 1e3) / 1e9
    out["GB_s"] = max(out["sum_GB_s"], out["amax_GB_s"])
    if cuda:
        props = torch.cuda.get_device_properties(0)
        out.update(
            card=torch.cuda.get_device_name(), gpu_total_bytes=props.total_memory, sms=props.multi_processor_count
        )
    return out


def _hf_model(model: str, s: dict[str, Any], draft: bool = False) -> Any:
    """transformers model on the device: the bundled checkpoint, or the dummy shape initialised seeded."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    dtype = torch.bfloat16 if _dtype_name(s["device"], s["smoke"]) == "bfloat16" else torch.float32
    if not MODELS[model]["dummy"]:
        m = AutoModelForCausalLM.from_pretrained(str(DRAFT if draft else TARGET), dtype=dtype)
    else:
        torch.manual_seed(0)
        cfg = LlamaConfig(**model_config(model))
        try:
            with torch.device(s["device"]):  # initialise on the GPU: 8B random weights on the host take minutes
                m = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        except Exception:  # noqa: BLE001 - fall back to the host, then move
            m = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    m = m.to(s["device"]).eval()
    m.generation_config.eos_token_id = None  # EOS ignored, as in the asyncspec runs
    return m


def bench_hf_tpot(model: str, s: dict[str, Any], assisted: bool) -> dict:
    """transformers batch-1 TPOT: static cache (compiled decoding on CUDA) or assisted generation with the draft."""
    import torch

    target = _hf_model(model, s)
    draft = None
    if assisted:
        draft = _hf_model(model, s, draft=True)
        draft.generation_config.num_assistant_tokens = K
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0
    prompt = load_prompts(1)[0]
    n = s["new_tokens"]

    def gen(num: int) -> Any:
        ids = torch.tensor([prompt], device=s["device"])
        extra = {"assistant_model": draft} if assisted else {"cache_implementation": "static"}
        with torch.inference_mode():
            return target.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=num,
                min_new_tokens=num,
                do_sample=False,
                pad_token_id=0,
                **extra,
            )

    clock = Clock(s["device"])
    t0 = clock()
    gen(n)  # compilation (static cache) / first-call set-up
    first_call_s = clock() - t0
    gen(1)
    gen(n)
    t_full, full_runs = clock.median(lambda: gen(n), s["trials"])
    t_one, one_runs = clock.median(lambda: gen(1), s["trials"])
    row: dict[str, Any] = {
        "tpot_ms": (t_full - t_one) / (n - 1) * 1e3,
        "full_s": full_runs,
        "prefill_only_s": one_runs,
        "first_call_s": first_call_s,
        "cache": "dynamic (assisted)" if assisted else "static",
    }
    if assisted:
        calls = {"target": 0, "draft": 0}
        hooks = [target.register_forward_hook(lambda *_: calls.__setitem__("target", calls["target"] + 1))]
        hooks.append(draft.register_forward_hook(lambda *_: calls.__setitem__("draft", calls["draft"] + 1)))
        out = gen(n)
        for h in hooks:
            h.remove()
        generated = out.shape[1] - len(prompt)
        row["acceptance_length"] = generated / calls["target"] if calls["target"] else None
        row["draft_forwards_per_target_forward"] = calls["draft"] / calls["target"] if calls["target"] else None
    return row


def bench_hf_batch(model: str, s: dict[str, Any], streams: int) -> dict:
    """transformers generate_batch (continuous batching, CUDA graphs on CUDA) at `streams` streams."""
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    hf = _hf_model(model, s)
    n = s["new_tokens"]
    prompts = load_prompts(streams)
    cuda = s["device"].startswith("cuda")
    cb_kwargs: dict[str, Any] = {"use_cuda_graph": cuda, "max_requests_per_batch": streams}
    if not cuda:
        cb_kwargs.update(num_blocks=s["smoke_kv_blocks"], max_batch_tokens=1024)  # a small host cache

    def run(num: int) -> int:
        cfg = GenerationConfig(max_new_tokens=num, do_sample=False, eos_token_id=None, pad_token_id=0)
        outs = hf.generate_batch(
            prompts, generation_config=cfg, continuous_batching_config=ContinuousBatchingConfig(**cb_kwargs)
        )
        return sum(len(o.generated_tokens) for o in outs.values())

    clock = Clock(s["device"])
    t0 = clock()
    run(n)  # warm-up (graph capture, compilation)
    first_call_s = clock() - t0
    counts: list[int] = []
    t_full, full_runs = clock.median(lambda: counts.append(run(n)), s["throughput_trials"])
    row: dict[str, Any] = {
        "streams": streams,
        "e2e_tok_s": counts[-1] / t_full,
        "generated": counts[-1],
        "full_s": full_runs,
        "first_call_s": first_call_s,
        "decode_tok_s": None,
    }
    try:
        t_one, one_runs = clock.median(lambda: run(1), s["throughput_trials"])
        row["prefill_only_s"] = one_runs
        row["decode_tok_s"] = streams * (n - 1) / (t_full - t_one) if t_full > t_one else None
    except Exception as e:  # noqa: BLE001 - the end-to-end figure stands without it
        row["prefill_only_error"] = f"{type(e).__name__}: {e}"[-1000:]
    return row


def run_one(model: str | None, part: str, s: dict[str, Any]) -> dict:
    """One part in this process (main() gives each its own)."""
    if s["smoke"]:
        import torch

        torch.set_num_threads(1)  # tiny work: one thread, and no spinning threads on a shared CI machine
    if part == "bandwidth":
        return bench_bandwidth(s)
    assert model is not None
    if part in ASYNCSPEC_CONFIGS:
        return bench_asyncspec(model, part, s)
    if part == "startup":
        return bench_startup(model, s)
    if part in ("hf-static", "hf-assisted"):
        return bench_hf_tpot(model, s, assisted=part == "hf-assisted")
    if part.startswith("hf-batch-"):
        return bench_hf_batch(model, s, int(part.rsplit("-", 1)[1]))
    raise ValueError(f"unknown part {part!r}")


# -- parent side: processes, merging, derived figures, tables --------------------------------------------------
def run_child(model: str | None, part: str, s: dict[str, Any], timeout: float) -> dict:
    """Runs one part in a fresh process (its own session, killed whole on timeout); its row or {"error": ...}."""
    cmd = [sys.executable, __file__, "--one", model or "-", part, "--settings-json", json.dumps(s)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO), start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=max(timeout, 1.0))
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        if lines:
            row = json.loads(lines[-1][len("RESULT ") :])
        else:
            row = {"error": f"exit {proc.returncode}: {stderr[-3000:]}"}
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _, stderr = proc.communicate()
        row = {"error": f"timed out after {timeout:.0f} s; stderr: {(stderr or '')[-2000:]}"}
    return {"process_wall_s": round(time.perf_counter() - t0, 1), **row}


def detect_card(device: str) -> str:
    """The GPU's name from a short child process (the parent never initialises CUDA), or the CPU's."""
    if not device.startswith("cuda"):
        return f"cpu ({platform.processor() or platform.machine() or 'unknown'})"
    proc = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.get_device_name())"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0 or not proc.stdout.strip():
        raise SystemExit(f"no CUDA device: {proc.stderr[-1000:]}")
    return proc.stdout.strip().splitlines()[-1]


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        proc = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO, timeout=10)
        return proc.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def new_results(card: str) -> dict[str, Any]:
    return {"schema": SCHEMA, "card": card, "runs": [], "bandwidth": {"GB_s": None, "runs": []}, "models": {}}


def merge_results(base: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`new`'s runs, bandwidth runs and rows added to `base` (a row of the same model and part replaces the old
    one); the top-level date, command, versions and settings become the latest run's. Same card and schema only."""
    for r in (base, new):
        if r.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} file (schema {r.get('schema')!r})")
    if base["card"] != new["card"]:
        raise ValueError(f"cards differ: {base['card']!r} vs {new['card']!r}; results of one card only")
    seen = {(r["date"], r["command"]) for r in base["runs"]}
    base["runs"] += [r for r in new["runs"] if (r["date"], r["command"]) not in seen]
    base["runs"].sort(key=lambda r: r["date"])
    seen_bw = {(r.get("date"), r.get("GB_s")) for r in base["bandwidth"]["runs"]}
    base["bandwidth"]["runs"] += [r for r in new["bandwidth"]["runs"] if (r.get("date"), r.get("GB_s")) not in seen_bw]
    for model, entry in new["models"].items():
        rows = {**base["models"].get(model, {}).get("rows", {}), **entry["rows"]}
        base["models"][model] = {**entry, "rows": rows}
    if base["runs"]:
        last = base["runs"][-1]
        base.update(date=last["date"], command=last["command"], versions=last["versions"], settings=last["settings"])
    derive(base)
    return base


def model_entry(model: str, s: dict[str, Any]) -> dict[str, Any]:
    """The model's static facts: shape, weight bytes per step, KV bytes per token."""
    shape = shape_of(model_config(model))
    dtype_bytes = 4 if _dtype_name(s["device"], s["smoke"]) == "float32" else 2
    notes = []
    if MODELS[model]["dummy"]:
        notes.append(
            "random weights: no draft model; n-gram speculation accepts whatever the random model's greedy output "
            "repeats, so its rows measure the cost of speculating, not a real model's gain"
        )
    return {
        "label": MODELS[model]["label"],
        "dummy_weights": MODELS[model]["dummy"],
        "shape": shape,
        "dtype_bytes": dtype_bytes,
        "param_count": param_count(shape),
        "weight_bytes_per_step": read_params(shape) * dtype_bytes,
        "kv_bytes_per_token": kv_bytes_per_token(shape, dtype_bytes),
        "notes": notes,
        "rows": {},
    }


def _busy_fraction(window: dict[str, Any]) -> float | None:
    """A window's GPU-busy share of wall time: the union of its device events where the trace had them (summed
    durations overcount under PDL), else the summed durations' share."""
    union = window.get("gpu_busy_fraction_union")
    return union if union is not None else window.get("gpu_busy_fraction")


def _get(d: Any, *keys: Any) -> Any:
    """d[k0][k1]... or None where a level is missing or an error row."""
    for k in keys:
        if not isinstance(d, dict) or "error" in d or k not in d:
            return None
        d = d[k]
    return d


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def derive(results: dict[str, Any]) -> None:
    """Fills results["bandwidth"]["GB_s"] (median of the runs) and each model's "summary": roofline, x-factors,
    wall - GPU gap, GPU-busy fractions, ratios against transformers, speculation on vs off."""
    bws = [r["GB_s"] for r in results["bandwidth"]["runs"] if isinstance(r.get("GB_s"), (int, float))]
    bw = statistics.median(bws) if bws else None
    results["bandwidth"]["GB_s"] = bw
    s = results["runs"][-1]["settings"] if results["runs"] else {}
    ref = s.get("reference_streams", 32)
    big = max(s.get("window_batches", [64]))
    for entry in results["models"].values():
        rows = entry["rows"]
        wb, kvt = entry["weight_bytes_per_step"], entry["kv_bytes_per_token"]
        hf_tpot = _get(rows, "hf-static", "tpot_ms")
        hf_batch = {
            int(name.rsplit("-", 1)[1]): _get(r, "e2e_tok_s") for name, r in rows.items() if "hf-batch-" in name
        }
        summary: dict[str, Any] = {
            "bandwidth_GB_s": bw,
            "roofline_ms_batch1": roofline_ms(wb, kvt, 0, 0, bw),
            "reference_streams": ref,
            "busy_batch": big,
            "configs": {},
        }
        for name in ASYNCSPEC_CONFIGS:
            row = rows.get(name)
            if row is None or "error" in row:
                continue
            w1 = _get(row, "windows", "1") or {}
            c: dict[str, Any] = {
                "startup_s": row.get("startup_s"),
                "tpot_ms": _get(row, "tpot", "tpot_ms"),
                "acceptance_length_batch1": _get(row, "tpot", "acceptance_length"),
                "hf_static_tpot_over_tpot": _ratio(hf_tpot, _get(row, "tpot", "tpot_ms")),
                "tok_s": {k: _get(v, "e2e_tok_s") for k, v in row.get("throughput", {}).items()},
                "decode_tok_s": {k: _get(v, "decode_tok_s") for k, v in row.get("throughput", {}).items()},
            }
            for key in ("gpu_ms_per_step", "kernels_per_step", "tokens_per_step_per_seq"):
                c[f"{key}_b1"] = w1.get(key)
            # Beside GPU time and the roofline, wall time per device step (a plan may run several a call).
            c["wall_ms_per_step_b1"] = _wall_ms_per_device_step(w1) if w1 else None
            c["gpu_ms_per_token_b1"] = w1.get("gpu_ms_per_token")
            c["wall_ms_per_token_b1"] = w1.get("wall_ms_per_token")
            rl1 = roofline_ms(wb, kvt, 1, w1.get("mean_context_tokens") or 0, bw) if w1 else None
            c["roofline_ms_b1"] = rl1
            c["gpu_x_roofline_b1"] = _ratio(c["gpu_ms_per_step_b1"], rl1)
            c["wall_x_roofline_b1"] = _ratio(c["wall_ms_per_step_b1"], rl1)
            c["wall_minus_gpu_ms_b1"] = (
                c["wall_ms_per_step_b1"] - c["gpu_ms_per_step_b1"]
                if c["wall_ms_per_step_b1"] is not None and c["gpu_ms_per_step_b1"] is not None
                else None
            )
            c["gpu_busy_b1"] = _busy_fraction(w1)
            c[f"gpu_busy_b{big}"] = _busy_fraction(_get(row, "windows", str(big)) or {})
            tr = _get(row, "throughput", str(ref)) or {}
            decode, prompt = tr.get("decode_tok_s"), tr.get("mean_prompt_tokens")
            rl_ref = None
            if prompt is not None:
                rl_ref = roofline_ms(wb, kvt, ref, prompt + s.get("new_tokens", 128) / 2, bw)
            c["roofline_decode_tok_s_ref"] = ref / rl_ref * 1e3 if rl_ref else None
            c["fraction_of_roofline_ref_by_subtraction"] = _ratio(decode, c["roofline_decode_tok_s_ref"])
            # Steady decode at `ref` streams (a decode window, when the config has one there): one step's
            # roofline over its wall time, free of the prefill that the subtraction above carries.
            w_ref = _get(row, "windows", str(ref))
            c["fraction_of_roofline_ref"] = None
            if w_ref and "error" not in w_ref:
                rl_w = roofline_ms(wb, kvt, ref, w_ref["mean_context_tokens"], bw)
                c["fraction_of_roofline_ref"] = _ratio(rl_w, _wall_ms_per_device_step(w_ref))
            c["over_hf_batch"] = {str(st): _ratio(c["tok_s"].get(str(st)), hf) for st, hf in hf_batch.items()}
            summary["configs"][name] = c
        # Speculation on vs off at the same concurrency (the adaptive-k question).
        summary["speculation_on_vs_off"] = []
        for spec_name in ASYNCSPEC_CONFIGS:
            if "-" not in spec_name or spec_name not in summary["configs"]:
                continue
            base = spec_name.split("-")[0]
            if base not in summary["configs"]:
                continue
            for st in s.get("adaptive_streams", [32, 128]):
                off = summary["configs"][base]["tok_s"].get(str(st))
                on = summary["configs"][spec_name]["tok_s"].get(str(st))
                item = {"config": spec_name, "base": base, "streams": st, "tok_s_off": off, "tok_s_on": on}
                summary["speculation_on_vs_off"].append({**item, "ratio": _ratio(on, off)})
        sweep = []
        windows = _get(rows, "graphed", "windows") or {}
        for b, w in sorted(((int(b), w) for b, w in windows.items()), key=lambda x: x[0]):
            if "error" in w:
                continue
            rl = roofline_ms(wb, kvt, b, w["mean_context_tokens"], bw)
            sweep.append(
                {
                    "batch": b,
                    "wall_ms_per_step": _wall_ms_per_device_step(w),
                    "gpu_ms_per_step": w["gpu_ms_per_step"],
                    "roofline_ms_per_step": rl,
                    "gpu_x_roofline": _ratio(w["gpu_ms_per_step"], rl),
                    "decode_tok_s": w["decode_tok_s"],
                }
            )
        summary["graphed_sweep"] = sweep
        summary["hf"] = {
            "static_tpot_ms": hf_tpot,
            "assisted_tpot_ms": _get(rows, "hf-assisted", "tpot_ms"),
            "assisted_acceptance_length": _get(rows, "hf-assisted", "acceptance_length"),
            "generate_batch_tok_s": {str(k): v for k, v in hf_batch.items()},
        }
        entry["summary"] = summary


def _f(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_tables(results: dict[str, Any]) -> None:
    """A compact table per model (stdout)."""
    derive(results)
    print(f"\n{results['card']}  {results.get('date')}  read bandwidth {_f(results['bandwidth']['GB_s'], '.0f')} GB/s")
    for model, entry in results["models"].items():
        sm = entry.get("summary", {})
        ref, big = sm.get("reference_streams", 32), sm.get("busy_batch", 64)
        print(
            f"\n== {model}: {entry['label']}; weights read per step {entry['weight_bytes_per_step'] / 1e6:.1f} MB, "
            f"batch-1 roofline {_f(sm.get('roofline_ms_batch1'), '.3f')} ms"
        )
        head = ["config", "TPOT ms", "HF/TPOT", "wall ms/st", "GPU ms/st", "GPU x RL", "wall-GPU", "kern/st"]
        head += ["tok/st", f"busy b1/b{big}", f"tok/s@{ref}", f"%RL@{ref}", f"xHFb@{ref}"]
        widths = [21, 9, 9, 11, 11, 9, 9, 8, 7, 12, 11, 8, 8]
        print("".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(head, widths, strict=True))))
        for name in ASYNCSPEC_CONFIGS:
            row = entry["rows"].get(name)
            if row is not None and "error" in row:
                print(f"{name:<21}error: {row['error'][-300:]!r}")
            c = sm.get("configs", {}).get(name)
            if row is None or c is None:
                continue
            frac = c.get("fraction_of_roofline_ref")
            cells = [
                name,
                _f(c["tpot_ms"]),
                _f(c["hf_static_tpot_over_tpot"]),
                _f(c["wall_ms_per_step_b1"], ".3f"),
                _f(c["gpu_ms_per_step_b1"], ".3f"),
                _f(c["gpu_x_roofline_b1"]),
                _f(c["wall_minus_gpu_ms_b1"], ".3f"),
                _f(c["kernels_per_step_b1"], ".0f"),
                _f(c["tokens_per_step_per_seq_b1"]),
                f"{_f(c['gpu_busy_b1'])}/{_f(c[f'gpu_busy_b{big}'])}",
                _f(c["tok_s"].get(str(ref)), ".0f"),
                _f(frac * 100 if frac is not None else None, ".0f"),
                _f(c["over_hf_batch"].get(str(ref))),
            ]
            print("".join(x.rjust(w) if i else x.ljust(w) for i, (x, w) in enumerate(zip(cells, widths, strict=True))))
        for name in ("startup", "hf-static", "hf-assisted", *[n for n in entry["rows"] if n.startswith("hf-batch-")]):
            row = entry["rows"].get(name)
            if row is None:
                continue
            if "error" in row:
                print(f"{name:<21}error: {row['error'][-300:]!r}")
            elif name == "startup":
                print(
                    f"{name:<21}{row['startup_s']:.1f} s at gpu_memory_utilization "
                    f"{row['engine_kwargs']['gpu_memory_utilization']}, KV {row['kv_capacity_tokens']} tokens, "
                    f"{row['kv_bytes_per_stream_at_benchmark_length'] / 2**20:.1f} MiB per stream of "
                    f"{row['benchmark_stream_tokens']:.0f} tokens ({row['streams_at_benchmark_length']} streams)"
                )
            elif name.startswith("hf-batch-"):
                e2e, dec = _f(row["e2e_tok_s"], ".0f"), _f(row["decode_tok_s"], ".0f")
                print(f"{name:<21}{e2e} tok/s end to end, decode phase {dec} tok/s")
            else:
                acc = row.get("acceptance_length")
                print(f"{name:<21}TPOT {row['tpot_ms']:.2f} ms" + (f", acceptance length {acc:.2f}" if acc else ""))
        for item in sm.get("speculation_on_vs_off", []):
            print(
                f"  spec on/off {item['config']:<14}@{item['streams']:<4} {_f(item['tok_s_on'], '.0f')} vs "
                f"{_f(item['tok_s_off'], '.0f')} tok/s = x{_f(item['ratio'])}"
            )
        for note in entry.get("notes", []):
            print(f"  note: {note}")
        for name, row in entry["rows"].items():
            for b, window in (row.get("windows") or {}).items():
                for key in ("window_warning", "traced_window_warning", "profiler_warning", "traced_error"):
                    if window.get(key):
                        print(f"  warning: {name} window at batch {b}: {key}: {window[key]}")
    print(
        "\nTPOT: batch-1 wall ms per token by subtraction; wall/GPU ms/st, kern/st, tok/st: steady decode at batch 1 "
        "(GPU from torch.profiler); GPU x RL: GPU ms per step / roofline; busy: GPU ms / wall ms per step; "
        "%RL: decode-phase tok/s / roofline tok/s; xHFb: tok/s / transformers generate_batch tok/s."
    )


def settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    s: dict[str, Any] = {
        "smoke": bool(args.smoke),
        "device": args.device,
        "new_tokens": args.new_tokens,
        "trials": args.trials,
        "warmup_runs": args.warmup_runs,
        "throughput_trials": args.throughput_trials,
        "concurrency": [int(x) for x in args.concurrency.split(",")],
        "window_batches": [int(x) for x in args.window_batches.split(",")],
        "sweep_batches": [int(x) for x in args.sweep_batches.split(",")],
        "window_steps": args.window_steps,
        "reference_streams": 32,
        "adaptive_streams": [32, 128],
        "hf_batch_streams": [int(x) for x in args.hf_batch_streams.split(",")],
        "max_model_len": 2048,
        "max_num_batched_tokens": 4096,
        "speed_gpu_memory_utilization": 0.5,
        "startup_gpu_memory_utilization": 0.9,
        "bandwidth_bytes": 3 * 2**30,  # 1.6e9 bf16 elements: past any cache, under 32-bit indexing
        "bandwidth_trials": 10,
        "smoke_kv_blocks": 256,
    }
    if args.smoke:
        s.update(
            device="cpu",
            new_tokens=4,
            trials=1,
            warmup_runs=1,
            throughput_trials=1,
            concurrency=[1, 2],
            window_batches=[1, 2],
            sweep_batches=[1, 2],
            window_steps=2,
            reference_streams=2,
            adaptive_streams=[1, 2],
            hf_batch_streams=[2],
            max_model_len=1024,
            max_num_batched_tokens=1024,
            bandwidth_bytes=64 * 2**20,
            bandwidth_trials=3,
        )
    s["max_num_seqs"] = max(s["concurrency"] + s["window_batches"] + s["sweep_batches"])
    return s


def _write(results: dict[str, Any], path: Path) -> None:
    derive(results)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "gpu_step_speed.json"))
    parser.add_argument("--models", default="bundled,llama-1b,llama-8b", help=f"of {', '.join(MODELS)}")
    parser.add_argument("--parts", default="bandwidth,all", help=f"of {', '.join(PART_ORDER)}; groups {list(GROUPS)}")
    parser.add_argument("--merge", action="store_true", help="add to the rows already in --output (same card)")
    parser.add_argument(
        "--merge-from", nargs="+", metavar="FILE", help="measure nothing: merge these result files into --output"
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--trials", type=int, default=3, help="timed runs of each batch-1 TPOT measurement")
    parser.add_argument("--warmup-runs", type=int, default=3, help="untimed batch-1 generations before them")
    parser.add_argument("--throughput-trials", type=int, default=1, help="timed runs per concurrency (after one)")
    parser.add_argument("--concurrency", default="1,8,32,64,128")
    parser.add_argument("--window-batches", default="1,64", help="decode windows of every asyncspec config")
    parser.add_argument("--sweep-batches", default="1,2,4,8,16,32,64", help="decode windows of `graphed`")
    parser.add_argument("--window-steps", type=int, default=32, help="steps timed (and as many profiled)")
    parser.add_argument("--hf-batch-streams", default="32,128")
    parser.add_argument("--timeout", type=float, default=360.0, help="seconds per configuration's process")
    parser.add_argument("--deadline-s", type=float, default=540.0, help="start no configuration after this")
    parser.add_argument("--note", default="", help="free text stored with the run (e.g. the commit)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny settings: checks the logic and schema")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "PART"), help=argparse.SUPPRESS)
    parser.add_argument("--settings-json", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.one:
        s = json.loads(args.settings_json)
        model = None if args.one[0] == "-" else args.one[0]
        print("RESULT " + json.dumps(run_one(model, args.one[1], s)), flush=True)
        return 0

    start = time.perf_counter()
    s = settings_from_args(args)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if args.smoke and args.models == parser.get_default("models"):
        models = ["bundled"]
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"unknown model {m!r}; models: {', '.join(MODELS)}")
    parts = expand_parts(args.parts)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    if args.merge_from:
        merged = json.loads(Path(args.merge_from[0]).read_text())
        try:
            for path in args.merge_from[1:]:
                merged = merge_results(merged, json.loads(Path(path).read_text()))
            if args.merge and output.exists():
                merged = merge_results(json.loads(output.read_text()), merged)
        except ValueError as e:
            raise SystemExit(f"--merge-from: {e}") from None
        _write(merged, output)
        print_tables(merged)
        print(f"\nwrote {output}: {len(merged['runs'])} runs, models {', '.join(merged['models'])}")
        return 0
    card = detect_card(s["device"])
    results = new_results(card)
    if args.merge and output.exists():
        old = json.loads(output.read_text())
        if old.get("schema") != SCHEMA or old.get("card") != card:
            output = output.with_name(f"{output.stem}.{datetime.now(timezone.utc):%Y%m%dT%H%M%S}{output.suffix}")
            print(
                f"--merge: {args.output} holds {old.get('card')!r} (schema {old.get('schema')!r}), this card is "
                f"{card!r}: writing to {output} instead",
                file=sys.stderr,
            )
        else:
            results = old
    versions = {
        "python": platform.python_version(),
        "torch": _version("torch"),
        "triton": _version("triton"),
        "transformers": _version("transformers"),
    }
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    command = " ".join(["python3", *sys.argv])
    run_info: dict[str, Any] = {
        "date": date,
        "command": command,
        "git_commit": _git_commit(),
        "note": args.note,
        "versions": versions,
        "models": models,
        "parts": parts,
        "settings": s,
        "skipped": [],
    }
    results["runs"].append(run_info)
    results.update(date=date, command=command, versions=versions, settings=s)

    jobs: list[tuple[str | None, str]] = [(None, "bandwidth")] if "bandwidth" in parts else []
    for m in models:
        for part in parts:
            if part == "bandwidth" or not applies(m, part):
                continue
            if part == "hf-batch":
                jobs += [(m, f"hf-batch-{st}") for st in s["hf_batch_streams"]]
            else:
                jobs.append((m, part))
    for m in models:
        entry = model_entry(m, s)
        if m in results["models"]:
            entry["rows"] = results["models"][m]["rows"]
        results["models"][m] = entry

    for m, part in jobs:
        left = args.deadline_s - (time.perf_counter() - start)
        label = f"{m or '-'}/{part}"
        if left < 20:
            run_info["skipped"].append(label)
            print(f"skipped {label}: deadline", flush=True)
            continue
        row = run_child(m, part, s, min(args.timeout, left))
        row = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **row}
        if m is None:
            results["bandwidth"]["runs"].append(row)
        else:
            results["models"][m]["rows"][part] = row
        brief = row.get("error", "")[-300:] or ", ".join(
            f"{k}={row[k]:.4g}" for k in ("GB_s", "startup_s", "tpot_ms") if isinstance(row.get(k), (int, float))
        )
        print(f"[{time.perf_counter() - start:6.0f} s] {label}: {row['process_wall_s']} s {brief}", flush=True)
        run_info["wall_s"] = round(time.perf_counter() - start, 1)
        _write(results, output)
    run_info["wall_s"] = round(time.perf_counter() - start, 1)
    _write(results, output)
    print_tables(results)
    if run_info["skipped"]:
        redo = {x.split("/")[1] for x in run_info["skipped"]}
        redo = {"hf-batch" if x.startswith("hf-batch-") else x for x in redo}
        print(f"\nskipped at the deadline: {', '.join(run_info['skipped'])}")
        skipped_models = sorted({x.split("/")[0] for x in run_info["skipped"]} - {"-"})
        redo_parts = ",".join(p for p in PART_ORDER if p in redo)
        print(f"rerun them with: --models {','.join(skipped_models)} --parts {redo_parts} (then --merge-from)")
    print(f"\nwrote {output} ({run_info['wall_s']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
