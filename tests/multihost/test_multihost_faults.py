"""Faults across hosts, mid-run of 200 micro-batches on a 2-stage pipeline (one GPU stage per worker
host, a third worker host spare):

- a worker host crashes (every process on it SIGKILLed: raylet, object store, the stage's actor):
  the lost stage is placed again on the surviving spare host and every output arrives once, in
  order, equal to a clean run;
- a host's link goes down for a few seconds and comes back: the run recovers, or fails with an
  error naming the stage and its host, within the configured timeouts, completed outputs kept;
- the head's Ray dies under a running job: the job ends with error.json and what completed.

Recovery time (fault to the first output after it that needed the recovery) is printed: run with
`-s` to see it. The driver paces its submissions so the fault lands mid-run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from oraclecheck import assert_matches_oracle
from raybed import RayBed, drive
from tvmpipe.bundle import load_bundle
from tvmpipe.app.oracle import reference_outputs
from tvmpipe.executor.inputs import random_micro_batches

N = 200
FAULT_AT = 40  # the fault strikes when this micro-batch's outputs arrive
TIMEOUTS = {"call": 10.0, "progress": 8.0, "start": 60.0}
LINK_DOWN_S = 3.0


@pytest.fixture(scope="module")
def clean(raybed: RayBed) -> np.ndarray:
    bundle = raybed.head_only / "mlp"
    return np.stack([o[0] for o in reference_outputs(bundle, random_micro_batches(load_bundle(bundle), N, 7))])


def _faulty_run(bed: RayBed, tmp_path: Path, strike) -> tuple[dict, dict, str]:
    """Run N micro-batches with a fault struck by `strike(victim_host)` on stage 1's host when
    micro-batch FAULT_AT completes. Returns (end event, measurements, stderr)."""
    by_addr = {h.address: h for h in bed.net.hosts}
    seen: dict = {"outputs": []}

    def on_event(ev: dict) -> None:
        if ev["event"] == "ready":
            seen["before"] = [a[0] for a in ev["addresses"]]
        elif ev["event"] == "output":
            seen["outputs"].append((ev["seq"], ev["t"]))
            if ev["seq"] == FAULT_AT:
                seen["victim"] = by_addr[seen["before"][1]]
                seen["t_fault"] = time.time()
                strike(seen["victim"])

    cfg = {"bundle": str(bed.head_only / "mlp"), "stages": 2, "gpus": 1.0, "n": N, "seed": 7, "pace_s": 0.02,
           "out": str(tmp_path / "out.npz"), "timeouts": TIMEOUTS, "max_restarts": 4}
    events, err = drive(bed, cfg, on_event, timeout=240)
    assert events and events[-1]["event"] == "end", err[-3000:]
    seqs = [s for s, _ in seen["outputs"]]
    assert seqs == list(range(len(seqs))), "outputs not delivered once each, in order"
    after = [(s, t) for s, t in seen["outputs"] if t > seen["t_fault"]]
    if after:  # the output after the longest silence since the fault is the first one recovery made
        times = [seen["t_fault"]] + [t for _, t in after]
        gap = max(range(1, len(times)), key=lambda i: times[i] - times[i - 1])
        seen["recovery_s"] = times[gap] - seen["t_fault"]
    return events[-1], seen, err


def test_worker_host_crash(bed: RayBed, tmp_path: Path, clean: np.ndarray):
    end, seen, err = _faulty_run(bed, tmp_path, lambda host: host.kill_all())
    assert end["error"] is None, f"{end}\n{err[-3000:]}"
    got = np.load(tmp_path / "out.npz")["output0"]
    assert_matches_oracle(got, clean, bed.env)  # all 200, in order, each once (shape exact)
    victim = seen["victim"].address
    assert end["restarts"][1] >= 1 and any(f"host {victim}" in e for e in end["errors"]), end
    now = [a[0] for a in end["addresses"]]
    assert now[1] not in (victim, now[0], bed.head.address), f"stage 1 re-placed on {now[1]} (was {victim})"
    print(f"\nworker host crash: recovery {seen['recovery_s']:.2f} s (fault to first new output); "
          f"stage 1 moved {victim} -> {now[1]}; errors: {end['errors']}")


def test_link_down_then_up(bed: RayBed, tmp_path: Path, clean: np.ndarray):
    def unplug(host):
        host.link(False)
        threading.Timer(LINK_DOWN_S, host.link, (True,)).start()

    t0 = time.time()
    end, seen, err = _faulty_run(bed, tmp_path, unplug)
    took = time.time() - seen["t_fault"]
    out = tmp_path / "out.npz"
    got = np.load(out)["output0"] if out.exists() else np.zeros((0,) + clean.shape[1:], clean.dtype)
    assert_matches_oracle(got, clean[:len(got)], bed.env)  # whatever completed is kept, in order
    if end["error"] is not None:
        victim = seen["victim"].address
        assert "stage 1" in end["error"]["message"] and victim in end["error"]["message"], end["error"]
    else:
        assert len(got) == N
    budget = LINK_DOWN_S + TIMEOUTS["progress"] + 2 * TIMEOUTS["call"] + TIMEOUTS["start"]
    assert took < budget, f"{took:.1f} s from the fault to the end of the run (budget {budget:.0f} s)"
    print(f"\nlink down {LINK_DOWN_S:.0f} s: {'recovered' if end['error'] is None else 'failed: ' + end['error']['message']}"
          f" after {seen.get('recovery_s', float('nan')):.2f} s; run ended {took:.1f} s after the fault "
          f"({time.time() - t0:.1f} s in all); errors: {end['errors']}")


def test_head_failure_leaves_error_json(bed: RayBed, tmp_path: Path, clean: np.ndarray):
    """The head's Ray (GCS, raylet, dashboard: every process on the head host but the job's driver)
    is killed mid-run of a job. Ray would end the driver with os._exit 60 s later and nothing
    written; the job must notice, end the run and leave its run directory with error.json and
    every output that completed."""
    run = tmp_path / "run"
    job = bed.popen("-m", "tvmpipe.job", str(bed.head_only / "mlp"), "--stages", "2", "--placement",
                    "STRICT_SPREAD", "--backend", "reference", "--gpus-per-stage", "1", "-n", "20000", "--seed", "7",
                    "--run-dir", str(run), stderr=subprocess.STDOUT)
    log = []
    try:
        for line in job.stdout:
            log.append(line)
            if "micro-batch 300/" in line:
                break
        assert job.poll() is None, "".join(log[-30:])
        victims = [pid for pid in bed.head.pids() if pid != job.pid]
        t_fault = time.time()
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        rest = job.communicate(timeout=55)[0]  # Ray itself would end the driver at 60 s
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    took = time.time() - t_fault
    assert job.returncode == 1, rest[-3000:]
    err = json.loads((run / "error.json").read_text())
    assert err["phase"] == "run" and f"GCS at {bed.head.address}:" in err["message"], err
    done = np.load(run / "outputs.npz")
    assert err["completed_micro_batches"] == len(done["micro_batch"]) >= 300
    np.testing.assert_array_equal(done["micro_batch"], np.arange(len(done["micro_batch"])))
    assert_matches_oracle(done["output0"][:N], clean, bed.env)  # the same inputs: seed 7
    assert {"metrics.json", "plan.json", "job.log"} <= {p.name for p in run.iterdir()}
    print(f"\nhead failure: job ended {took:.1f} s after the fault with error.json; "
          f"{err['completed_micro_batches']} micro-batches kept")
