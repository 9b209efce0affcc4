"""Host time of the engine's output processing per step (incremental detokenization, stop strings,
RequestOutput building) for many streams, on the CPU: the per-stream work a server does in the
process that also schedules (issue 10). No model runs: each step hands the OutputProcessor the
next tokens of every stream (text of the benchmark prompts), `--tokens-per-step` per stream as a
speculative step delivers them.

    python benchmarks/output_processing.py --streams 128 --tokens-per-step 4 --output out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asyncspec.core.scheduler_output import EngineCoreOutput  # noqa: E402
from asyncspec.engine.llm_engine import load_tokenizer  # noqa: E402
from asyncspec.engine.output_processor import OutputProcessor  # noqa: E402
from asyncspec.sampling_params import SamplingParams  # noqa: E402

PROMPTS = REPO / "benchmarks" / "data" / "prompts-code.jsonl"


def run(streams: int, tokens_per_step: int, steps: int, stop: list[str]) -> float:
    """Seconds per step, best of 5 timed passes (each with fresh request state)."""
    tokenizer = load_tokenizer(str(REPO / "models" / "stdlib-coder-target"))
    with open(PROMPTS) as f:
        texts = [json.loads(line)["prompt_token_ids"] for _, line in zip(range(streams), f, strict=False)]
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True, stop=stop)
    times = []
    for _ in range(5):
        processor = OutputProcessor(tokenizer)
        for i in range(streams):
            processor.add_request(f"r{i}", texts[i % len(texts)][:16], params, True)
        start = time.perf_counter()
        for step in range(steps):
            outputs = []
            for i in range(streams):
                ids = texts[i % len(texts)]
                at = (step * tokens_per_step) % max(len(ids) - tokens_per_step, 1)
                outputs.append(EngineCoreOutput(f"r{i}", ids[at : at + tokens_per_step]))
            processor.process_outputs(outputs)
        times.append((time.perf_counter() - start) / steps)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--tokens-per-step", default="1,4")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    rows = []
    for n in (int(x) for x in args.tokens_per_step.split(",")):
        for stop in ([], ["\n\n\n\n"]):
            seconds = run(args.streams, n, args.steps, stop)
            rows.append(
                {"streams": args.streams, "tokens_per_step": n, "stop_strings": len(stop), "ms_per_step": seconds * 1e3}
            )
            print(f"{args.streams} streams x {n} tokens, {len(stop)} stop strings: {seconds * 1e3:.3f} ms per step")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "command": " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "rows": rows,
        }
        args.output.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
