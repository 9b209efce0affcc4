"""One decode step of a given code tree, batch 1: wall ms per generated token, CUDA kernels and GPU time per step.

    cd /tmp && python /path/to/benchmarks/step_ab.py TREE MODEL_DIR   # TREE: a checkout of the code to measure

Run from outside the tree so that TREE's asyncspec is the one imported; for an A/B, run it on two trees
alternately in one device call. Models: MODEL_DIR (the bundled target) and a Llama-3.2-1B shape with
dummy weights. Prints one JSON line.
"""

from __future__ import annotations

import importlib
import json
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    root = Path(sys.argv[1]).resolve()
    sys.path[:0] = [str(root), str(root / "benchmarks")]
    torch = importlib.import_module("torch")
    profiler = importlib.import_module("torch.profiler")
    asyncspec = importlib.import_module("asyncspec")
    llama_1b = importlib.import_module("gpu_engine_vs_hf").LLAMA_1B
    if str(root) not in asyncspec.__file__:
        raise SystemExit(f"imported {asyncspec.__file__}, not the tree {root}")
    tmp = tempfile.mkdtemp()
    (Path(tmp) / "config.json").write_text(json.dumps(llama_1b))

    def params(n: int):
        return asyncspec.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    results = {}
    for name, model in (("bundled", str(Path(sys.argv[2]).resolve())), ("llama1b", tmp)):
        extra = dict(load_format="dummy", skip_tokenizer_init=True) if name == "llama1b" else {}
        llm = asyncspec.LLM(
            model,
            device="cuda",
            max_model_len=1024,
            max_num_seqs=8,
            enable_prefix_caching=False,
            gpu_memory_utilization=0.4,
            **extra,
        )
        prompt = list(range(10, 138))
        llm.generate([prompt], params(65))
        llm.generate([prompt], params(1))
        tpot = []
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate([prompt], params(65))
            torch.cuda.synchronize()
            full = time.perf_counter() - start
            start = time.perf_counter()
            llm.generate([prompt], params(1))
            torch.cuda.synchronize()
            tpot.append((full - (time.perf_counter() - start)) / 64 * 1000)
        with profiler.profile(activities=[profiler.ProfilerActivity.CUDA]) as prof:
            llm.generate([prompt], params(17))
        events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        results[name] = dict(
            tpot_ms=sorted(tpot)[1],
            cuda_kernels_per_step=sum(e.count for e in events) / 17,
            gpu_ms_per_step=sum(e.self_device_time_total for e in events) / 17 / 1000,
        )
        del llm
        torch.cuda.empty_cache()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
