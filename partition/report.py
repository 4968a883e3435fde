"""Sweep reports: predicted against measured, as markdown, CSV and PNG plots.

Plots use matplotlib's Agg backend (imported on first use), so a report can be written on a
headless cluster node and `tvmpipe partition` never pays for importing matplotlib.
"""

from __future__ import annotations

import csv
import textwrap
from dataclasses import dataclass
from pathlib import Path

from tvmpipe.core import files
from tvmpipe.partition.predict import Prediction
from tvmpipe.partition.runtime import RuntimeCosts
from tvmpipe.partition.sweep import Measured, SweepCase

COLUMNS = ["stages", "strategy", "cuts", "pred_throughput", "meas_throughput", "throughput_error_pct",
           "pred_latency_us", "meas_latency_p50_us", "meas_latency_p99_us", "pred_bubble", "meas_bubble",
           "pred_bottleneck_us", "bytes_moved", "error", "rounds", "meas_throughput_min", "meas_throughput_max",
           "meas_bubble_min", "meas_bubble_max", "pred_period_us", "limit", "oversubscribed", "load_max", "measured_by",
           "pred_cpu_us", "meas_cpu_us", "pred_cores_busy", "meas_cores_busy"]


@dataclass(frozen=True)
class Span:
    """One bar of a timeline: `stage` busy from `start` to `end` (any one time unit) with `label`."""

    stage: int
    start: float
    end: float
    label: str | int = ""  # an int is a micro-batch number


TIE = 1e-3  # measured throughputs this close (relative) are one rate: float noise, or a shared bottleneck op


def fastest(cases: list[SweepCase], tie: float = TIE) -> SweepCase | None:
    """The plan a report draws: the highest measured throughput, and among plans within `tie` of it the
    one with the fewest stages (on a what-if cluster K = 56..64 can all reach one bottleneck op's rate;
    the Gantt chart then shows K = 56, not whichever K float noise put first)."""
    done = [c for c in cases if c.measured and c.measured.throughput]
    if not done:
        return None
    top = max(c.measured.throughput for c in done)
    return min((c for c in done if c.measured.throughput >= top * (1 - tie)), key=lambda c: (c.stages, -c.measured.throughput))


def case_row(case: SweepCase) -> dict[str, object]:
    p, m = case.prediction, case.measured
    row: dict[str, object] = {c: None for c in COLUMNS}
    row.update(stages=case.stages, strategy=case.strategy, error=case.error)
    if case.plan is not None:
        row["cuts"] = " ".join(f"[{s},{e})" for s, e in case.plan.stages)
    if p is not None:
        row.update(pred_throughput=p.throughput, pred_latency_us=p.latency_us, pred_bubble=p.bubble,
                   pred_bottleneck_us=p.bottleneck_us, bytes_moved=p.bytes_moved, pred_period_us=p.period_us,
                   limit=p.limit, oversubscribed=p.oversubscribed)
        if p.host_cpu:  # the ideal runtime models no host CPU
            row.update(pred_cpu_us=p.cpu_us, pred_cores_busy=p.cpu_demand)
    if m is not None:
        row.update(meas_throughput=m.throughput, meas_latency_p50_us=m.latency_p50_us,
                   meas_latency_p99_us=m.latency_p99_us, meas_bubble=m.bubble, rounds=m.rounds,
                   measured_by=m.source, load_max=m.load[1] if m.load else None, meas_cpu_us=m.cpu_us,
                   meas_cores_busy=m.cores_busy)
        if m.throughput_range:
            row.update(meas_throughput_min=m.throughput_range[0], meas_throughput_max=m.throughput_range[1])
        if m.bubble_range:
            row.update(meas_bubble_min=m.bubble_range[0], meas_bubble_max=m.bubble_range[1])
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


def _range(r: tuple[float, float] | None, scale: float = 1.0, fmt: str = "{:.4g}") -> str:
    return "-" if r is None else f"{fmt.format(r[0] * scale)}-{fmt.format(r[1] * scale)}"


def within_target(case: SweepCase, throughput_pct: float = 10.0, bubble_points: float = 10.0) -> bool | None:
    """Prediction within the targets (throughput %, bubble points) of the measured median; None where
    the targets do not apply (not measured, or more processes than cores: CPU-bound by design)."""
    p, m = case.prediction, case.measured
    if p is None or m is None or not m.throughput or p.oversubscribed:
        return None
    ok = abs(p.throughput - m.throughput) / m.throughput * 100 <= throughput_pct
    return ok and (m.bubble is None or abs(p.bubble - m.bubble) * 100 <= bubble_points)


def markdown_table(cases: list[SweepCase], measured_label: str = "meas") -> str:
    ml = measured_label
    head = ["K", "strategy", "pred thr/s", f"{ml} thr/s (median)", "min-max", "rounds", "err %", "pred bubble %",
            f"{ml} bubble %", "bubble min-max", "limit", "CPU cores", "CPU us/mb", "in target", "stages [start,end)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cases:
        row, p, m = case_row(c), c.prediction, c.measured
        ok = within_target(c)
        cells = [str(c.stages), c.strategy, _fmt(row["pred_throughput"]), _fmt(row["meas_throughput"]),
                 _range(m.throughput_range) if m else "-", str(m.rounds) if m else "-",
                 "-" if row["throughput_error_pct"] is None else f"{row['throughput_error_pct']:+.1f}",
                 "-" if p is None else f"{100 * p.bubble:.1f}",
                 "-" if m is None or m.bubble is None else f"{100 * m.bubble:.1f}",
                 _range(m.bubble_range, 100, "{:.0f}") if m else "-",
                 p.limit if p else "-",
                 _cpu_cores(p, m), _cpu_per_batch(p, m),
                 {None: "n/a", True: "yes", False: "no"}[ok], _fmt(row["cuts"])]
        if c.error:
            cells[-1] = f"not planned: {c.error.splitlines()[0]}"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cpu_bound_cases(cases: list[SweepCase]) -> list[SweepCase]:
    """Rows with more processes (stages + driver) than cores: not held to the targets (within_target)."""
    return [c for c in cases if c.prediction and c.prediction.oversubscribed]


def _cpu_cores(p: Prediction | None, m: Measured | None) -> str:
    """Cores busy: predicted, then measured where read, of the machine's cores (free: what other processes left).
    Nothing without runtime costs: the ideal runtime (what-if clusters) models no host CPU."""
    if p is None or not p.host_cpu:
        return "-"
    text = f"{p.cpu_demand:.2f}" + (f", meas {m.cores_busy:.2f}" if m is not None and m.cores_busy is not None else "")
    if p.cores:
        text += f" of {p.cores}" + (f" ({p.cores_free:.2f} free)" if p.cores_free is not None else "")
    return text + (" oversubscribed" if p.oversubscribed else "")


def _cpu_per_batch(p: Prediction | None, m: Measured | None) -> str:
    """Host CPU per micro-batch of the whole pipeline (stages + driver), predicted / measured."""
    if p is None or not p.host_cpu or not p.cpu_us:
        return "-"
    return f"{p.cpu_us:.0f}" + (f" / {m.cpu_us:.0f}" if m is not None and m.cpu_us is not None else "")


def cpu_bound_lines(cases: list[SweepCase]) -> list[str]:
    """What the report says of rows with more processes than cores: why they are not judged, and, where
    the CPU was read, how much CPU per micro-batch they really took against the prediction's, and how many
    cores they kept busy: the evidence for why such a row's prediction misses."""
    bound = cpu_bound_cases(cases)
    if not bound:
        return []
    text = (f"**CPU-bound runs**: {len(bound)} row(s) run more processes (stages + driver) than cores; their "
            "predictions assume an even share of the cores at the CPU per micro-batch the 1-stage calibration "
            "measured, so they are not held to the targets.")
    read = [c for c in bound if c.measured and c.measured.cpu_us is not None and c.prediction.cpu_us > 0]
    if read:
        text += " Measured CPU per micro-batch (stages + driver) against the predicted: " + "; ".join(
            f"K={c.stages} {c.strategy} {c.measured.cpu_us:.0f} vs {c.prediction.cpu_us:.0f} us "
            f"(x{c.measured.cpu_us / c.prediction.cpu_us:.2f}"
            + (f", {c.measured.cores_busy:.2f} of {c.prediction.cores} cores busy" if c.measured.cores_busy is not None else "")
            + ")" for c in read) + ". The model's even share of the cores fails both ways: above x1, processes that " \
            "take turns on a core spend more CPU on the same work than the calibration, whose stage had a core to " \
            "itself; and fewer cores busy than there are means the processes waited on each other with a core idle."
    return [text]


@dataclass(frozen=True)
class SamePlan:
    """Two or more rows of one sweep that run the very same stages (e.g. `equal` and `optimal` at K = 1,
    or wherever both strategies cut alike): their measured spread is this machine's run-to-run noise
    between two pipelines of one plan, the floor under which a prediction error cannot be told apart."""

    stages: tuple[tuple[int, int], ...]
    rows: tuple[str, ...]  # "K=1 equal", ...
    throughputs: tuple[float, ...]

    @property
    def spread_pct(self) -> float:
        """(max - min) / min of the measured medians, in percent."""
        return 100.0 * (max(self.throughputs) - min(self.throughputs)) / min(self.throughputs)


def same_plans(cases: list[SweepCase]) -> list[SamePlan]:
    """Measured rows grouped by identical stage ranges, groups of two or more, in sweep order."""
    groups: dict[tuple[tuple[int, int], ...], list[SweepCase]] = {}
    for c in cases:
        if c.plan is not None and c.measured is not None and c.measured.throughput:
            groups.setdefault(tuple(map(tuple, c.plan.stages)), []).append(c)
    return [SamePlan(key, tuple(f"K={c.stages} {c.strategy}" for c in group),
                     tuple(c.measured.throughput for c in group))
            for key, group in groups.items() if len(group) > 1]


def noise_lines(cases: list[SweepCase]) -> list[str]:
    """One line per same-plan group: what the noise floor of this run was."""
    return [f"Same plan measured {len(g.rows)} times ({', '.join(g.rows)}): "
            + " vs ".join(f"{t:.0f}/s" for t in g.throughputs)
            + f", {g.spread_pct:.0f} % apart: run-to-run noise between pipelines of one plan on this machine; "
              "a prediction error below it is not resolved." for g in same_plans(cases)]


def _wrap(title: str, width: int = 70) -> str:
    return textwrap.fill(title, width)


def plot_throughput(cases: list[SweepCase], path: str | Path, title: str = "throughput vs stages",
                    measured_label: str = "measured") -> Path:
    """Predicted (dashed) against measured (markers, error bars min-max over rounds) throughput and
    bubble, against stage count, one colour per strategy."""
    plt = _pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4.2))
    strategies = list(dict.fromkeys(c.strategy for c in cases))
    for i, s in enumerate(strategies):
        color, off = f"C{i}", (i - (len(strategies) - 1) / 2) * 0.06
        mine = [c for c in cases if c.strategy == s]
        for axis, pick, rng, scale in ((ax, lambda p: p.throughput, lambda m: m.throughput_range, 1.0),
                                       (bx, lambda p: p.bubble, lambda m: m.bubble_range, 100.0)):
            pred = [(c.stages + off, pick(c.prediction) * scale) for c in mine if c.prediction]
            if pred:
                axis.plot(*zip(*pred), "--o", color=color, mfc="none", label=f"{s} predicted")
            meas = [c for c in mine if c.measured]
            if meas:
                xs = [c.stages + off for c in meas]
                ys = [(c.measured.throughput if axis is ax else (c.measured.bubble or 0.0)) * scale for c in meas]
                lo = [y - (rng(c.measured)[0] * scale if rng(c.measured) else y) for c, y in zip(meas, ys)]
                hi = [(rng(c.measured)[1] * scale if rng(c.measured) else y) - y for c, y in zip(meas, ys)]
                axis.errorbar(xs, ys, yerr=[lo, hi], fmt="s", color=color, capsize=4, label=f"{s} {measured_label}")
    bound = cpu_bound_cases(cases)
    shaded = ""
    if bound:  # the stage counts not held to the targets, shaded so the eye does not judge them as the others
        ks = [c.stages for c in bound]
        for axis in (ax, bx):
            axis.axvspan(min(ks) - 0.4, max(ks) + 0.4, color="0.9", zorder=0, lw=0)
        shaded = f"\nshaded: CPU-bound, stages + driver > {bound[0].prediction.cores} cores"
    ax.set_ylabel("throughput (samples/s)")
    bx.set_ylabel("bubble (% of stage time not computing)")
    bx.set_ylim(0, 100)
    ks = sorted({c.stages for c in cases})
    for axis, sub in ((ax, "throughput"), (bx, "bubble")):
        axis.set_xlabel("pipeline stages")
        axis.set_title(sub + shaded, fontsize="medium")
        axis.grid(alpha=0.3)
        if ks:
            axis.set_xticks(ks if len(ks) <= 16 else ks[:: max(1, len(ks) // 12)])
    if strategies:
        ax.legend(fontsize="small")
    spread = any(c.measured and c.measured.throughput_range for c in cases)  # one simulated run has no rounds
    fig.suptitle(_wrap(title + (" (markers: median, bars: min-max over rounds)" if spread else "")), fontsize="medium")
    return _save(fig, path)


GANTT_WINDOW = 20  # micro-batches in the steady-state window
GANTT_ROWS = 16  # stages drawn at most: 64 rows of 20 labelled bars read as noise (and took 5 s to draw)


def gantt_rows(stages: list[int], most: int = GANTT_ROWS) -> list[int]:
    """The stages a Gantt chart draws: all of them up to `most`, else every n-th and the last."""
    if len(stages) <= most:
        return stages
    step = -(-(len(stages) - 1) // (most - 1))
    picked = stages[::step]
    return picked if picked[-1] == stages[-1] else picked + [stages[-1]]


def steady_window(spans: list[Span], size: int = GANTT_WINDOW) -> list[Span]:
    """The spans of `size` consecutive micro-batches (labels are micro-batch numbers) whose window
    lasts the median time of all such windows after the first and before the last `size`: typical
    steady state, neither the fill nor a stall that a loaded machine puts somewhere in a long run."""
    seqs = sorted({s.label for s in spans if isinstance(s.label, int)})
    if not seqs or len(seqs) <= size:
        return spans
    first = {q: float("inf") for q in seqs}
    last = {q: float("-inf") for q in seqs}
    for s in spans:
        if isinstance(s.label, int):
            first[s.label] = min(first[s.label], s.start)
            last[s.label] = max(last[s.label], s.end)
    starts = range(size, len(seqs) - 2 * size + 1) if len(seqs) >= 3 * size + 1 else range(len(seqs) - size + 1)
    durations = sorted((max(last[q] for q in seqs[i:i + size]) - min(first[q] for q in seqs[i:i + size]), i)
                       for i in starts)
    i = durations[len(durations) // 2][1]
    keep = set(seqs[i:i + size])
    return [s for s in spans if s.label in keep]


def span_utilisation(spans: list[Span]) -> dict[int, tuple[float, float, float]]:
    """Per stage (busy, bubble, idle) over the spans' whole extent (cluster/metrics.py's definitions)."""
    if not spans:
        return {}
    t0, t1 = min(s.start for s in spans), max(s.end for s in spans)
    wall = max(t1 - t0, 1e-12)
    out = {}
    for st in sorted({s.stage for s in spans}):
        mine = [s for s in spans if s.stage == st]
        busy = sum(s.end - s.start for s in mine)
        fd = (min(s.start for s in mine) - t0) + (t1 - max(s.end for s in mine))
        out[st] = (busy / wall, fd / wall, max(0.0, 1 - (busy + fd) / wall))
    return out


def plot_gantt(spans: list[Span] | list[tuple], path: str | Path, unit: str = "ms",
               title: str = "pipeline timeline", utilisation: dict[int, tuple[float, float, float]] | None = None,
               window: int = GANTT_WINDOW) -> Path:
    """Left: a steady-state window of `window` micro-batches, one row per stage, each bar labelled with
    its micro-batch (labels that are ints are micro-batch numbers; others are drawn as given). Right:
    per-stage busy / bubble (fill and drain) / idle over the whole run (`utilisation`, else from the spans)."""
    plt = _pyplot()
    spans = [s if isinstance(s, Span) else Span(*s) for s in spans]
    util = utilisation if utilisation is not None else span_utilisation(spans)
    every = sorted({s.stage for s in spans})
    stages = gantt_rows(every)
    rows = set(stages)
    shown = [s for s in steady_window(spans, window) if s.stage in rows]
    clip = None
    if len(stages) < len(every) and shown:  # deep: 20 micro-batches cross it diagonally, bars too thin to label
        ref = max(stages, key=lambda st: util.get(st, (0.0, 0.0, 0.0))[0])  # so: a time window, the busiest
        mine = [s for s in shown if s.stage == ref] or shown  # drawn stage's 20 micro-batches, every row in it
        clip = (min(s.start for s in mine), max(s.end for s in mine))
        shown = [s for s in spans if s.stage in rows and s.end > clip[0] and s.start < clip[1]]
    pos = {st: i for i, st in enumerate(stages)}
    height = 0.5 * max(len(stages), 1) + 2.0
    fig, (ax, ux) = plt.subplots(1, 2, figsize=(12, height), gridspec_kw={"width_ratios": [3, 1]}, sharey=True)
    cmap = plt.get_cmap("tab10")
    labels = list(dict.fromkeys(s.label for s in shown))
    color = {lab: cmap(i % 10) for i, lab in enumerate(labels)}
    t0 = clip[0] if clip else min((s.start for s in shown), default=0.0)
    extent = (clip[1] if clip else max((s.end for s in shown), default=1.0)) - t0 or 1.0
    ax.barh([pos[s.stage] for s in shown], [s.end - s.start for s in shown], left=[s.start - t0 for s in shown],
            height=0.6, color=[color[s.label] for s in shown], edgecolor="black", linewidth=0.4)
    gap = 0.012 * extent  # a rotated label's width at fontsize 6 on this figure, in the window's time unit
    last: dict[int, float] = {}  # per row: where its last drawn label ends
    bunched = False
    for s in sorted(shown, key=lambda s: s.start):
        mid = (max(s.start, t0) + min(s.end, t0 + extent)) / 2 - t0
        wide = (s.end - s.start) / extent > 0.011 * len(str(s.label))
        half = (0.0055 * len(str(s.label)) * extent) if wide else gap / 2
        visible = min(s.end, t0 + extent) - max(s.start, t0)
        if visible < 2 * half and (s.start < t0 or s.end > t0 + extent):
            continue  # a sliver cut by the window's edge: its label would stand on the next bar's
        if mid - half < last.get(s.stage, float("-inf")):  # bars bunched closer than their labels: the colour
            bunched = True  # says which micro-batch it is (the same colour in every row), a label would overprint
            continue
        last[s.stage] = mid + half
        ax.text(mid, pos[s.stage], str(s.label), ha="center", va="center", fontsize=7 if wide else 6,
                rotation=0 if wide else 90, clip_on=True)
    if clip:
        ax.set_xlim(0, extent)
    ax.set_yticks(range(len(stages)))
    ax.set_yticklabels([f"stage {s}" for s in stages])
    ax.invert_yaxis()
    ints = [lab for lab in labels if isinstance(lab, int)]
    if clip:
        what = f"{extent:.0f} {unit} of steady state (stage {ref}'s micro-batches {min(s.label for s in mine)}-" \
               f"{max(s.label for s in mine)})"
    else:
        what = f"micro-batches {min(ints)}-{max(ints)}" if ints else "spans"
    ax.set_xlabel(f"time ({unit}) from the window's start; bars labelled with their micro-batch"
                  + ("\n(bunched bars by colour alone: one colour per micro-batch in every row)" if bunched else ""))
    subset = f"; {len(stages)} of {len(every)} stages ({', '.join(map(str, stages[:3]))}, ..., {stages[-1]})" \
        if len(stages) < len(every) else ""
    ax.set_title(_wrap(f"{title}: {what}{subset}", 80), fontsize="medium")
    parts = (("busy", "C2"), ("bubble (fill/drain)", "C1"), ("idle", "0.8"))
    values = [util.get(st, (0.0, 0.0, 0.0)) for st in stages]
    left = [0.0] * len(stages)
    for i, (name, col) in enumerate(parts):
        width = [100 * v[i] for v in values]
        ux.barh(range(len(stages)), width, left=left, height=0.6, color=col, label=name)
        left = [a + b for a, b in zip(left, width)]
    for i, v in enumerate(values):
        ux.text(1, i, f"{100 * v[0]:.0f}%", va="center", fontsize=7)
    ux.set_xlim(0, 100)
    ux.set_xlabel("% of the whole run")
    ux.set_title("whole run: busy / bubble / idle", fontsize="medium")
    fig.legend(*ux.get_legend_handles_labels(), fontsize="small", loc="lower right", ncol=3)
    return _save(fig, path, rect=(0, 0.1, 1, 1))


def write_report(cases: list[SweepCase], out_dir: str | Path, title: str = "tvmpipe sweep",
                 timeline: list[Span] | list[tuple] | None = None, timeline_unit: str = "ms",
                 timeline_title: str | None = None, runtime: RuntimeCosts | None = None,
                 measured_label: str = "measured", notes: list[str] | None = None) -> dict[str, Path]:
    """sweep.md, sweep.csv, throughput.png (and gantt.png when a timeline is given) under `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": write_csv(cases, out / "sweep.csv"),
             "throughput_png": plot_throughput(cases, out / "throughput.png", title, measured_label)}
    util = None
    if timeline:
        best = fastest(cases)
        util = dict(enumerate(best.measured.utilisation)) if best and best.measured.utilisation else None
        paths["gantt_png"] = plot_gantt(timeline, out / "gantt.png", unit=timeline_unit,
                                        title=timeline_title or "timeline", utilisation=util)
    model = next((c.prediction.cost_model for c in cases if c.prediction), "-")
    md = [f"# {title}", "", f"Predictions from the {model} cost model; `{measured_label}` columns from "
          + ("the event simulator (partition/simulate.py) over the same model." if measured_label == "simulated"
             else "the pipeline runs."),
          "thr = throughput in samples/s, median over rounds with min-max; err % = (predicted - measured) / measured; "
          "bubble = % of stage time not computing; limit = what sets the predicted pace (stage, driver, cpu: the "
          "shared cores, window); CPU cores = cores busy at the predicted rate, then as measured, of the cores (free: left by other processes); CPU us/mb = host CPU per micro-batch of the stage processes and the driver, predicted / measured; in target = throughput within 10 % "
          "and bubble within 10 points (n/a where stage processes + driver outnumber the cores).", ""]
    if runtime is not None and not runtime.is_zero:
        md += [f"Runtime costs ({runtime.source}): receive {runtime.recv_us:.1f} us and send {runtime.send_us:.1f} us "
               f"per frame, Stage.run {runtime.run_us:.1f} us, driver {runtime.driver_us:.1f} us per micro-batch"
               + (f", op times x{runtime.compute_scale:.2f} in a pipelining worker than in the profile"
                  if runtime.compute_scale != 1.0 else "")
               + (f", of which the stage spent {100 * runtime.cpu_share:.0f} % on a core (the rest waiting for one)"
                  if runtime.cpu_share < 1 else "")
               + (f", {runtime.cores} cores shared by the stage processes and the driver" if runtime.cores else "")
               + (f", of which {runtime.cores_free:.2f} left by other processes during the calibration"
                  if runtime.cores and runtime.cores_free is not None else "") + "."
               + (" These chose the plans; each row is predicted from the calibration rounds paired with its own "
                  "rounds, one right before or after each (figures in its plans/*.json)." if runtime.source == "calibrated" else ""), ""]
    for note in notes or []:
        md += [note, ""]
    loads = [c.measured.load for c in cases if c.measured and c.measured.load]
    if loads:
        md += [f"Load average during the runs: {min(lo for lo, _ in loads):.1f}-{max(hi for _, hi in loads):.1f}.", ""]
    for line in cpu_bound_lines(cases):
        md += [line, ""]
    noise = noise_lines(cases) if measured_label == "measured" else []
    if noise:
        md += ["**Noise floor**: " + " ".join(noise), ""]
    md += [markdown_table(cases, "meas" if measured_label == "measured" else measured_label), "",
           "![predicted vs measured](throughput.png)"]
    if timeline:
        md.append("\n![timeline: a steady-state window and per-stage busy/bubble/idle](gantt.png)")
    paths["markdown"] = out / "sweep.md"
    files.write_text(paths["markdown"], "\n".join(md) + "\n")
    return paths

def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path, rect: tuple[float, float, float, float] = (0, 0, 1, 1)) -> Path:
    path = Path(path)
    fig.tight_layout(rect=rect)
    try:
        with files.atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110)
    finally:
        _pyplot().close(fig)
    return path
