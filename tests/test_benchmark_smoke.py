"""benchmarks/gpu_step_speed.py on the CPU (--smoke): its code paths run, and its JSON has the schema that
benchmarks/plot_step_speed.py and docs/benchmarks.md read. The roofline arithmetic is checked against the
parameter counts of the real models."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_step_speed.py"
PLOT = REPO / "benchmarks" / "plot_step_speed.py"


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gss = _load(SCRIPT, "gpu_step_speed")


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def check_results(r: dict, expected: dict[str, list[str]]) -> None:
    """Schema and plausibility of a smoke run's JSON; `expected`: model -> the row names it must hold."""
    assert r["schema"] == gss.SCHEMA
    assert r["card"].startswith("cpu")
    for key in ("date", "command", "settings"):
        assert r[key], key
    assert set(r["versions"]) == {"python", "torch", "triton", "transformers"}
    assert r["runs"] and all({"date", "command", "settings", "parts", "models"} <= set(run) for run in r["runs"])
    s = r["settings"]
    assert s["smoke"] and s["device"] == "cpu" and s["new_tokens"] == 4
    assert _positive(r["bandwidth"]["GB_s"])
    assert all(_positive(b["GB_s"]) and _positive(b["tensor_bytes"]) for b in r["bandwidth"]["runs"])
    assert set(r["models"]) == set(expected)
    for model, names in expected.items():
        entry = r["models"][model]
        assert _positive(entry["weight_bytes_per_step"]) and _positive(entry["kv_bytes_per_token"])
        assert set(names) <= set(entry["rows"]), (model, sorted(entry["rows"]))
        summary = entry["summary"]
        assert _positive(summary["roofline_ms_batch1"])
        for name in names:
            row = entry["rows"][name]
            assert "error" not in row, (model, name, row.get("error"))
            assert _positive(row["process_wall_s"])
            if name in gss.ASYNCSPEC_CONFIGS:
                check_asyncspec_row(row, s, name)
                assert name in summary["configs"]
                assert _positive(summary["configs"][name]["wall_x_roofline_b1"])
            elif name == "startup":
                assert _positive(row["startup_s"])
                assert row["kv_capacity_tokens"] == s["smoke_kv_blocks"] * row["block_size"]
                assert _positive(row["kv_bytes_per_stream_at_benchmark_length"])
                assert row["generated_after_start"] == 8
                # The analytic bytes per step equal the engine's own parameters (float32 in the smoke run).
                assert row["weight_bytes_read_per_step_engine"] == entry["weight_bytes_per_step"]
            elif name.startswith("hf-batch-"):
                streams = int(name.rsplit("-", 1)[1])
                assert row["generated"] == streams * s["new_tokens"]
                assert _positive(row["e2e_tok_s"])
            else:  # hf-static, hf-assisted
                assert math.isfinite(row["tpot_ms"]) and all(_positive(t) for t in row["full_s"])
                if name == "hf-assisted":
                    assert row["acceptance_length"] >= 1.0


def check_asyncspec_row(row: dict, s: dict, name: str) -> None:
    assert _positive(row["startup_s"]) and _positive(row["kv_capacity_tokens"])
    assert row["engine_kwargs"]["enforce_eager"] == name.startswith("eager")
    assert math.isfinite(row["tpot"]["tpot_ms"]) and all(_positive(t) for t in row["tpot"]["full_s"])
    assert set(row["throughput"]) == {str(c) for c in s["concurrency"]}
    for c, t in row["throughput"].items():
        assert "error" not in t, t
        assert t["generated"] == int(c) * s["new_tokens"]
        assert _positive(t["e2e_tok_s"]) and _positive(t["mean_prompt_tokens"])
    batches = s["sweep_batches"] if name == "graphed" else s["window_batches"]
    assert set(row["windows"]) == {str(b) for b in batches}
    for b, w in row["windows"].items():
        assert "error" not in w, w
        assert _positive(w["wall_ms_per_step"]) and _positive(w["mean_context_tokens"])
        assert w["tokens"] >= w["steps"] * int(b)  # every running request gains at least one token per step
        assert w["finished_during_windows"] == 0
        assert w["gpu_ms_per_step"] is None and w["gpu_busy_fraction"] is None  # no CUDA activity on the CPU
        # The profiled steps ran in a second engine, after the timed ones (whose engine never saw the profiler).
        assert "traced_error" not in w and _positive(w["traced_wall_ms_per_step"])
        assert _positive(w["profiled_wall_ms_per_step"])
        assert w["gpu_busy_union_ms_per_step"] is None and w["gpu_busy_fraction_union"] is None  # no device events
        # the engine's step timing: the synchronous loop leaves the device idle between steps
        assert _positive(w["scheduling_ms_per_step"]) and _positive(w["device_idle_ms_per_step"])
        # The idle time is part of the launch gap. The gaps have no upper bound in wall time here: the window's
        # first gap starts at the launch before it, and a pause of a loaded CI host lands in one gap (51 ms
        # against 40 ms steps in one run).
        assert 0 < w["device_idle_ms_per_step"] <= w["launch_gap_ms_per_step"]
        assert 0 < w["device_idle_fraction"] < 1
    if "-" in name:  # speculation: acceptance counted
        assert row["tpot"]["acceptance_length"] is None or row["tpot"]["acceptance_length"] >= 1.0


def test_roofline_arithmetic() -> None:
    """Parameter counts as transformers counts them (bundled from its checkpoint; 1B and 8B from_config)."""
    bundled = gss.shape_of(gss.model_config("bundled"))
    assert gss.param_count(bundled) == 15_735_168
    assert gss.param_count(gss.shape_of(gss.LLAMA_1B)) == 1_235_814_400
    shape_8b = gss.shape_of(gss.LLAMA_8B)
    assert gss.param_count(shape_8b) == 8_030_261_248
    # Untied: the embedding (128256 x 4096) is not read per step, the lm_head is.
    assert gss.read_params(shape_8b) == 8_030_261_248 - 128256 * 4096
    assert gss.kv_bytes_per_token(shape_8b, 2) == 32 * 2 * 8 * 128 * 2
    assert gss.roofline_ms(1_000_000_000, 1000, 2, 500.0, 1000.0) == pytest.approx(1.001)
    assert gss.roofline_ms(1, 1, 1, 1, None) is None


def test_expand_parts() -> None:
    assert gss.expand_parts("hf,bandwidth") == ["bandwidth", "hf-static", "hf-assisted", "hf-batch"]
    assert gss.expand_parts("all")[0] == "graphed" and "bandwidth" not in gss.expand_parts("all")
    assert not any(p.endswith("-fixed") for p in gss.expand_parts("all"))
    assert gss.expand_parts("fixed-k") == ["graphed-ngram-fixed", "graphed-draft-fixed"]
    assert not gss.applies("llama-1b", "graphed-draft-fixed") and gss.applies("llama-1b", "graphed-ngram-fixed")
    assert not gss.applies("llama-8b", "graphed-draft") and gss.applies("bundled", "eager-draft")
    with pytest.raises(SystemExit):
        gss.expand_parts("graphs")


def test_smoke_some_parts(tmp_path: Path) -> None:
    """Every kind of part once (asyncspec with a draft at fixed k, start-up, both transformers kinds), the merge of two
    files, and the markdown of the plot script: about 25 s on two cores."""
    first, second, merged = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "merged.json"
    _run(str(SCRIPT), "--smoke", "--parts", "bandwidth,graphed-draft-fixed,hf-batch", "--output", str(first))
    _run(str(SCRIPT), "--smoke", "--parts", "startup,hf-static", "--output", str(second))
    _run(str(SCRIPT), "--merge-from", str(first), str(second), str(first), "--output", str(merged))
    r = json.loads(merged.read_text())
    check_results(r, {"bundled": ["graphed-draft-fixed", "startup", "hf-static", "hf-batch-2"]})
    assert r["models"]["bundled"]["rows"]["graphed-draft-fixed"]["engine_kwargs"]["adaptive_speculation"] is False
    assert len(r["runs"]) == 2  # the file given twice counts once
    md = _run(str(PLOT), str(merged), "--no-plots").stdout
    assert "| bundled | graphed-draft-fixed |" in md and "### Start-up and KV capacity" in md


@pytest.mark.slow
def test_smoke_all_parts(tmp_path: Path) -> None:
    """The whole --smoke run (every part of the bundled model) plus the random-weight paths on a tiny shape:
    about a minute on two cores."""
    out = tmp_path / "smoke.json"
    proc = _run(str(SCRIPT), "--smoke", "--output", str(out))
    assert "read bandwidth" in proc.stdout and "graphed-ngram" in proc.stdout
    _run(
        str(SCRIPT),
        "--smoke",
        "--models",
        "tiny-dummy",
        "--parts",
        "startup,hf-static",
        "--output",
        str(out),
        "--merge",
    )
    r = json.loads(out.read_text())
    parts = [*gss.GROUPS["asyncspec"], "startup", "hf-static", "hf-assisted", "hf-batch-2"]
    check_results(r, {"bundled": parts, "tiny-dummy": ["startup", "hf-static"]})
    assert r["models"]["tiny-dummy"]["notes"] and r["models"]["tiny-dummy"]["dummy_weights"]
    summary = r["models"]["bundled"]["summary"]
    assert [w["batch"] for w in summary["graphed_sweep"]] == r["settings"]["sweep_batches"]
    assert {(x["config"], x["streams"]) for x in summary["speculation_on_vs_off"]} == {
        (c, st) for c in gss.GROUPS["asyncspec"] if "-" in c for st in r["settings"]["adaptive_streams"]
    }
    assert all(x["ratio"] is not None and x["ratio"] > 0 for x in summary["speculation_on_vs_off"])
    pytest.importorskip("matplotlib")
    _run(str(PLOT), str(out), "--out", str(tmp_path / "img"))
    assert sorted(p.name for p in (tmp_path / "img").iterdir()) == [
        "step_speed_roofline.png",
        "step_speed_sweep.png",
        "step_speed_throughput.png",
    ]


def test_bubble_smoke_and_timeline(tmp_path: Path) -> None:
    """benchmarks/bubble.py --smoke: both loops with and without speculation at two batch sizes, the
    profiler timeline of each loop, and its picture where matplotlib is installed."""
    out = tmp_path / "bubble.json"
    proc = _run(str(REPO / "benchmarks" / "bubble.py"), "--smoke", "--output", str(out))
    assert "idle %" in proc.stdout
    r = json.loads(out.read_text())
    keys = {(row["spec"], row["batch"], row["loop"]) for row in r["rows"]}
    assert keys == {(s, b, loop) for s in (None, "ngram") for b in (1, 2) for loop in ("sync", "async")}
    for row in r["rows"]:
        assert row["tokens"] > 0 and 0 <= row["device_idle_fraction"] < 1 and _positive(row["tpot_ms"])
    for loop in ("sync", "async"):
        names = [h["name"] for h in r["timelines"][loop]["host"]]
        assert names.count("plan") >= 4 and names.count("collect") >= 4
    if importlib.util.find_spec("matplotlib") is not None:  # a plotting extra, not a test dependency
        _run(str(REPO / "benchmarks" / "bubble.py"), "--plot", str(out), "--out", str(tmp_path))
        assert (tmp_path / "bubble_timeline.png").stat().st_size > 0


def test_tensor_parallel_smoke(tmp_path: Path) -> None:
    """benchmarks/tensor_parallel.py --smoke: sizes 1 and 2 on the CPU (gloo), each in its own process,
    with TPOT, throughput and the ratio to size 1 in its JSON; a variant with extra environment
    variables reruns size 2 under them; the profile of decode steps gives each rank's summary."""
    out = tmp_path / "tp.json"
    proc = _run(
        str(REPO / "benchmarks" / "tensor_parallel.py"),
        "--smoke",
        "--env-variant",
        "quiet:NCCL_DEBUG=WARN",
        "--profile-dir",
        str(tmp_path / "prof"),
        "--profile-tokens",
        "4",
        "--output",
        str(out),
    )
    assert "| 2 |" in proc.stdout and "| 2-quiet |" in proc.stdout
    r = json.loads(out.read_text())
    assert r["schema"] == "asyncspec.tensor_parallel/1" and set(r["sizes"]) == {"1", "2", "2-quiet"}
    assert r["sizes"]["2-quiet"]["env"] == {"NCCL_DEBUG": "WARN"}
    for key, row in r["sizes"].items():
        assert row["size"] == int(key.split("-")[0]) and _positive(row["tpot_ms"]) and _positive(row["startup_s"])
        assert _positive(row["throughput"]["4"]["e2e_tok_s"]) and _positive(row["tpot_vs_tp1"])
        ranks = row["profile"]["ranks"]
        assert len(ranks) == row["size"] and all(rank["steps"] >= 3 for rank in ranks)


def test_serve_cpu_cost_smoke(tmp_path: Path) -> None:
    """benchmarks/serve_cpu_cost.py on the CPU, tiny: both modes serve every token, and the engine's own process
    is found and spends CPU (its model runs there)."""
    out = tmp_path / "cost.json"
    _run(
        str(REPO / "benchmarks" / "serve_cpu_cost.py"),
        *("--device", "cpu", "--concurrency", "2", "--num-prompts", "4", "--max-tokens", "4"),
        *("--output", str(out)),
    )
    rows = json.loads(out.read_text())["rows"]
    assert [row["engine_process"] for row in rows] == [False, True]
    assert all(row["output_tokens"] == 16 for row in rows)
    assert rows[0]["engine_cpu_s"] is None and rows[1]["engine_cpu_s"] > 0


def test_engine_process_overhead_smoke(tmp_path: Path) -> None:
    """benchmarks/engine_process_overhead.py on the CPU, tiny: every mode generates every token, counts its engine's
    steps and finds the CPU its engine spent (the engine process's, in the two process modes)."""
    out = tmp_path / "epo.json"
    _run(
        str(REPO / "benchmarks" / "engine_process_overhead.py"),
        *("--device", "cpu", "--concurrency", "2", "--num-prompts", "4", "--max-tokens", "4"),
        *("--output", str(out)),
    )
    rows = json.loads(out.read_text())["rows"]
    assert [row["mode"] for row in rows] == ["offline", "engine_process", "served"]
    for row in rows:
        assert row["output_tokens"] == 16 and row["num_steps"] >= 2 and row["engine_cpu_us_per_token"] > 0
    assert rows[2]["failed"] == 0


def test_serve_vs_offline_smoke(tmp_path: Path) -> None:
    """benchmarks/serve_vs_offline.py on the CPU, tiny: both sides loaded at once, two alternated rounds, every
    token served, the engine found in its own process (serve's default) and the ratio that of the medians."""
    out = tmp_path / "svo.json"
    _run(
        str(REPO / "benchmarks" / "serve_vs_offline.py"),
        *("--device", "cpu", "--concurrency", "2", "--prompts-per-stream", "1", "--max-tokens", "4"),
        *("--rounds", "2", "--output", str(out)),
    )
    (row,) = json.loads(out.read_text())["rows"]
    assert len(row["offline_rounds"]) == len(row["served_rounds"]) == 2
    assert all(r["total_output_tokens"] == 8 for r in row["offline_rounds"] + row["served_rounds"])
    assert row["served"]["failed"] == 0 and row["server_exit_code"] == 0
    assert "engine0" in row["served"]["cpu_busy_fraction"]
    medians = row["served_output_throughput"] / row["offline_output_throughput"]
    assert row["served_over_offline"] == pytest.approx(medians)


def test_spec_policy_trace_smoke(tmp_path: Path) -> None:
    """benchmarks/spec_policy_trace.py on the CPU: every generation's steps are counted by the k they verified
    (all at k = 4 there: no device costs, no adaptation)."""
    out = tmp_path / "trace.json"
    _run(
        str(REPO / "benchmarks" / "spec_policy_trace.py"),
        *("--device", "cpu", "--generations", "2", "--max-tokens", "8", "--output", str(out)),
    )
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2
    for row in rows:
        assert row["steps"] >= 2 and sum(row["steps_by_k"].values()) == row["steps"]
        assert set(row["steps_by_k"]) <= {"0", "1", "2", "4"} and row["steps_by_k"].get("4", 0) >= 1
        assert row["estimates"] == {}


def test_plan_trace_smoke(tmp_path: Path) -> None:
    """benchmarks/plan_trace.py --smoke: both engines' plans are traced and their periods add up to the run."""
    out = tmp_path / "plan_trace.json"
    _run(str(REPO / "benchmarks" / "plan_trace.py"), "--smoke", "--policy", "--fixed-k", "2", "--output", str(out))
    results = json.loads(out.read_text())
    assert set(results["configs"]) == {"plain", "draft", "draft_k2"}
    # The fixed-k engine verifies 2 drafts at every speculative step, whatever the policy would choose.
    fixed = results["configs"].pop("draft_k2")
    assert set(fixed["steps_per_k"]) == {"spec_steps_with_k_2"} and fixed["steps_per_k"]["spec_steps_with_k_2"] > 1
    (fixed_trial,) = fixed["streams"]["4"]
    assert any(kind.startswith("k2->") for kind in fixed_trial["kinds"]), fixed_trial["kinds"]
    for name, config in results["configs"].items():
        (trial,) = config["streams"]["4"]
        # The draft engine's policy is asked once per decode plan (no step costs on the CPU: no estimates, k fixed).
        choices = trial.get("choices", [])
        assert (len(choices) > 1) == (name == "draft"), choices
        assert all(c["k"] == 4 and c["estimates"] is None for c in choices), choices
        kinds = trial["kinds"]
        assert "prefill" in kinds and sum(e["plans"] for e in kinds.values()) == trial["plans"] > 1
        assert sum(e["ms"] for e in kinds.values()) <= trial["wall_ms"] + 1e-6
        assert any(kind.startswith("k4->") for kind in kinds) == (name == "draft"), kinds


def test_plan_trace_sustained_smoke(tmp_path: Path) -> None:
    """benchmarks/plan_trace.py --sustained 3: three times the streams' requests a trial, never more than the streams
    in flight (the smoke engines could run twice as many at once), every request generating all its tokens."""
    out = tmp_path / "plan_trace_sustained.json"
    _run(str(REPO / "benchmarks" / "plan_trace.py"), "--smoke", "--sustained", "3", "--sequence", "--output", str(out))
    results = json.loads(out.read_text())
    assert results["sustained"] == 3
    for config in results["configs"].values():
        (trial,) = config["streams"]["4"]
        assert trial["failed_requests"] == 0
        assert trial["generated_tokens"] == 12 * 6  # 12 requests of 6 new tokens each (the smoke settings)
        running = [plan[2] for plan in trial["sequence"]]  # requests in each plan
        assert max(running) == 4, running
        assert sum(plan[7] for plan in trial["sequence"]) == 12  # every request admitted once, by some plan
        p50, p90, longest = trial["queued_ms"]
        # From submission, not from the trial's start: the last requests submitted do not count the trial's time.
        assert 0 <= p50 <= p90 <= longest < trial["wall_ms"] / 2


@pytest.mark.parametrize("other", ["prior_first", "pooled"])
def test_spec_policy_ab_smoke(tmp_path: Path, other: str) -> None:
    """benchmarks/spec_policy_ab.py --smoke: plain, the changed policy and the shipped one, each mode's trials
    traced, and a TPOT each. Every mode runs once, beside prior_first (the fresh mode's reset re-applies the changed
    policy); the pooled patch runs in one mode. A sustained trial sends twice max_num_seqs (the script's default is
    four times): enough for admissions to continue after the first decodes."""
    out = tmp_path / "spec_policy_ab.json"
    modes = ["fresh", "steady", "sustained"] if other == "prior_first" else ["steady"]
    _run(
        str(REPO / "benchmarks" / "spec_policy_ab.py"),
        *("--smoke", "--other", other, "--modes", ",".join(modes), "--sustained-factor", "2"),
        *("--output", str(out)),
    )
    results = json.loads(out.read_text())
    assert results["other"] == other
    assert set(results["rows"]) == {f"{mode}@4" for mode in modes}
    for key, rows in results["rows"].items():
        assert set(rows) == {"plain", other, "shipped"}
        for name, (trial,) in rows.items():
            assert trial["wall_ms"] > 0 and "prefill" in trial["kinds"]
            assert trial["failed_requests"] == 0
            # 4 streams (8 requests when sustained), 6 new tokens each: the script checks it and this checks the count.
            assert trial["generated_tokens"] == 6 * (8 if key.startswith("sustained") else 4)
            assert ("choices" in trial) == (name != "plain")
            # A sustained trial's 8 requests run 4 at a time: admissions continue after the first decodes.
            assert max(record[2] for record in trial["sequence"]) <= 4
            assert (sum(record[7] for record in trial["sequence"]) == 8) == key.startswith("sustained")
    assert set(results["tpot_ms"]) == {"plain", other, "shipped"}
    # A smoke TPOT is a difference of two tiny CPU timings, which a loaded 2-core host can make negative.
    assert all(len(v) == 1 and math.isfinite(v[0]) for v in results["tpot_ms"].values())
    assert set(results["startup"]) == set(results["graph_stats"]) == {"plain", other, "shipped"}
    assert all(s["startup_load_seconds"] > 0 for s in results["startup"].values())
    # No graphs on the CPU; the scheduler counts from the TPOT runs' fresh reset, the same in every engine.
    assert all(g["cuda_graph_replays"] == 0 for g in results["graph_stats"].values())
    assert len({g["num_generation_tokens"] for g in results["graph_stats"].values()}) == 1


def test_admission_waves_ab_smoke(tmp_path: Path) -> None:
    """benchmarks/admission_waves_ab.py --smoke: four engines (plain and draft, waves on and off), both workloads,
    every requested token generated (the varied workload's lengths spread), and the queue times recorded."""
    out = tmp_path / "aw.json"
    _run(str(REPO / "benchmarks" / "admission_waves_ab.py"), "--smoke", "--output", str(out))
    results = json.loads(out.read_text())
    assert set(results["workloads"]) == {"fixed", "varied"}
    totals = {}
    for workload, entry in results["workloads"].items():
        assert set(entry["rows"]) == {"plain, no waves", "plain, waves", "draft, no waves", "draft, waves"}
        for (trial,) in entry["rows"].values():
            assert trial["tokens_per_s"] > 0 and trial["queued_ms_p90"] >= trial["queued_ms_p50"] >= 0
        totals[workload] = {trial["tokens"] for (trial,) in entry["rows"].values()}
    assert totals["fixed"] == {16 * 8}  # 8 streams, 2 requests each, 8 tokens
    assert len(totals["varied"]) == 1 and totals["varied"] != totals["fixed"]


def test_sustained_host_phases_smoke(tmp_path: Path) -> None:
    """benchmarks/sustained_host_phases.py --smoke: both engines' sustained trial timed, its plans counted by kind
    (prompt plans among them, each admitting), the launch timed in every kind, and a cProfile table per engine."""
    out = tmp_path / "shp.json"
    _run(str(REPO / "benchmarks" / "sustained_host_phases.py"), "--smoke", "--output", str(out))
    results = json.loads(out.read_text())
    assert set(results["walls_ms"]) == set(results["engines"]) == set(results["cprofile"]) == {"plain", "draft"}
    for engine in results["engines"].values():
        kinds = engine["plans"]
        assert any(kind.startswith("prompt ") for kind in kinds) and any(kind.startswith("decode ") for kind in kinds)
        for kind, count in kinds.items():
            assert count > 0 and engine["ms_per_trial"][kind]["runner.launch"][1] == count
    assert all(rows["rows"] and rows["wall_ms"] > 0 for rows in results["cprofile"].values())


def test_scheduler_spec_overhead_smoke(tmp_path: Path) -> None:
    """benchmarks/scheduler_spec_overhead.py --smoke: both plan lengths timed at k = 4, full-batch plans only."""
    out = tmp_path / "sso.json"
    _run(str(REPO / "benchmarks" / "scheduler_spec_overhead.py"), "--smoke", "--output", str(out))
    cases = json.loads(out.read_text())["cases"]
    assert [c["steps_per_plan"] for c in cases] == [1, 4]
    for c in cases:
        assert c["k"] == 4 and c["num_requests"] == 8 and c["timed_plans"] >= 5
        assert c["schedule_p50_us"] > 0 and c["update_from_output_p50_us"] > 0


def test_profiler_overhead_smoke(tmp_path: Path) -> None:
    """benchmarks/profiler_overhead.py --smoke: one process without the profiler and one with it, each a TPOT."""
    out = tmp_path / "profiler.json"
    _run(
        str(REPO / "benchmarks" / "profiler_overhead.py"),
        "--smoke",
        "--models",
        "bundled",
        "--rounds",
        "1",
        "--output",
        str(out),
    )
    results = json.loads(out.read_text())
    assert [(r["model"], r["profiler"]) for r in results["rows"]] == [("bundled", False), ("bundled", True)]
    assert all("error" not in r and r["tpot_ms"] > 0 for r in results["rows"]), results["rows"]
    summary = results["per_model"]["bundled"]
    assert summary["with_over_without"] == pytest.approx(summary["with_ms"] / summary["without_ms"])


def test_decode_windows_outlast_multi_step_plans() -> None:
    """Under multi-step plans each engine step emits several tokens a request: a window's requests must still
    outlast both its windows (timed and profiled), or the profiled steps run on finished requests."""
    import asyncspec

    llm = asyncspec.LLM(
        str(gss.TARGET),
        device="cpu",
        dtype="float32",
        max_model_len=2048,
        max_num_seqs=2,
        num_kv_blocks=512,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        num_scheduler_steps=4,
    )
    s = {"device": "cpu", "window_steps": 2}  # the --smoke setting
    window = gss.decode_window(llm, asyncspec, 2, s, profiled=True)
    assert window["tokens_per_step_per_seq"] > 1  # multi-step plans ran
    assert window["finished_during_windows"] == 0 and "window_warning" not in window
    # Per-step figures of the profiled window count device steps, not engine calls (each ran several).
    assert window["timed_num_device_steps"] > window["steps"] and window["profiled_device_steps"] > window["steps"]
    assert window["wall_ms_per_device_step"] == pytest.approx(
        window["wall_ms_per_step"] * window["steps"] / window["timed_num_device_steps"]
    )
    assert window["profiled_wall_ms_per_step"] == pytest.approx(
        window["profiled_wall_s"] * 1e3 / window["profiled_device_steps"]
    )


def test_persistent_mlp_matches_its_reference_under_the_interpreter() -> None:
    """The experiment's persistent kernel (one program, both barriers) equals its fp32 reference; the script
    exits non-zero otherwise, or when a barrier's arrivals are not counted once per program. The interpreter
    runs programs one after another, so a barrier that waits too little (or memory ordering) cannot show here:
    the GPU run checks every variant against the same reference."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "benchmarks/persistent_mlp.py", "--cpu"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "counter barrier" in proc.stdout and "flag barrier" in proc.stdout


def test_l2_prefetch_spec_and_regions() -> None:
    """The L2-prefetch experiment's switch parses into what it prefetches, and refuses what it cannot do (its
    kernels are PTX, so only the GPU run executes them)."""
    from types import SimpleNamespace

    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        l2 = _load(REPO / "benchmarks" / "l2_prefetch.py", "l2_prefetch")
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    spec = l2.parse("point=attend;targets=o/down;mb=0.5;mode=line;programs=132")
    assert (spec.point, spec.targets, spec.mb, spec.mode, spec.programs) == ("attend", ("o", "down"), 0.5, "line", 132)
    for bad in ("point=mlp", "mode=tma", "targets=o/qkv", "chunk=100"):
        with pytest.raises(ValueError, match="bad prefetch spec"):
            l2.parse(bad)

    def lin(rows: int, cols: int) -> SimpleNamespace:
        return SimpleNamespace(weight=torch.empty(rows, cols, dtype=torch.bfloat16))

    layer = SimpleNamespace(
        self_attn=SimpleNamespace(o_proj=lin(64, 64)),
        mlp=SimpleNamespace(gate_up_proj=lin(4096, 64), down_proj=lin(64, 2048)),
    )
    regions = l2._regions(layer, l2.parse("targets=o/gu;mb=0.25"))
    assert [(w is layer.self_attn.o_proj.weight, n) for w, n in regions] == [(True, 64 * 64 * 2), (False, 2**18)]
    assert regions[1][0] is layer.mlp.gate_up_proj.weight
    # A megabyte count past the tensor takes the whole tensor.
    assert l2._regions(layer, l2.parse("targets=down;mb=64"))[0][1] == 64 * 2048 * 2


def test_prefix_sharing_benchmark_smoke(tmp_path):
    """benchmarks/prefix_sharing.py --smoke: the engine that waits for a shared prefix's blocks computes fewer
    prompt tokens than the one that does not, by what it hits."""
    out = tmp_path / "prefix_sharing.json"
    _run(str(REPO / "benchmarks" / "prefix_sharing.py"), "--smoke", "--output", str(out))
    r = json.loads(out.read_text())
    without, waiting = r["median"]["wait 0"], r["median"]["wait 32"]
    assert without["sharing_waits"] == 0 and waiting["sharing_waits"] > 0
    assert waiting["prefix_cache_hits"] > without["prefix_cache_hits"]
    saved = without["prompt_tokens_computed"] - waiting["prompt_tokens_computed"]
    assert saved == waiting["prefix_cache_hits"] - without["prefix_cache_hits"] > 0
    assert all(_positive(row["ttft_ms_p50"]) for rows in r["rows"].values() for row in rows)
