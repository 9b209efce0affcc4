"""First GPU figures: batch-1 TPOT and 32-stream throughput, asyncspec vs Hugging Face transformers,
rerun in the same process on the same card.

    python benchmarks/gpu_engine_vs_hf.py --output benchmarks/results/gpu_engine_vs_hf.json

Models: the bundled stdlib-coder-target, and a Llama-3.2-1B shape with random weights
(`load_format="dummy"` for asyncspec, random init for transformers).
Baselines: transformers `generate` with a static cache (compiled) at batch 1, and
`generate_batch` (continuous batching, CUDA graphs) at 32 streams.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asyncspec import LLM, SamplingParams  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_step_speed import LLAMA_1B  # noqa: E402  (one definition of the shape, importable without torch)


def load_prompts(n: int) -> list[list[int]]:
    with open(REPO / "benchmarks" / "data" / "prompts-code.jsonl") as f:
        return [json.loads(line)["prompt_token_ids"] for _, line in zip(range(n), f, strict=False)]


def _sync_time() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def _median_time(fn, trials: int = 3) -> float:
    times = []
    for _ in range(trials):
        t0 = _sync_time()
        fn()
        times.append(_sync_time() - t0)
    return sorted(times)[len(times) // 2]


def _tpot_ms(run_prefill_only, run_full, new_tokens: int) -> float:
    """(full - prefill-only) / (new_tokens - 1): the decode time per token, each a median of 3 after
    one untimed call of each (so no JIT compilation lands in a timed call)."""
    run_prefill_only()
    run_full()
    return (_median_time(run_full) - _median_time(run_prefill_only)) / (new_tokens - 1) * 1e3


def bench_asyncspec(model_dir: str, dummy: bool, prompts: list[list[int]], new_tokens: int, streams: int) -> dict:
    llm = LLM(
        model_dir,
        device="cuda",
        load_format="dummy" if dummy else "safetensors",
        skip_tokenizer_init=dummy,
        max_model_len=2048,
        max_num_seqs=max(streams, 1),
        max_num_batched_tokens=4096,
        enable_prefix_caching=False,
        gpu_memory_utilization=0.5,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    tpot_ms = _tpot_ms(lambda: llm.generate([prompts[0]], one), lambda: llm.generate([prompts[0]], greedy), new_tokens)
    llm.generate(prompts[:streams], greedy)  # warm-up at this batch shape
    t0 = _sync_time()
    outs = llm.generate(prompts[:streams], greedy)
    elapsed = _sync_time() - t0
    generated = sum(len(o.token_ids) for o in outs)
    return {"tpot_ms_batch1": tpot_ms, "throughput_tok_s": generated / elapsed, "generated": generated}


def bench_hf(model, prompts: list[list[int]], new_tokens: int, streams: int) -> dict:
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    def gen(prompt: list[int], n: int) -> None:
        ids = torch.tensor([prompt], device="cuda")
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            cache_implementation="static",
            pad_token_id=0,
        )

    gen(prompts[0], new_tokens)  # compilation
    tpot_ms = _tpot_ms(lambda: gen(prompts[0], 1), lambda: gen(prompts[0], new_tokens), new_tokens)

    gen_cfg = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb_cfg = ContinuousBatchingConfig(use_cuda_graph=True, max_requests_per_batch=streams)
    model.generate_batch(prompts[:streams], generation_config=gen_cfg, continuous_batching_config=cb_cfg)
    t0 = _sync_time()
    outs = model.generate_batch(prompts[:streams], generation_config=gen_cfg, continuous_batching_config=cb_cfg)
    elapsed = _sync_time() - t0
    generated = sum(len(o.generated_tokens) for o in outs.values())
    return {"tpot_ms_batch1": tpot_ms, "throughput_tok_s": generated / elapsed, "generated": generated}


def run_one(model: str, engine: str, new_tokens: int, streams: int) -> dict:
    """One engine on one model, in this process (main() gives each pair a fresh process so that
    no engine's memory or caches affect the next)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    prompts = load_prompts(streams)
    if model == "llama-1b-dummy":
        model_dir, dummy = tempfile.mkdtemp(), True
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(LLAMA_1B, f)
    else:
        model_dir, dummy = str(REPO / "models" / model), False
    if engine == "asyncspec":
        return bench_asyncspec(model_dir, dummy, prompts, new_tokens, streams)
    if dummy:
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA_1B), dtype=torch.bfloat16)
    else:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    return bench_hf(hf.cuda().eval(), prompts, new_tokens, streams)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "gpu_engine_vs_hf.json"))
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--models", default="stdlib-coder-target,llama-1b-dummy")
    parser.add_argument("--engines", default="asyncspec,transformers")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "ENGINE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(*args.one, args.new_tokens, args.streams)), flush=True)
        return 0
    results = {
        "card": torch.cuda.get_device_name(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": " ".join(sys.argv),
        "new_tokens": args.new_tokens,
        "streams": args.streams,
        "rows": [],
    }
    for model in args.models.split(","):
        row = {"model": model}
        for engine in args.engines.split(","):
            proc = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--one",
                    model,
                    engine,
                    "--new-tokens",
                    str(args.new_tokens),
                    "--streams",
                    str(args.streams),
                ],
                capture_output=True,
                text=True,
            )
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            row[engine] = json.loads(lines[-1][7:]) if lines else {"error": proc.stderr[-500:]}
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\n{results['card']}  {results['date']}")
    print(f"{'model':<22}{'engine':<14}{'TPOT b=1 (ms)':>15}{'tok/s @' + str(args.streams):>14}")
    for row in results["rows"]:
        for engine in args.engines.split(","):
            r = row[engine]
            if "error" not in r:
                print(f"{row['model']:<22}{engine:<14}{r['tpot_ms_batch1']:>15.2f}{r['throughput_tok_s']:>14.0f}")
            else:
                print(f"{row['model']:<22}{engine:<14}  error: {r['error'][-200:]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
