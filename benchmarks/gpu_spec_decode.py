"""Speculative decoding baseline (before CUDA graphs): batch-1 TPOT, 32-stream throughput and acceptance
length of asyncspec with and without speculation, next to Hugging Face transformers rerun in the same call.

    python benchmarks/gpu_spec_decode.py --output benchmarks/results/gpu_spec_decode.json
    python benchmarks/gpu_spec_decode.py --smoke --output /tmp/spec_smoke.json   # CPU, tiny: checks the logic

Model pair: the bundled stdlib-coder-target (15.7M) with stdlib-coder-draft (3.7M). Every configuration runs
in a fresh process (so no engine's memory, caches or compiled code affect the next), greedy, EOS ignored:
- asyncspec without speculation; draft_model with k = 2, 4, 6; ngram with k = 4 (prompt_lookup 2..5).
- transformers `generate` with a static cache (compiled decoding), batch 1.
- transformers assisted generation (`assistant_model=` the same draft, 4 tokens per round, constant
  schedule, confidence threshold 0 so that it always proposes 4), batch 1: assisted generation is batch-1
  only, with the dynamic cache, not compiled.

Batch-1 TPOT is (time of an N-token generation - time of a 1-token generation) / (N - 1), each the median
of 3 after one untimed call of each. Throughput is the first 32 benchmark prompts submitted at once, N new
tokens each, after one untimed run of the same shape. Acceptance length is tokens emitted per target
verification step (1 + accepted drafts per draft), from asyncspec's counters (`llm.stats()`), and for
assisted generation from counted forward calls of the target (tokens generated / target forwards).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asyncspec import LLM, SamplingParams  # noqa: E402

TARGET = str(REPO / "models" / "stdlib-coder-target")
DRAFT = str(REPO / "models" / "stdlib-coder-draft")

# name -> LLM keyword arguments (asyncspec) or None (transformers, handled by name).
CONFIGS: dict[str, dict | None] = {
    "asyncspec": {},
    "asyncspec-draft-k2": {"speculative_method": "draft_model", "num_speculative_tokens": 2},
    "asyncspec-draft-k4": {"speculative_method": "draft_model", "num_speculative_tokens": 4},
    "asyncspec-draft-k6": {"speculative_method": "draft_model", "num_speculative_tokens": 6},
    "asyncspec-ngram-k4": {"speculative_method": "ngram", "num_speculative_tokens": 4},
    "hf-static": None,
    "hf-assisted-k4": None,
}
SPEC_COUNTERS = ("num_steps", "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")


def load_prompts(n: int) -> list[list[int]]:
    with open(REPO / "benchmarks" / "data" / "prompts-code.jsonl") as f:
        return [json.loads(line)["prompt_token_ids"] for _, line in zip(range(n), f, strict=False)]


def _sync_time() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def _median_time(fn, trials: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(trials):
        t0 = _sync_time()
        fn()
        times.append(_sync_time() - t0)
    return sorted(times)[len(times) // 2], times


def _tpot_ms(run_prefill_only, run_full, new_tokens: int, trials: int) -> dict:
    """(full - prefill-only) / (new_tokens - 1), each a median of `trials` after one untimed call of each."""
    run_prefill_only()
    run_full()
    full, full_all = _median_time(run_full, trials)
    prefill, prefill_all = _median_time(run_prefill_only, trials)
    return {
        "tpot_ms_batch1": (full - prefill) / (new_tokens - 1) * 1e3,
        "batch1_full_s": full_all,
        "batch1_prefill_only_s": prefill_all,
    }


def _digest(tokens) -> str:
    return hashlib.sha1(json.dumps(list(tokens)).encode()).hexdigest()[:10]


def _acceptance(before: dict, after: dict) -> dict:
    """Counters between two llm.stats() snapshots: steps, drafts, and 1 + accepted / drafts."""
    d = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    d["mean_acceptance_length"] = (
        1.0 + d["spec_num_accepted_tokens"] / d["spec_num_drafts"] if d["spec_num_drafts"] else None
    )
    return d


def bench_asyncspec(spec_kwargs: dict, prompts: list[list[int]], args) -> dict:
    llm = LLM(
        TARGET,
        device=args.device,
        max_model_len=2048,
        max_num_seqs=max(args.streams, 1),
        max_num_batched_tokens=4096,
        enable_prefix_caching=False,
        gpu_memory_utilization=0.5,
        **spec_kwargs,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    s0 = llm.stats()
    tpot = _tpot_ms(
        lambda: llm.generate([prompts[0]], one),
        lambda: llm.generate([prompts[0]], greedy),
        args.new_tokens,
        args.trials,
    )
    s1 = llm.stats()
    b1 = llm.generate([prompts[0]], greedy)[0]  # one more, alone, for its step and acceptance counters
    s2 = llm.stats()

    llm.generate(prompts[: args.streams], greedy)  # warm-up at this batch shape
    s3 = llm.stats()
    outs: list = []
    elapsed, runs = _median_time(lambda: outs.append(llm.generate(prompts[: args.streams], greedy)), args.trials)
    s4 = llm.stats()
    generated = sum(len(o.token_ids) for o in outs[-1])
    assert all(len(o.token_ids) == args.new_tokens for o in outs[-1]), [len(o.token_ids) for o in outs[-1]]
    streams = _acceptance(s3, s4)
    final = llm.stats()
    return {
        **tpot,
        "throughput_tok_s": generated / elapsed,
        "throughput_runs_s": runs,
        "generated": generated,
        "streams_ms_per_step": sum(runs) / streams["num_steps"] * 1e3,
        # The brief's figure: llm.stats()["spec_mean_acceptance_length"], cumulative over every call above.
        "spec_mean_acceptance_length": final["spec_mean_acceptance_length"],
        "batch1_one_generation": _acceptance(s1, s2),
        "batch1_all_tpot_calls": _acceptance(s0, s1),
        "streams_timed_runs": streams,
        "spec_stats_final": {k: v for k, v in final.items() if k.startswith("spec_")},
        "num_preemptions": final["num_preemptions"],
        "batch1_tokens": list(b1.token_ids),
        "streams_digests": [_digest(o.token_ids) for o in outs[-1]],
    }


def _hf_models(assisted: bool, device: str):
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=dtype).to(device).eval()
    target.generation_config.eos_token_id = None  # EOS ignored, as in the asyncspec runs
    draft = None
    if assisted:
        draft = AutoModelForCausalLM.from_pretrained(DRAFT, dtype=dtype).to(device).eval()
        draft.generation_config.eos_token_id = None
        # Assisted generation reads these from the assistant's generation_config.
        draft.generation_config.num_assistant_tokens = 4
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0
    return target, draft


def bench_hf(assisted: bool, prompts: list[list[int]], args) -> dict:
    target, draft = _hf_models(assisted, args.device)

    def gen(prompt: list[int], n: int):
        ids = torch.tensor([prompt], device=args.device)
        kwargs = {"assistant_model": draft} if assisted else {"cache_implementation": "static"}
        with torch.inference_mode():
            return target.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                **kwargs,
            )

    gen(prompts[0], args.new_tokens)  # compilation (static cache) / first-call set-up
    result = {
        **_tpot_ms(lambda: gen(prompts[0], 1), lambda: gen(prompts[0], args.new_tokens), args.new_tokens, args.trials),
        "throughput_tok_s": None,
    }

    # One more untimed generation with forward counters (hooks stay out of the timed calls).
    calls = {"target": 0, "draft": 0}
    hooks = [target.register_forward_hook(lambda *_: calls.__setitem__("target", calls["target"] + 1))]
    if draft is not None:
        hooks.append(draft.register_forward_hook(lambda *_: calls.__setitem__("draft", calls["draft"] + 1)))
    out = gen(prompts[0], args.new_tokens)
    for h in hooks:
        h.remove()
    generated = out.shape[1] - len(prompts[0])
    assert generated == args.new_tokens, generated
    result["target_forwards_per_generation"] = calls["target"]
    result["batch1_tokens"] = out[0, len(prompts[0]) :].tolist()
    if assisted:
        # The first target forward verifies the prompt and the first drafts together, so every target
        # forward emits 1 + accepted tokens: generated / forwards is the mean acceptance length.
        result["draft_forwards_per_generation"] = calls["draft"]
        result["mean_acceptance_length"] = generated / calls["target"]
        result["draft_forwards_per_target_forward"] = calls["draft"] / calls["target"]
    return result


def run_one(name: str, args) -> dict:
    prompts = load_prompts(max(args.streams, 1))
    spec = CONFIGS[name]
    if spec is not None:
        return bench_asyncspec(spec, prompts, args)
    return bench_hf(name == "hf-assisted-k4", prompts, args)


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(results: dict) -> None:
    rows = {r["config"]: r for r in results["rows"]}
    ref = rows.get("asyncspec", {})
    base, base_tp = ref.get("tpot_ms_batch1"), ref.get("throughput_tok_s")
    hf = rows.get("hf-static", {}).get("tpot_ms_batch1")
    print(f"\n{results['card']}  {results['date']}  new_tokens={results['new_tokens']}  streams={results['streams']}")
    head = ("config", "TPOT b=1 ms", "x no-spec", "x HF static", f"tok/s @{results['streams']}", "x no-spec")
    head += ("ms/step", "accept len", "b=1 = no-spec", "streams =")
    widths = (20, 12, 11, 13, 12, 11, 9, 12, 15, 11)
    print("".join(f"{h:<{w}}" if i == 0 else f"{h:>{w}}" for i, (h, w) in enumerate(zip(head, widths, strict=True))))
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:<20}  error: {r['error'][-300:]}")
            continue
        t, tp = r["tpot_ms_batch1"], r["throughput_tok_s"]
        acc = r.get("spec_mean_acceptance_length", r.get("mean_acceptance_length"))
        same_b1 = None if "batch1_tokens" not in ref else str(r.get("batch1_tokens") == ref["batch1_tokens"])
        same_streams = None
        if "streams_digests" in r and "streams_digests" in ref:
            same = sum(x == y for x, y in zip(r["streams_digests"], ref["streams_digests"], strict=True))
            same_streams = f"{same}/{len(ref['streams_digests'])}"
        cells = (
            name,
            f"{t:.2f}",
            _fmt(base / t if base else None, ".2f"),
            _fmt(hf / t if hf else None, ".2f"),
            _fmt(tp, ".0f"),
            _fmt(tp / base_tp if tp and base_tp else None, ".2f"),
            _fmt(r.get("streams_ms_per_step"), ".1f"),
            _fmt(acc or None, ".2f"),
            same_b1 or "-",
            same_streams or "-",
        )
        print(
            "".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
        )
    print("x no-spec / x HF static: speed-up (higher is faster) against asyncspec without speculation / HF static.")
    print("b=1 = no-spec / streams =: greedy tokens identical to the asyncspec run without speculation.")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "gpu_spec_decode.json"))
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--timeout", type=float, default=200.0, help="seconds per configuration's process")
    parser.add_argument("--note", default="", help="free text stored in the JSON (e.g. the commit)")
    parser.add_argument("--smoke", action="store_true", help="CPU, 8 tokens, 4 streams, 1 trial: logic check")
    parser.add_argument("--one", metavar="CONFIG", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.device, args.new_tokens, args.streams, args.trials = "cpu", 8, 4, 1
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args)), flush=True)
        return 0

    import transformers

    results = {
        "card": torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({platform.processor() or 'unknown'})",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "command": " ".join(["python"] + sys.argv),
        "note": args.note,
        "new_tokens": args.new_tokens,
        "streams": args.streams,
        "trials": args.trials,
        "rows": [],
    }
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        pass
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    for name in args.configs.split(","):
        cmd = [sys.executable, __file__, "--one", name, "--device", args.device, "--new-tokens", str(args.new_tokens)]
        cmd += ["--streams", str(args.streams), "--trials", str(args.trials)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            row = json.loads(lines[-1][7:]) if lines else {"error": proc.stderr[-2000:]}
        except subprocess.TimeoutExpired as e:
            row = {"error": f"timed out after {args.timeout:.0f} s; stderr: {str(e.stderr or '')[-1000:]}"}
        row = {"config": name, "process_wall_s": round(time.perf_counter() - t0, 1), **row}
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
        with open(args.output, "w") as f:  # after every configuration: a cut-off run keeps what it measured
            json.dump(results, f, indent=1)
    print_table(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
