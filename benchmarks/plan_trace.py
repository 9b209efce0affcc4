"""Where one closed batch's time goes, plan by plan: the bundled target with and without its draft, `--streams`
requests of 128 new tokens submitted together (the throughput run of `gpu_step_speed.py`, same engine settings).
Each plan's period (from its scheduling to the next plan's) is charged to its kind: a plan that admits or
prefills, or a decode plan by (k verified -> drafts proposed, steps, batch size).

    python3 benchmarks/plan_trace.py --streams 32,128 --output $OUT/plan_trace.json   # GPU, ~1 min
    python3 benchmarks/plan_trace.py --smoke                                            # CPU: the script only

`--policy` also records, at every choice of the speculation policy, the batch size, the k chosen, whether it
was a probe, and the policy's estimate per k: tokens a run, host and device microseconds a step. `--fixed-k 1,2`
adds a draft engine per k that verifies that k at every step (the policy off, so its prompt plans propose drafts
too). On the H200, 2026-12-01, such engines lost end to end at 128 streams, but their decode phase at k = 2 was
the fastest (docs/benchmarks.md, twelfth session).

`--host-profile prefill` runs cProfile during the prompt plans only (from just after a prompt plan's scheduling to
the next plan's scheduling) and prints, per engine, the functions with the most own time a prompt plan: what the
draft adds to the host's work where the GPU idles (2026-12-07: 6.5 against 4.9 ms a prompt plan, the GPU busy under
1 ms). cProfile slows Python about twice over: read the shares and the difference between the engines. It is enabled
in the middle of the loop's stack, so cumulative times can mislead (session 51's 2.4 ms for the draft's pass over the
target's inputs measured 50 µs unprofiled): `sustained_host_phases.py --streams 32 --factor 1` times the same closed
batch's phases per plan kind without a profiler.

`--sustained N` sends N times `--streams` requests a trial and holds that many in flight, a new one submitted as
one finishes (`vllm bench serve --max-concurrency`): a closed batch's time is also its drain, the requests that
accept least decoding alone after the others finished, which a served engine under a steady load does not have.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import gc
import json
import pstats
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: asyncspec without an install
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_step_speed import DRAFT, TARGET, load_prompts  # noqa: E402

ENGINE_SETTINGS: dict[str, Any] = dict(
    device="cuda",
    dtype="bfloat16",
    max_model_len=2048,
    max_num_seqs=128,
    max_num_batched_tokens=4096,
    enable_prefix_caching=False,
    gpu_memory_utilization=0.4,
    skip_tokenizer_init=True,
    async_scheduling=True,
)
"""The closed batch's engine (the throughput run of `gpu_step_speed.py`); benchmarks/gpu_idle.py profiles the same."""
DRAFT_SETTINGS: dict[str, Any] = dict(
    speculative_method="draft_model", num_speculative_tokens=4, draft_model=str(DRAFT)
)
"""The speculating engine's additions: the bundled draft, k = 4 (the policy adapts it)."""


def plan_kind(record: tuple[int, int, int, int, int, int], streams: int) -> str:
    num_reqs, k, proposed, steps, tokens, new = record
    if new or tokens > num_reqs * (k + 1):
        return "prefill"
    size = "full" if num_reqs == streams else ("half+" if 2 * num_reqs >= streams else "tail")
    return f"k{k}->{proposed} x{steps} {size}"


def policy_estimates(policy: Any, num_decodes: int, batch: Any = None) -> dict[str, list[float]] | None:
    """Per k: [tokens a run, host µs a step, device µs a step], as the policy prices k for this batch (`batch`:
    its requests' own acceptance, `SpeculationPolicy.batch_tokens`)."""
    if policy.step_cost is None:
        return None
    return {
        str(k): [
            round(policy.tokens_per_run(k, None, batch), 3),
            round(policy.host_seconds(k) * 1e6, 1),
            round(policy.step_cost(num_decodes, k) * 1e6, 1),
        ]
        for k in policy.choices
    }


def generate_held(llm: Any, prompts: list[list[int]], params: Any, concurrency: int) -> list[Any]:
    """`llm.generate(prompts, params)` with at most `concurrency` requests in flight: the first `concurrency`
    submitted at once, then one more as each finishes. Returns the finished outputs in prompt order. Each request is
    made when it is submitted: its arrival (the start of its queue time) is then."""
    engine = llm.engine
    results: list[Any] = [None] * len(prompts)
    submitted: list[str] = []

    def submit() -> None:
        request = engine.make_request(prompts[len(submitted)], params, f"held-{len(submitted)}")
        engine.add_request(request, stream_deltas=False, enforce_queue_limit=False)
        submitted.append(request.request_id)

    try:
        while len(submitted) < min(concurrency, len(prompts)):
            submit()
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    results[int(output.request_id.removeprefix("held-"))] = output
                    if len(submitted) < len(prompts):
                        submit()
    finally:
        # As LLM.generate: a trial cut short leaves none of its requests running into the next one.
        unfinished = [rid for rid, out in zip(submitted, results, strict=False) if out is None]
        if unfinished:
            engine.abort_requests(unfinished)
    return results


def queue_percentiles(queued_seconds: list[float | None]) -> list[float] | None:
    """[p50, p90, max] of the requests' queue times in ms (None when the engine reported none)."""
    times = sorted(q * 1e3 for q in queued_seconds if q is not None)
    if not times:
        return None
    return [round(times[int(f * (len(times) - 1))], 3) for f in (0.5, 0.9, 1.0)]


@contextlib.contextmanager
def gc_pauses() -> Any:
    """Records the garbage collector's pauses while open: yields a dict generation -> [collections, ms, longest ms]."""
    pauses: dict[int, list[float]] = {}
    started: list[float] = []

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            ms = (time.perf_counter() - started.pop()) * 1e3
            entry = pauses.setdefault(info["generation"], [0, 0.0, 0.0])
            entry[0] += 1
            entry[1] += ms
            entry[2] = max(entry[2], ms)

    gc.callbacks.append(callback)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(callback)


def trace(
    llm: Any,
    prompts: list[list[int]],
    params: Any,
    record_policy: bool = False,
    sequence: bool = False,
    concurrency: int | None = None,
    profiler: cProfile.Profile | None = None,
    profiled_kind: str = "prefill",
) -> dict[str, Any]:
    """Runs one generate, recording every plan (and with record_policy every choice of the speculation policy);
    returns the wall time, the time per plan kind, the tokens generated and the choices. `concurrency`: at most
    that many requests in flight (`generate_held`); None: all submitted at once. `profiler`: enabled from each
    plan of `profiled_kind`'s scheduling to the next plan's."""
    scheduler = llm.engine.engine_core.scheduler
    schedule = scheduler.schedule
    policy = scheduler.spec_policy
    choose = policy.choose
    choices: list[dict[str, Any]] = []

    def choosing(num_decodes: int, accepted: Any = None, rejected: Any = None) -> int:
        batch = policy.batch_tokens(accepted, rejected) if accepted is not None else None
        estimates = policy_estimates(policy, num_decodes, batch)
        k = choose(num_decodes, accepted, rejected)
        choices.append({"decodes": num_decodes, "k": k, "probe": policy._probe is not None, "estimates": estimates})
        return k

    records: list[tuple[float, tuple[int, int, int, int, int, int]]] = []
    streams = concurrency or len(prompts)
    profiler_on = [False]

    def recording():
        t = time.perf_counter()
        so = schedule()
        record = (
            len(so.num_scheduled_tokens),
            so.num_speculative_tokens,
            so.num_proposals,
            so.num_steps,
            so.total_num_scheduled_tokens,
            len(so.scheduled_new_reqs),
        )
        records.append((t, record))
        if profiler is not None:
            # Python 3.12's cProfile refuses to enable a profiler twice: consecutive plans of the kind keep it on.
            profiling = plan_kind(record, streams) == profiled_kind
            if profiling and not profiler_on[0]:
                profiler.enable()
            elif not profiling and profiler_on[0]:
                profiler.disable()
            profiler_on[0] = profiling
        return so

    scheduler.schedule = recording
    if record_policy:
        policy.choose = choosing
    try:
        with gc_pauses() as pauses:
            start = time.perf_counter()
            if concurrency is None:
                outputs = llm.generate(prompts, params)
            else:
                outputs = generate_held(llm, prompts, params, concurrency)
            end = time.perf_counter()
    finally:
        if profiler is not None and profiler_on[0]:
            profiler.disable()
        scheduler.schedule = schedule
        policy.choose = choose
    kinds: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"plans": 0, "steps": 0, "ms": 0.0})
    for i, (t, record) in enumerate(records):
        period = (records[i + 1][0] if i + 1 < len(records) else end) - t
        entry = kinds[plan_kind(record, streams)]
        entry["plans"] += 1
        entry["steps"] += record[3]
        entry["ms"] += period * 1e3
    result = {
        "wall_ms": (end - start) * 1e3,
        "plans": len(records),
        "kinds": dict(kinds),
        # A request that failed ends early, so its trial would look fast: callers compare this across engines.
        "generated_tokens": sum(len(o.token_ids) for o in outputs),
        "failed_requests": sum(o.finish_reason == "error" for o in outputs),
        # Arrival (submission) to first scheduling, ms: p50, p90, max (what admission waves cost a request).
        "queued_ms": queue_percentiles([o.queued_seconds for o in outputs]),
        # The garbage collector's pauses during the trial, by generation: [collections, ms, longest ms].
        "gc_pauses": {str(g): [int(n), round(ms, 3), round(top, 3)] for g, (n, ms, top) in sorted(pauses.items())},
    }
    if record_policy:
        result["choices"] = choices
    if sequence:
        # Per plan: start and period (ms from the generate's start), then the plan's record.
        result["sequence"] = [
            [round((t - start) * 1e3, 3), round(((records[i + 1][0] if i + 1 < len(records) else end) - t) * 1e3, 3)]
            + list(record)
            for i, (t, record) in enumerate(records)
        ]
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="32,128")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny settings: checks the script")
    ap.add_argument("--policy", action="store_true", help="record the speculation policy's estimates at every choice")
    ap.add_argument(
        "--sequence",
        action="store_true",
        help="keep every plan (start, period, requests, k, proposed, steps, tokens, new) and print the last ones",
    )
    ap.add_argument(
        "--fixed-k",
        default="",
        help="comma-separated k: also a draft engine per k that always verifies k (adaptive_speculation=False)",
    )
    ap.add_argument(
        "--with-prompts",
        action="store_true",
        help="also a draft engine whose plans that compute prompt chunks verify drafts (speculate_with_prompts)",
    )
    ap.add_argument(
        "--sustained",
        type=int,
        default=0,
        help="N > 0: N x streams requests a trial, that many streams held in flight (a new one as one ends)",
    )
    ap.add_argument(
        "--max-num-seqs",
        type=int,
        default=ENGINE_SETTINGS["max_num_seqs"],
        help="the engines' max_num_seqs (at least the largest --streams)",
    )
    ap.add_argument(
        "--host-profile",
        default="",
        metavar="KIND",
        help="cProfile the plans of this kind (prefill, or a decode kind as printed) and print the top own times",
    )
    ap.add_argument("--top", type=int, default=25, help="functions printed per engine with --host-profile")
    ap.add_argument(
        "--no-freeze-gc",
        action="store_true",
        help="engines with freeze_gc=False: Python's full collections scan start-up's objects again (the A/B of "
        "the default; each side in a process of its own, since one freezing engine freezes the whole process)",
    )
    ap.add_argument("--note", default="")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    import asyncspec

    streams = [int(s) for s in args.streams.split(",")]
    if args.sustained < 0:
        ap.error(f"--sustained takes a number of requests per stream (0: a closed batch), got {args.sustained}")
    if args.smoke:
        streams, args.trials, args.new_tokens = [4], 1, 6
    if args.max_num_seqs < max(streams):
        ap.error(f"--max-num-seqs {args.max_num_seqs} is below the largest --streams, {max(streams)}")
    base: dict[str, Any] = dict(ENGINE_SETTINGS, max_num_seqs=args.max_num_seqs, freeze_gc=not args.no_freeze_gc)
    if args.smoke:
        max_num_seqs = 8 if args.max_num_seqs == ENGINE_SETTINGS["max_num_seqs"] else args.max_num_seqs
        base.update(device="cpu", dtype="float32", max_num_seqs=max_num_seqs, num_kv_blocks=256, max_model_len=512)
        base.pop("gpu_memory_utilization")
    draft = DRAFT_SETTINGS
    results: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "note": args.note,
        "sustained": args.sustained,
        "configs": {},
    }
    configs: list[tuple[str, dict[str, Any]]] = [("plain", {}), ("draft", draft)]
    fixed_ks = [int(x) for x in args.fixed_k.split(",") if x]
    if any(k < 1 for k in fixed_ks):
        ap.error(f"--fixed-k takes draft counts of at least 1 (the plain engine is k = 0), got {args.fixed_k}")
    for k in fixed_ks:
        configs.append((f"draft_k{k}", {**draft, "num_speculative_tokens": k, "adaptive_speculation": False}))
    if args.with_prompts:
        configs.append(("draft_with_prompts", {**draft, "speculate_with_prompts": True}))
    if len(configs) > 2 and "gpu_memory_utilization" in base:
        base["gpu_memory_utilization"] = 0.8 / len(configs)  # the engines share the GPU
    # The engines live side by side and their trials alternate, so that a drift of the host's speed falls on
    # all alike.
    llms = {name: asyncspec.LLM(str(TARGET), **base, **extra) for name, extra in configs}
    rows: dict[str, dict[str, Any]] = {name: {} for name in llms}
    profilers = {name: cProfile.Profile() for name in llms} if args.host_profile else {}
    for c in streams:
        prompts = load_prompts(c * max(args.sustained, 1))
        concurrency = c if args.sustained else None
        if args.smoke:
            prompts = [p[:32] for p in prompts]
        warm = asyncspec.SamplingParams(temperature=0.0, max_tokens=min(16, args.new_tokens), ignore_eos=True)
        full = asyncspec.SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
        for llm in llms.values():
            llm.generate(prompts[:c], warm)  # untimed: this batch's shapes compiled
        for name in llms:
            rows[name][str(c)] = []
        for _ in range(args.trials):
            for name, llm in llms.items():
                rows[name][str(c)].append(
                    trace(
                        llm,
                        prompts,
                        full,
                        args.policy and name == "draft",
                        args.sequence,
                        concurrency,
                        profilers.get(name),
                        args.host_profile,
                    )
                )
    for name, llm in llms.items():
        stats = llm.stats()
        results["configs"][name] = {
            "streams": rows[name],
            "steps_per_k": {k: v for k, v in stats.items() if k.startswith("spec_steps_with_k_")},
        }
    del llms
    gc.collect()
    for name, profiler in profilers.items():
        num_plans = sum(
            r["kinds"].get(args.host_profile, {}).get("plans", 0) for trials in rows[name].values() for r in trials
        )
        results["configs"][name]["host_profile"] = own_times(profiler, max(num_plans, 1), args.top)
        results["configs"][name]["host_profile_plans"] = num_plans
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=1))
    for name, config in results["configs"].items():
        for c, trials in config["streams"].items():
            best = min(trials, key=lambda r: r["wall_ms"])
            print(f"{name} @{c}: {[round(r['wall_ms'], 1) for r in trials]} ms, fastest {best['plans']} plans")
            print(f"   queued ms [p50, p90, max] by trial: {[r['queued_ms'] for r in trials]}")
            print(
                f"   gc pauses by trial (generation: [collections, ms, longest ms]): {[r['gc_pauses'] for r in trials]}"
            )
            for kind, e in sorted(best["kinds"].items(), key=lambda x: -x[1]["ms"]):
                print(f"   {kind:22s} plans {e['plans']:4d} steps {e['steps']:4d} {e['ms']:8.2f} ms")
            if best.get("sequence"):
                print("   last plans [start ms, period ms, requests, k, proposed, steps, tokens, new]:")
                for plan in best["sequence"][-24:]:
                    print(f"     {plan}")
            if best.get("choices"):
                last = best["choices"][-1]
                print(f"   last choice: {last['decodes']} decodes, k {last['k']}; per k [tokens, host us, device us]:")
                print(f"   {last['estimates']}")
    for name, config in results["configs"].items():
        if "host_profile" not in config:
            continue
        rows_ = config["host_profile"]
        total = sum(r["own_us"] for r in rows_["all"])
        print(
            f"{name}: host profile of {config['host_profile_plans']} {args.host_profile} plans, "
            f"{total / 1e3:.2f} ms own time a plan (profiled); own us, calls, cumulative us a plan:"
        )
        for r in rows_["top"]:
            print(f"   {r['own_us']:8.1f} {r['calls']:8.1f} {r['cumulative_us']:9.1f}  {r['function'][:100]}")
        print(f"{name}: by cumulative time a plan, with the callees' shares (us):")
        for r in rows_["top_cumulative"][:16]:
            print(f"   {r['cumulative_us']:9.1f}  {r['function'][:80]}")
            for callee, us in list(r["callees_us"].items())[:5]:
                print(f"   {'':9s}    {us:9.1f}  {callee[:80]}")
    return 0


def own_times(profiler: cProfile.Profile, num_plans: int, top: int) -> dict[str, Any]:
    """A profile's functions a plan: own µs, calls and cumulative µs; `top` by own time, `top` by cumulative time
    with each one's callees (cumulative µs a plan spent in each, largest first: where a slow call's time went), and
    every function's own time (under "all", for the total)."""
    stats = pstats.Stats(profiler)

    def name(key: tuple[str, int, str]) -> str:
        file, line, func = key
        return f"{Path(file).name}:{line}({func})"

    entries = stats.stats.items()  # type: ignore[attr-defined]
    rows = [
        {
            "function": name(key),
            "own_us": tt / num_plans * 1e6,
            "calls": nc / num_plans,
            "cumulative_us": ct / num_plans * 1e6,
        }
        for key, (_cc, nc, tt, ct, _callers) in entries
    ]
    # Callees from the callers' tables: callers[caller] = (calls, primitive calls, own s, cumulative s) of the callee.
    callees: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for key, (_cc, _nc, _tt, _ct, callers) in entries:
        for caller, timing in callers.items():
            callees[name(caller)][name(key)] = timing[3] / num_plans * 1e6
    rows.sort(key=lambda r: -r["own_us"])
    by_cumulative = sorted(rows, key=lambda r: -r["cumulative_us"])[:top]
    for row in by_cumulative:
        ranked = sorted(callees.get(row["function"], {}).items(), key=lambda kv: -kv[1])[:8]
        row["callees_us"] = {callee: round(us, 1) for callee, us in ranked}
    return {"top": rows[:top], "top_cumulative": by_cumulative, "all": [{"own_us": r["own_us"]} for r in rows]}


if __name__ == "__main__":
    raise SystemExit(main())
