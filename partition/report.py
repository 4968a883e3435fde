"""Sweep reports: predicted against measured, as markdown, CSV and PNG plots.

Plots use matplotlib's Agg backend (imported on first use), so a report can be written on a
headless cluster node and `tvmpipe partition` never pays for importing matplotlib.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from tvmpipe.core import files
from tvmpipe.partition.sweep import SweepCase

COLUMNS = ["stages", "strategy", "cuts", "pred_throughput", "meas_throughput", "throughput_error_pct",
           "pred_latency_us", "meas_latency_p50_us", "meas_latency_p99_us", "pred_bubble", "meas_bubble",
           "pred_bottleneck_us", "bytes_moved", "error"]


@dataclass(frozen=True)
class Span:
    """One bar of a timeline: `stage` busy from `start` to `end` (any one time unit) with `label`."""

    stage: int
    start: float
    end: float
    label: str = ""


def case_row(case: SweepCase) -> dict[str, object]:
    p, m = case.prediction, case.measured
    row: dict[str, object] = {c: None for c in COLUMNS}
    row.update(stages=case.stages, strategy=case.strategy, error=case.error)
    if case.plan is not None:
        row["cuts"] = " ".join(f"[{s},{e})" for s, e in case.plan.stages)
    if p is not None:
        row.update(pred_throughput=p.throughput, pred_latency_us=p.latency_us, pred_bubble=p.bubble,
                   pred_bottleneck_us=p.bottleneck_us, bytes_moved=p.bytes_moved)
    if m is not None:
        row.update(meas_throughput=m.throughput, meas_latency_p50_us=m.latency_p50_us,
                   meas_latency_p99_us=m.latency_p99_us, meas_bubble=m.bubble)
        if p is not None and m.throughput:
            row["throughput_error_pct"] = 100.0 * (p.throughput - m.throughput) / m.throughput
    return row


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
    return str(v)


def write_csv(cases: list[SweepCase], path: str | Path) -> Path:
    path = Path(path)
    with files.atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for c in cases:
            w.writerow({k: ("" if v is None else v) for k, v in case_row(c).items()})
    return path


def markdown_table(cases: list[SweepCase]) -> str:
    head = ["stages", "strategy", "pred thr (/s)", "meas thr (/s)", "err %", "pred lat (us)", "p50 (us)",
            "p99 (us)", "pred bubble", "meas bubble", "stages [start,end)"]
    keys = ["stages", "strategy", "pred_throughput", "meas_throughput", "throughput_error_pct", "pred_latency_us",
            "meas_latency_p50_us", "meas_latency_p99_us", "pred_bubble", "meas_bubble", "cuts"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cases:
        row = case_row(c)
        cells = [_fmt(row[k]) for k in keys]
        if c.error:
            cells[-1] = f"not planned: {c.error.splitlines()[0]}"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_throughput(cases: list[SweepCase], path: str | Path, title: str = "throughput vs stages") -> Path:
    """Predicted (dashed) and measured (solid) throughput against stage count, one colour per strategy."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    strategies = list(dict.fromkeys(c.strategy for c in cases))
    for i, s in enumerate(strategies):
        color = f"C{i}"
        pred = [(c.stages, c.prediction.throughput) for c in cases if c.strategy == s and c.prediction]
        meas = [(c.stages, c.measured.throughput) for c in cases if c.strategy == s and c.measured]
        if pred:
            ax.plot(*zip(*pred), "--o", color=color, mfc="none", label=f"{s} predicted")
        if meas:
            ax.plot(*zip(*meas), "-s", color=color, label=f"{s} measured")
    ax.set_xlabel("pipeline stages")
    ax.set_ylabel("throughput (samples/s)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if strategies:
        ax.legend()
    ks = sorted({c.stages for c in cases})
    if ks:
        ax.set_xticks(ks)
    return _save(fig, path)


def plot_gantt(spans: list[Span] | list[tuple], path: str | Path, unit: str = "ms",
               title: str = "pipeline timeline") -> Path:
    """One row per stage, one bar per span, coloured by label (e.g. request id or 'send')."""
    plt = _pyplot()
    spans = [s if isinstance(s, Span) else Span(*s) for s in spans]
    stages = sorted({s.stage for s in spans})
    labels = list(dict.fromkeys(s.label for s in spans))
    cmap = plt.get_cmap("tab20")
    color = {lab: cmap(i % 20) for i, lab in enumerate(labels)}
    fig, ax = plt.subplots(figsize=(9, 0.6 * max(len(stages), 1) + 1.8))
    for s in spans:
        ax.barh(s.stage, s.end - s.start, left=s.start, height=0.6, color=color[s.label], edgecolor="black",
                linewidth=0.3)
    ax.set_yticks(stages)
    ax.set_yticklabels([f"stage {s}" for s in stages])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title)
    if 1 < len(labels) <= 12:
        from matplotlib.patches import Patch
        ax.legend(handles=[Patch(color=color[lab], label=lab or "-") for lab in labels], fontsize="small",
                  loc="upper left", bbox_to_anchor=(1.01, 1))
    return _save(fig, path)


def write_report(cases: list[SweepCase], out_dir: str | Path, title: str = "tvmpipe sweep",
                 timeline: list[Span] | list[tuple] | None = None, timeline_unit: str = "ms") -> dict[str, Path]:
    """sweep.md, sweep.csv, throughput.png (and gantt.png when a timeline is given) under `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": write_csv(cases, out / "sweep.csv"),
             "throughput_png": plot_throughput(cases, out / "throughput.png", title)}
    if timeline:
        paths["gantt_png"] = plot_gantt(timeline, out / "gantt.png", unit=timeline_unit, title=f"{title}: timeline")
    model = next((c.prediction.cost_model for c in cases if c.prediction), "-")
    md = [f"# {title}", "", f"Predictions from the {model} cost model; measured columns from the cluster run.",
          "thr = throughput in samples/s; err % = (predicted - measured) / measured.", "",
          markdown_table(cases), "", "![throughput vs stages](throughput.png)"]
    if timeline:
        md.append("\n![timeline](gantt.png)")
    paths["markdown"] = out / "sweep.md"
    files.write_text(paths["markdown"], "\n".join(md) + "\n")
    return paths


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    fig.tight_layout()
    try:
        with files.atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110)
    finally:
        _pyplot().close(fig)
    return path
