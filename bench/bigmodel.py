"""Weight-heavy models through compile and local pipelines, with the memory of every process.

    python bench/bigmodel.py                   # the ~1.5 GiB fp32 model, K = 1, 2, 4
    python bench/bigmodel.py --models 1.5g,6g  # and the ~6 GiB one (heavy: run it on a quiet machine)
    python bench/bigmodel.py --small           # a ~64 MiB stand-in, for a quick try

Each model is a stack of Linear(W, W) + ReLU layers (W = 4096: 64 MiB of fp32 weights a layer),
exported with torch.export (in a child process) and compiled with `tvmpipe compile`. Then
`tvmpipe run BUNDLE --stages K --local --json` runs it for each K with the default (streamed)
output check. Every command's process tree is sampled from /proc every 0.1 s:

  * compile peak RSS: the largest VmHWM in the compile command's tree;
  * per stage actor (the Ray workers titled ray::StageActor): its VmHWM;
  * the driver (`tvmpipe run` itself) and the check process (the streamed oracle) VmHWM;
  * all processes: the largest sum of VmRSS over the whole tree at one sample (Ray's own
    processes included);
  * time to first output (from the start of the run: Ray, stage builds, weight loads) and
    throughput, from `tvmpipe run --json`.

Results go to bench/results/bigmodel.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.support.pipeline_harness import cmdline  # noqa: E402  (the suite's /proc reader)
from stamp import stamp  # noqa: E402  (when, commit, machine: bench/perfpage.py reads them)
GIB = 1 << 30
MODELS = {  # name -> (layers, width)
    "small": (4, 2048),  # 64 MiB
    "1.5g": (24, 4096),  # 1.5 GiB
    "6g": (96, 4096),  # 6 GiB
}

EXPORT = r"""
import sys, torch
layers, width, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
mods = []
for _ in range(layers):
    mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
model = torch.nn.Sequential(*mods).eval()
with torch.no_grad():
    ep = torch.export.export(model, (torch.randn(1, width),))
torch.export.save(ep, path)
"""


def proc_status(pid: int) -> dict[str, int]:
    """VmHWM, VmRSS (KiB) and PPid of `pid` from /proc/PID/status; {} once it is gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmHWM:", "VmRSS:", "PPid:")):
                    k, v = line.split(":", 1)
                    out[k] = int(v.split()[0])
    except OSError:
        pass
    return out


def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            ppid = proc_status(int(d)).get("PPid")
            if ppid is not None:
                children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def monitored(cmd: list[str], env: dict | None = None, interval: float = 0.1) -> dict:
    """Run `cmd`, sampling its process tree; returns stdout, rc, wall and per-process peaks."""
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    peaks: dict[int, dict] = {}
    total = [0]
    cpu: list[tuple[float, int, int]] = []  # (wall clock, busy jiffies, all jiffies) of the whole machine
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            cpu.append((time.time(), *_machine_jiffies()))
            rss = 0
            for pid in _tree(proc.pid):
                st = proc_status(pid)
                if not st:
                    continue
                rss += st.get("VmRSS", 0)
                p = peaks.setdefault(pid, {"cmd": "", "hwm_kib": 0, "ppid": st.get("PPid")})
                p["hwm_kib"] = max(p["hwm_kib"], st.get("VmHWM", 0))
                title = cmdline(pid)  # Ray retitles a worker (ray::IDLE, ray::StageActor...) once it runs
                if title and title not in p["cmd"]:
                    p["cmd"] = (p["cmd"] + " | " + title)[-2000:]
            total[0] = max(total[0], rss)
            stop.wait(interval)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, err = proc.communicate()
    stop.set()
    th.join()
    return {"rc": proc.returncode, "stdout": out, "stderr": err, "wall_s": time.time() - t0, "root": proc.pid,
            "peaks": peaks, "total_peak_kib": total[0], "cpu": cpu}


def _machine_jiffies() -> tuple[int, int]:
    """(busy, all) CPU time of the whole machine so far, in clock ticks (/proc/stat; idle and iowait
    are not busy)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def cpu_between(samples: list[tuple[float, int, int]], start: float, end: float) -> tuple[float, float] | None:
    """(CPU-seconds used by the whole machine, busy fraction of all its cores) from the first
    sample at or after `start` to the last at or before `end`; None when fewer than two fall inside."""
    inside = [s for s in samples if start <= s[0] <= end]
    if len(inside) < 2:
        return None
    (_, b0, a0), (_, b1, a1) = inside[0], inside[-1]
    return (b1 - b0) / os.sysconf("SC_CLK_TCK"), (b1 - b0) / max(a1 - a0, 1)


def gib(kib: int) -> float:
    return round(kib * 1024 / GIB, 3)


def write_synthetic(out: Path, layers: int, width: int) -> int:
    """The stack as a hand-made bundle (reference backend: ops.json; kernels.cu has empty bodies),
    its weights written one tensor at a time, so writing it holds one layer at most."""
    import shutil

    import numpy as np

    from tests.support.synthetic_bundles import F, SynthGraph
    from tvmpipe.bundle.weights import WeightsWriter

    g = SynthGraph(f"synthetic_stack_{layers}x{width}")
    h = g.input("x", [1, width])
    specs = []
    for i in range(layers):
        wt, b = g.param_spec(f"w{i}", [width, width]), g.param_spec(f"b{i}", [width])
        specs += [(f"w{i}", "float32", (width, width)), (f"b{i}", "float32", (width,))]
        h = g.op(f"dense{i}", "fused_matmul_add_relu", [h, wt, b],
                 [("matmul", {"out_dtype": ""}, [{"arg": 0}, {"arg": 1}], [[1, width]], [F]),
                  ("add", {}, [{"op": 0}, {"arg": 2}], [[1, width]], [F]),
                  ("nn.relu", {}, [{"op": 1}], [[1, width]], [F])], [([1, width], F)])
    g.output(h)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.weights.safetensors"
    writer = WeightsWriter(tmp, specs)
    rng = np.random.default_rng(0)
    for name, _, shape in specs:
        writer.write(name, (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(width)).astype(np.float32))
    sums = writer.close()
    if out.exists():
        shutil.rmtree(out)
    g.build(out, weights=(tmp, sums))
    return sum(4 * int(np.prod(s)) for _, _, s in specs)


def run_model(name: str, work: Path, stages: list[int], n: int, python: str, env: dict,
              before: dict | None = None, synthetic: bool = False, repeat: int = 1) -> dict:
    layers, width = MODELS[name]
    pt2, bundle = work / f"{name}.pt2", work / f"{name}.bundle"
    rec: dict = {"model": name, "layers": layers, "width": width}
    if before is not None and (bundle / "bundle.json").is_file():  # --reuse: the bundle of an earlier run
        rec = {k: v for k, v in before.items() if k != "runs"}
        runs = {r["stages"]: r for r in before.get("runs", [])}
        for r in _runs(name, bundle, stages, n, python, env, rec["weight_bytes"], repeat):
            runs[r["stages"]] = r
        rec["runs"] = [runs[k] for k in sorted(runs)]
        return rec
    if synthetic:  # the runtime half only: a bundle written directly, weights streamed, no TVM
        print(f"[{name}] writing a synthetic bundle of {layers} x (matmul + bias + relu) ...", flush=True)
        t = time.time()
        w = write_synthetic(bundle, layers, width)
        rec.update(synthetic=True, weight_bytes=w, weight_gib=round(w / GIB, 3), write_s=round(time.time() - t, 1))
        rec["runs"] = _runs(name, bundle, stages, n, python, env, w, repeat)
        return rec
    print(f"[{name}] exporting {layers} x Linear({width}, {width}) ...", flush=True)
    t = time.time()
    subprocess.run([python, "-c", EXPORT, str(layers), str(width), str(pt2)], check=True, env=env)
    rec["export_s"] = round(time.time() - t, 1)
    print(f"[{name}] compiling ...", flush=True)
    c = monitored([python, "-m", "tvmpipe", "compile", str(pt2), "-o", str(bundle), "--force", "--quiet"], env)
    if c["rc"] != 0:
        rec["compile_error"] = c["stderr"][-2000:]
        print(c["stderr"][-2000:], file=sys.stderr)
        return rec
    pt2.unlink()
    from tvmpipe.bundle import load_bundle

    b = load_bundle(bundle)
    w = b.weight_bytes
    rec.update(weight_bytes=w, weight_gib=round(w / GIB, 3), compile_s=round(c["wall_s"], 1),
               compile_peak_rss_gib=gib(max(p["hwm_kib"] for p in c["peaks"].values())),
               compile_peak_over_weights=round(max(p["hwm_kib"] for p in c["peaks"].values()) * 1024 / w, 2))
    print(f"[{name}] weights {w / GIB:.2f} GiB, compile {c['wall_s']:.0f} s, peak {rec['compile_peak_rss_gib']} GiB",
          flush=True)
    rec["runs"] = _runs(name, bundle, stages, n, python, env, w, repeat)
    return rec


def _runs(name: str, bundle: Path, stages: list[int], n: int, python: str, env: dict, w: int, repeat: int) -> list[dict]:
    """Every K `repeat` times, interleaved (K = 1, 2, 4, 1, 2, 4, ...) so that the machine's other
    load falls on every K alike. Per K: the first run's record, with time to first output and
    throughput as the median over the repeats (each run's kept in `*_runs`), and each memory peak
    as the largest seen. On this 2-core machine one run's time to first output varies by a second."""
    import statistics

    seen: dict[int, list[dict]] = {k: [] for k in stages}
    for _ in range(repeat):
        for k in stages:
            seen[k].append(_run(name, bundle, k, n, python, env, w))
    out = []
    for k in stages:
        runs = [r for r in seen[k] if "error" not in r] or seen[k][:1]
        one = dict(runs[0])
        for key in ("time_to_first_output_s", "stages_and_first_output_s", "stages_window_cpu_s",
                    "stages_window_cpu_busy", "throughput_mb_per_s", "steady_throughput_mb_per_s", "latency_p50_ms"):
            if one.get(key) is not None and all(r.get(key) is not None for r in runs):
                vals = [r[key] for r in runs]
                one[key] = round(statistics.median(vals), 3)
                one[key + "_runs"] = vals
        for key in ("stage_peak_rss_gib",):
            if key in one:
                one[key] = [max(vals) for vals in zip(*(r[key] for r in runs))]
        for key in ("driver_peak_rss_gib", "check_peak_rss_gib", "all_processes_peak_gib"):
            if one.get(key) is not None:
                one[key] = max(r[key] for r in runs if r.get(key) is not None)
        one["match"] = all(r.get("match") for r in seen[k])
        one["repeats"] = len(seen[k])
        one["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
        out.append(one)
    if 1 in seen and max(stages) > 1:
        for key, what in (("time_to_first_output_s", "time to first output"),
                          ("stages_and_first_output_s", "its part that depends on K (stages + first output)")):
            t = {r["stages"]: r.get(key) for r in out}
            print(f"[{name}] {what}, median of {repeat}: " + ", ".join(f"K={k} {v} s" for k, v in t.items())
                  + f"; K={max(stages)} no worse than K=1: {'PASS' if (t[max(stages)] or 1e9) <= (t[1] or 0) else 'FAIL'}",
                  flush=True)
        print(f"[{name}] meanwhile the machine (median of {repeat}): " + ", ".join(
            f"K={r['stages']} {r.get('stages_window_cpu_s')} CPU-s, {r.get('stages_window_cpu_busy')} of its cores busy"
            for r in out), flush=True)
    return out


def _run(name: str, bundle: Path, k: int, n: int, python: str, env: dict, w: int) -> dict:
    print(f"[{name}] run K={k} ...", flush=True)
    r = monitored([python, "-m", "tvmpipe", "run", str(bundle), "--stages", str(k), "--local", "-n", str(n),
                   "--json", "--check", "streamed"], env)
    one: dict = {"stages": k, "rc": r["rc"], "wall_s": round(r["wall_s"], 1)}
    try:
        summary = json.loads(r["stdout"][r["stdout"].index("{"):])
    except ValueError:
        one["error"] = (r["stderr"] or r["stdout"])[-2000:]
        print(one["error"], file=sys.stderr)
        return one
    m = summary["metrics"]
    actors = sorted(((p["hwm_kib"], pid) for pid, p in r["peaks"].items() if "StageActor" in p["cmd"]),
                    reverse=True)
    root = r["root"]
    check = [p["hwm_kib"] for pid, p in r["peaks"].items()
             if p.get("ppid") == root and "multiprocessing" in p["cmd"]]
    weights = [s.get("weight_bytes") for s in m["stages"]]
    phases = summary.get("startup_s") or {}
    window = None  # the part of the time to first output that depends on K: stages up, first micro-batch
    if summary.get("started_at") and summary.get("time_to_first_output_s") and "cluster" in phases:
        window = cpu_between(r["cpu"], summary["started_at"] + phases["cluster"],
                             summary["started_at"] + summary["time_to_first_output_s"])
    one.update(
        match=summary["match"], check=summary.get("check"), micro_batches=summary["micro_batches"],
        time_to_first_output_s=round(summary.get("time_to_first_output_s") or 0, 2),
        # the part of it that depends on K: stage processes up, weights read, wired, first micro-batch
        # through (without Ray's own start, the same code at every K, which varies by a second)
        stages_and_first_output_s=round(sum(v for key, v in (summary.get("startup_s") or {}).items()
                                            if key in ("stages", "first_output")), 2),
        # how busy the machine was meanwhile: all its cores busy means that part is CPU-bound here
        stages_window_cpu_s=round(window[0], 2) if window else None,
        stages_window_cpu_busy=round(window[1], 2) if window else None,
        throughput_mb_per_s=round(m["throughput"], 3), steady_throughput_mb_per_s=round(m["steady_throughput"], 3),
        latency_p50_ms=round(m["latency_p50_ms"], 1),
        stage_weight_gib=[gib((x or 0) // 1024) for x in weights],
        stage_peak_rss_gib=[gib(h) for h, _ in actors[:k]],
        stage_target_gib=round(w / k / GIB + 0.45, 3),
        driver_peak_rss_gib=gib(r["peaks"][root]["hwm_kib"]),
        check_peak_rss_gib=gib(max(check)) if check else None,
        all_processes_peak_gib=gib(r["total_peak_kib"]),
        all_target_gib=round(2 * w / GIB, 3),
    )
    print(f"[{name}] K={k}: {json.dumps(one)}", flush=True)
    return one


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="1.5g", help="comma-separated: small, 1.5g, 6g (default 1.5g)")
    p.add_argument("--small", action="store_true", help="only the small model (quick)")
    p.add_argument("--stages", default="1,2,4")
    p.add_argument("-n", "--micro-batches", type=int, default=16)
    p.add_argument("--work", default=None, help="where the .pt2 and bundles go (default: a temp dir, removed)")
    p.add_argument("--keep", action="store_true", help="keep the bundles")
    p.add_argument("--synthetic", action="store_true",
                   help="write the models' bundles directly (no torch.export, no TVM compile): the runtime half "
                        "of the bench where the compiler cannot fit a model in memory; results under '<model>-synthetic'")
    p.add_argument("--reuse", action="store_true", help="with --work: run the bundles an earlier run left there "
                   "again (no export or compile; the other stage counts' results are kept)")
    p.add_argument("--repeat", type=int, default=3, help="runs per K, interleaved; times are their median (default 3)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "bigmodel.json"))
    args = p.parse_args(argv)
    models = ["small"] if args.small else args.models.split(",")
    stages = [int(s) for s in args.stages.split(",")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x])}
    work = Path(args.work or tempfile.mkdtemp(prefix="tvmpipe-bigmodel-"))
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else {}
    results.setdefault("machine", {"cpus": os.cpu_count(),
                                   "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1)})
    results.setdefault("models", {})
    try:
        for name in models:
            key = f"{name}-synthetic" if args.synthetic else name
            before = results["models"].get(key, {}) if args.reuse else None
            results["models"][key] = run_model(name, work, stages, args.micro_batches, sys.executable, env, before,
                                               args.synthetic, args.repeat)
            results["models"][key]["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(stamp(results), indent=1) + "\n")
    finally:
        if not args.keep and not args.work:
            import shutil
            shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
