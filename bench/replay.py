"""Recovery after a stage dies: replay from the upstream neighbour against replay from the driver.

    python bench/replay.py [--rounds 3] [--stages 4] [--window 8] [--time-scale 10000]

examples/cnn in K stage processes (process launcher, simulated backend: op times of the H100 model times
`--time-scale`, so a stage takes tens of ms and the figures do not depend on NumPy), 120 micro-batches; the last stage is
SIGKILLed after micro-batch 60 was submitted. Measured per run, rounds alternating between the two modes:

- recovery: fault to the first output that was not complete at the fault (the issue's figure);
- catch-up: fault to the delivery of every micro-batch that was in flight at the fault;
- recomputed: computations by the surviving stages beyond one per micro-batch (work the replay
  repeated; the restarted stage computes what it lost in both modes).

The restart itself (a new process: import, build, warm-up) costs both modes the same; what differs
is how much the replay computes again. Ratios (driver / upstream) are of the medians. Writes
bench/results/replay.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

from stamp import stamp  # when, commit, machine: bench/perfpage.py reads them

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "replay.json"
N, KILL_AT = 120, 60


def one_run(mode: str, stages: int, window: int, time_scale: float) -> dict[str, float]:
    from tvmpipe.bundle import load_bundle
    from tvmpipe.cluster.control.launchers import Timeouts
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.executor.inputs import random_micro_batches

    bundle = load_bundle(REPO / "examples" / "cnn")
    inputs = random_micro_batches(bundle, N, seed=3)
    with Pipeline(bundle, stages, launcher="process", backend="simulated", backend_opts={"time_scale": time_scale},
                  window=window, replay=mode, timeouts=Timeouts(progress=20)) as pipe:
        done: list[float] = []
        t_fault = in_flight_end = complete_at_fault = None
        for i, x in enumerate(inputs):
            pipe.submit(x)
            if i == KILL_AT:
                in_flight_end = pipe.submitted
                t_fault = time.perf_counter()
                pipe.launcher.kill(stages - 1)
                complete_at_fault = len(done) + pipe.ready  # completed before the kill took effect
            while pipe.ready or (complete_at_fault is not None and len(done) < in_flight_end):
                pipe.get()  # after the fault: wait for each in-flight one, so its time is its completion
                done.append(time.perf_counter())
        for _ in pipe.results():
            done.append(time.perf_counter())
        counts = [Counter(e.seq for e in st.events) for st in pipe.record().worker_stats]
        assert pipe.restarts[stages - 1] == 1 and len(done) == N, (pipe.restarts, len(done))
    return {"recovery_s": done[complete_at_fault] - t_fault, "catch_up_s": done[in_flight_end - 1] - t_fault,
            "recomputed": sum(n - 1 for c in counts[:-1] for n in c.values())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--time-scale", type=float, default=10000.0)
    args = ap.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"upstream": [], "driver": []}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for mode in (("upstream", "driver") if r % 2 == 0 else ("driver", "upstream")):
            runs[mode].append(one_run(mode, args.stages, args.window, args.time_scale))
            print(f"round {r} {mode:8s} " + " ".join(f"{k} {v:.3f}" for k, v in runs[mode][-1].items()), flush=True)
    load.append(os.getloadavg()[0])
    med = {m: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for m, rs in runs.items()}
    ratio = {k: med["driver"][k] / med["upstream"][k] if med["upstream"][k] else None for k in med["upstream"]}
    for m in med:
        print(f"{m:8s} median: recovery {med[m]['recovery_s']:.3f} s, catch-up {med[m]['catch_up_s']:.3f} s, "
              f"recomputed {med[m]['recomputed']:.0f}")
    print("driver / upstream: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items() if v is not None))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(stamp({"load_average": load, "config": vars(args), "runs": runs, "median": med,
                                         "driver_over_upstream": ratio}), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
