"""Plots and markdown tables from the JSON of benchmarks/gpu_step_speed.py (issue 8).

    python benchmarks/plot_step_speed.py benchmarks/results/gpu_step_speed.json --out docs/img/
    python benchmarks/plot_step_speed.py RESULTS.json --no-plots            # the markdown only

Prints markdown ready to paste into docs/benchmarks.md (card, dates, commands, versions, then one table per
question) and, where matplotlib is installed (`pip install matplotlib`; not a test dependency), writes to --out:
- step_speed_sweep.png: ms per decode step against batch size, graphed asyncspec (wall and GPU) against the
  roofline, one panel per model;
- step_speed_throughput.png: generated tok/s against concurrency, every asyncspec configuration and
  transformers' generate_batch, one panel per model;
- step_speed_roofline.png: fraction of the roofline per model and configuration: batch-1 step (GPU time and
  wall time) and the decode phase at the reference concurrency (32 streams).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_step_speed import ASYNCSPEC_CONFIGS, derive  # noqa: E402 - a sibling script, imports no torch

COLORS = {name: f"C{i}" for i, name in enumerate(ASYNCSPEC_CONFIGS)}
"""One colour per asyncspec configuration, the same in every panel."""


def _f(x: Any, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x * 100:.0f} %"


def _table(head: list[str], rows: list[list[str]], align: str = "") -> list[str]:
    """A markdown table; `align` is one letter per column (l or r), default first column left, rest right."""
    align = align or "l" + "r" * (len(head) - 1)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def _error(row: dict[str, Any]) -> str:
    return "error: " + " ".join(str(row["error"]).split())[-120:].replace("|", "/")


def markdown(results: dict[str, Any]) -> str:
    """The tables of docs/benchmarks.md, from a results file (derived figures recomputed)."""
    derive(results)
    s = results.get("settings", {})
    ref, big = s.get("reference_streams", 32), max(s.get("window_batches", [64]))
    conc = s.get("concurrency", [1, 8, 32, 64, 128])
    bw = results["bandwidth"]["GB_s"]
    out = ["## GPU: the decode step against the roofline (issue 8)", ""]
    out.append(f"- Card: {results['card']}; read bandwidth {_f(bw, '.0f')} GB/s (`x.sum()` / `x.amax()` over a ")
    out[-1] += "bf16 tensor, median of the runs), the roofline's denominator."
    v = results.get("versions", {})
    out.append(
        f"- torch {v.get('torch')}, triton {v.get('triton')}, transformers {v.get('transformers')}, "
        f"Python {v.get('python')}."
    )
    out.append(
        f"- Settings: {s.get('new_tokens')} new tokens, greedy, EOS ignored; speed rows at gpu_memory_utilization "
        f"{s.get('speed_gpu_memory_utilization')}, start-up row at {s.get('startup_gpu_memory_utilization')}; "
        f"decode windows of {s.get('window_steps')} steps; prefix caching off; token-id prompts, no detokenization."
    )
    out.append("- Runs (merged into one file):")
    for run in results.get("runs", []):
        commit = (run.get("git_commit") or "")[:10]
        out.append(f"  - {run['date']} (commit {commit or '?'}, {run.get('wall_s', '?')} s): `{run['command']}`")
    out.append("")

    out += ["### Batch-1 decode step", ""]
    head = ["model", "config", "TPOT (ms)", "HF static ÷ TPOT", "wall ms/step", "GPU ms/step", "roofline ms"]
    head += ["GPU × roofline", "wall − GPU (ms)", "kernels/step", "tokens/step", "GPU ms/token", "GPU busy b=1"]
    head += [f"GPU busy b={big}"]
    rows = []
    for model, entry in results["models"].items():
        for name in ASYNCSPEC_CONFIGS:
            row = entry["rows"].get(name)
            if row is None:
                continue
            if "error" in row:
                rows.append([model, name, _error(row)] + [""] * (len(head) - 3))
                continue
            c = entry["summary"]["configs"][name]
            rows.append(
                [
                    model,
                    name,
                    _f(c["tpot_ms"]),
                    _f(c["hf_static_tpot_over_tpot"]),
                    _f(c["wall_ms_per_step_b1"], ".3f"),
                    _f(c["gpu_ms_per_step_b1"], ".3f"),
                    _f(c["roofline_ms_b1"], ".3f"),
                    _f(c["gpu_x_roofline_b1"]),
                    _f(c["wall_minus_gpu_ms_b1"], ".3f"),
                    _f(c["kernels_per_step_b1"], ".0f"),
                    _f(c["tokens_per_step_per_seq_b1"]),
                    _f(c["gpu_ms_per_token_b1"], ".3f"),
                    _pct(c["gpu_busy_b1"]),
                    _pct(c[f"gpu_busy_b{big}"]),
                ]
            )
    out += _table(head, rows, "ll" + "r" * (len(head) - 2))
    out += [
        "",
        "TPOT: (time of a full generation − time of a 1-token one) / (tokens − 1), batch 1. Per step: steady decode "
        "at batch 1 (wall without the profiler; GPU = sum of the CUDA ops' device time from torch.profiler). "
        "Roofline: every weight read once plus the live KV over the read bandwidth. tokens/step > 1: speculation. "
        "GPU busy: GPU ms / wall ms per step.",
        "",
    ]

    out += ["### Throughput (generated tok/s, end to end; all prompts submitted at once)", ""]
    head = ["model", "config"] + [f"@{c}" for c in conc]
    hf_streams = sorted(
        {int(n.rsplit("-", 1)[1]) for e in results["models"].values() for n in e["rows"] if n.startswith("hf-batch-")}
    )
    head += [f"decode @{ref}", f"% of roofline @{ref}"] + [f"÷ generate_batch @{st}" for st in hf_streams]
    rows = []
    for model, entry in results["models"].items():
        for name in ASYNCSPEC_CONFIGS:
            row = entry["rows"].get(name)
            if row is None or "error" in row:
                if row is not None:
                    rows.append([model, name, _error(row)] + [""] * (len(head) - 3))
                continue
            c = entry["summary"]["configs"][name]
            rows.append(
                [model, name]
                + [_f(c["tok_s"].get(str(x)), ".0f") for x in conc]
                + [
                    _f(c["decode_tok_s"].get(str(ref)), ".0f"),
                    _pct(c["fraction_of_roofline_ref"]),
                ]
                + [_f(c["over_hf_batch"].get(str(st))) for st in hf_streams]
            )
    out += _table(head, rows, "ll" + "r" * (len(head) - 2))
    out += [
        "",
        f"decode @{ref}: {ref} × (tokens − 1) / (time of the full run − time of a 1-token run). % of roofline: "
        f"steady decode at {ref} streams (the decode window of that batch, where the config has one: `graphed`): "
        f"the step's roofline (weights + the live KV at its mean context, over the bandwidth) ÷ its wall time; "
        "- where no window was measured at that batch. ÷ generate_batch: "
        "asyncspec tok/s over transformers' continuous batching (CUDA graphs) at the same stream count. With "
        "speculation the decode phase can pass 100 %: the roofline counts one token per stream and step.",
        "",
    ]

    out += ["### transformers baselines", ""]
    head = ["model", "generate, static cache, TPOT (ms)", "assisted k=4, TPOT (ms)", "assisted acceptance"]
    head += [f"generate_batch @{st} (tok/s)" for st in hf_streams]
    rows = []
    for model, entry in results["models"].items():
        r = entry["rows"]
        if not any(n.startswith("hf-") for n in r):
            continue

        def cell(name: str, key: str, spec: str = ".2f", r: dict = r) -> str:
            row = r.get(name)
            if row is None:
                return "—"
            return _error(row) if "error" in row else _f(row.get(key), spec)

        rows.append(
            [
                model,
                cell("hf-static", "tpot_ms"),
                cell("hf-assisted", "tpot_ms"),
                cell("hf-assisted", "acceptance_length"),
            ]
            + [cell(f"hf-batch-{st}", "e2e_tok_s", ".0f") for st in hf_streams]
        )
    out += _table(head, rows) + [""]

    out += ["### Start-up and KV capacity", ""]
    head = ["model", "start-up (s)", "gpu_memory_utilization", "KV capacity (tokens)", "KV MiB per stream", "streams"]
    rows = []
    for model, entry in results["models"].items():
        row = entry["rows"].get("startup")
        if row is None:
            continue
        if "error" in row:
            rows.append([model, _error(row), "", "", "", ""])
            continue
        rows.append(
            [
                model,
                _f(row["startup_s"], ".1f"),
                str(row["engine_kwargs"]["gpu_memory_utilization"]),
                str(row["kv_capacity_tokens"]),
                _f(row["kv_bytes_per_stream_at_benchmark_length"] / 2**20, ".1f"),
                str(row["streams_at_benchmark_length"]),
            ]
        )
    out += _table(head, rows)
    out += [
        "",
        "Start-up: LLM construction with CUDA graphs, no speculation (weights, memory profiling, KV pool, graph "
        "capture). KV per stream and streams: at the benchmark's mean length (mean prompt + new tokens).",
        "",
    ]

    out += ["### Graphed decode step against batch size", ""]
    head = ["model", "batch", "wall ms/step", "GPU ms/step", "roofline ms", "GPU × roofline", "decode tok/s"]
    rows = []
    for model, entry in results["models"].items():
        for w in entry["summary"]["graphed_sweep"]:
            rows.append(
                [
                    model,
                    str(w["batch"]),
                    _f(w["wall_ms_per_step"], ".3f"),
                    _f(w["gpu_ms_per_step"], ".3f"),
                    _f(w["roofline_ms_per_step"], ".3f"),
                    _f(w["gpu_x_roofline"]),
                    _f(w["decode_tok_s"], ".0f"),
                ]
            )
    out += _table(head, rows, "lr" + "r" * (len(head) - 2)) + [""]

    out += ["### Speculation on vs off (for adaptive k)", ""]
    head = ["model", "config", "streams", "tok/s off", "tok/s on", "on ÷ off"]
    rows = []
    for model, entry in results["models"].items():
        for item in entry["summary"]["speculation_on_vs_off"]:
            rows.append(
                [
                    model,
                    item["config"],
                    str(item["streams"]),
                    _f(item["tok_s_off"], ".0f"),
                    _f(item["tok_s_on"], ".0f"),
                    _f(item["ratio"]),
                ]
            )
    out += _table(head, rows, "llrrrr") + [""]
    notes = sorted({n for e in results["models"].values() for n in e.get("notes", [])})
    warnings = [
        f"{m}/{name} batch {b}: {w['profiler_warning']}"
        for m, e in results["models"].items()
        for name, row in e["rows"].items()
        for b, w in (row.get("windows") or {}).items()
        if isinstance(w, dict) and w.get("profiler_warning")
    ]
    out += [f"Note: {n}." for n in notes] + [f"Profiler warning: {w}." for w in warnings]
    return "\n".join(out).rstrip() + "\n"


def _log2_axis(ax: Any, xs: list[int]) -> None:
    """A log-2 x axis ticked at the measured values, labelled in plain numbers."""
    ax.set_xscale("log", base=2)
    ticks = sorted(set(xs))
    if ticks:
        ax.set_xticks(ticks, [str(x) for x in ticks])
        ax.minorticks_off()


def _label_axis(ax: Any, xlabel: str, ylabel: str, title: str, legend_size: int) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)


def _save(plt: Any, fig: Any, title: str, path: Path) -> Path:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plots(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """The three PNGs; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    derive(results)
    out_dir.mkdir(parents=True, exist_ok=True)
    models = list(results["models"])
    written = []

    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        sweep = results["models"][model]["summary"]["graphed_sweep"]
        xs = [w["batch"] for w in sweep]
        for key, label, style in (
            ("wall_ms_per_step", "wall (graphed)", "o-"),
            ("gpu_ms_per_step", "GPU (graphed)", "s-"),
            ("roofline_ms_per_step", "roofline", "k--"),
        ):
            pts = [(x, w[key]) for x, w in zip(xs, sweep, strict=True) if w[key] is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label=label)
        eager = results["models"][model]["rows"].get("eager", {})
        pts = [
            (int(b), w["wall_ms_per_step"])
            for b, w in (eager.get("windows") or {}).items()
            if isinstance(w, dict) and "error" not in w
        ]
        if pts:
            ax.plot(*zip(*sorted(pts), strict=True), "x:", label="wall (eager)")
        _log2_axis(ax, xs + [b for b, _ in pts])
        _label_axis(ax, "batch size (decode streams)", "ms per decode step", model, legend_size=8)
    written.append(
        _save(plt, fig, f"asyncspec decode step vs batch size — {results['card']}", out_dir / "step_speed_sweep.png")
    )

    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        entry = results["models"][model]
        for name, c in entry["summary"]["configs"].items():
            pts = sorted((int(k), v) for k, v in c["tok_s"].items() if v is not None)
            if pts:
                style = "o-" if name.startswith("graphed") else "x:"
                ax.plot(*zip(*pts, strict=True), style, color=COLORS.get(name), label=name)
        hf = sorted((int(k), v) for k, v in entry["summary"]["hf"]["generate_batch_tok_s"].items() if v is not None)
        if hf:
            ax.plot(*zip(*hf, strict=True), "k*", markersize=10, label="transformers generate_batch")
        _log2_axis(ax, [int(k) for c in entry["summary"]["configs"].values() for k in c["tok_s"]] + [x for x, _ in hf])
        _label_axis(ax, "concurrent streams", "generated tok/s", model, legend_size=7)
    written.append(
        _save(plt, fig, f"Throughput vs concurrency — {results['card']}", out_dir / "step_speed_throughput.png")
    )

    ref = results.get("settings", {}).get("reference_streams", 32)
    metrics = (
        ("GPU, batch 1", lambda c: 1 / c["gpu_x_roofline_b1"] if c["gpu_x_roofline_b1"] else None),
        ("wall, batch 1", lambda c: 1 / c["wall_x_roofline_b1"] if c["wall_x_roofline_b1"] else None),
        (f"decode @{ref}", lambda c: c["fraction_of_roofline_ref"]),
    )
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        configs = results["models"][model]["summary"]["configs"]
        names = list(configs)
        width = 0.8 / len(metrics)
        for i, (label, fn) in enumerate(metrics):
            vals = [fn(configs[n]) or 0.0 for n in names]
            ax.bar([j + i * width for j in range(len(names))], vals, width, label=label)
        ax.axhline(1.0, color="k", linestyle="--", linewidth=0.8)
        ax.set_xticks([j + width for j in range(len(names))], names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("fraction of roofline (roofline time / measured)")
        ax.set_title(model)
        ax.legend(fontsize=7)
    written.append(
        _save(plt, fig, f"Fraction of the memory roofline — {results['card']}", out_dir / "step_speed_roofline.png")
    )
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="JSON written by benchmarks/gpu_step_speed.py")
    parser.add_argument("--out", default="docs/img/", help="folder for the PNGs")
    parser.add_argument("--markdown", help="also write the markdown to this file")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args()
    results = json.loads(Path(args.results).read_text())
    md = markdown(results)
    print(md)
    if args.markdown:
        Path(args.markdown).write_text(md)
    if not args.no_plots:
        try:
            paths = plots(results, Path(args.out))
        except ImportError:
            print("matplotlib is not installed (pip install matplotlib): no plots written", file=sys.stderr)
            return 0
        for p in paths:
            print(f"wrote {p}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
