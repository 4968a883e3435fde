"""End to end on this machine: a Ray head on 127.0.0.1, `ray job submit` of a 2-stage run of the
built-in example with the bundle uploaded as the job's working directory, then the run directory
checked against a single-process run; and a job that fails mid-run, which Ray must report as
failed while its run directory keeps what completed; and `tvmpipe run --address` joining the same
head. Nothing may listen or connect off loopback, and nothing the head started may survive it."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.support.local_ray_head import LocalHead, non_loopback_sockets
from tvmpipe.bundle import load_bundle
from tvmpipe.deploy.job import resolve_bundle
from tvmpipe.executor import GraphRunner, random_inputs

pytestmark = [pytest.mark.ray, pytest.mark.slow]

RAY = Path(sys.executable).with_name("ray")


def _free_ports(n: int) -> list[int]:
    """Ports nothing listens on now (from the ephemeral range, away from Ray's fixed defaults and
    its worker ports 10002-19999), so a Ray of another test session running beside never collides."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.fixture(scope="module")
def head():
    assert RAY.exists(), f"no ray executable beside {sys.executable}: ray[default] installs it"
    h = LocalHead(str(RAY), *_free_ports(4))  # GCS, dashboard (job API), Ray Client server, job agent
    try:
        h.start()
        yield h
    finally:
        survivors = h.stop()
        shutil.rmtree(h.temp_dir, ignore_errors=True)
        assert survivors == [], f"processes left behind by the Ray head: {survivors}"


def _submit(head: LocalHead, workdir: Path, *job_args: str) -> subprocess.CompletedProcess:
    """`ray job submit`, waiting for the end; the entrypoint is this venv's python. Right after
    `ray start` the head may refuse a job until its agent registers ("No available agent to submit
    job, please try again later"): no job was created then, so submitting again is safe."""
    cmd = [str(RAY), "job", "submit", "--address", head.dashboard, "--working-dir", str(workdir), "--",
           sys.executable, "-m", "tvmpipe.job", *job_args]
    deadline = time.time() + 30
    while True:
        done = subprocess.run(cmd, env=head.env, capture_output=True, text=True, timeout=180)
        if "No available agent" not in done.stdout + done.stderr or time.time() > deadline:
            return done
        time.sleep(1)


def test_the_job_api_wants_the_token(head: LocalHead):
    wrong = subprocess.run([str(RAY), "job", "list", "--address", head.dashboard],
                           env={**head.env, "RAY_AUTH_TOKEN": "0" * 32}, capture_output=True, text=True, timeout=60)
    assert wrong.returncode != 0 and "token" in (wrong.stdout + wrong.stderr).lower()


def test_ray_job_submit_two_stages(head: LocalHead, tmp_path: Path):
    workdir = tmp_path / "workdir"
    shutil.copytree(resolve_bundle("mlp"), workdir / "mlp")  # the bundle travels with the job
    run = tmp_path / "run"  # absolute: the stand-in for shared storage
    job = _submit(head, workdir, "mlp", "--stages", "2", "-n", "4", "--seed", "3", "--run-dir", str(run))
    log = job.stdout + job.stderr
    assert job.returncode == 0 and "succeeded" in log, log
    assert non_loopback_sockets(head.processes()) == []

    assert {p.name for p in run.iterdir()} == {"plan.json", "metrics.json", "outputs.npz", "trace.json",
                                               "timeline.png", "job.log"}
    assert not (run / "error.json").exists()
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["cluster"]["launcher"] == "ray" and metrics["cluster"]["nodes"] == 1
    assert metrics["completed"] == 4 and len(metrics["pipeline"]["stages"]) == 2
    assert len(json.loads((run / "plan.json").read_text())["stages"]) == 2

    bundle = load_bundle(resolve_bundle("mlp"))
    runner = GraphRunner(bundle, backend="reference")
    want = []
    for i in range(4):
        runner.run(**random_inputs(bundle, 3 + i))
        want.append(runner.get_output(0))
    got = np.load(run / "outputs.npz")
    np.testing.assert_array_equal(got["output0"], np.stack(want))  # bit-identical


def test_failed_job_is_reported_failed_and_keeps_completed_outputs(head: LocalHead, tmp_path: Path):
    from tests.support.failing_bundle import poison_inputs, write_poison

    workdir = tmp_path / "workdir"
    write_poison(workdir / "poison")
    np.savez(workdir / "in.npz", x=poison_inputs(5, bad=2))
    run = tmp_path / "run"
    job = _submit(head, workdir, "poison", "--inputs", "in.npz", "--max-restarts", "0", "--run-dir", str(run))
    log = job.stdout + job.stderr
    assert job.returncode != 0 and "failed" in log, log
    err = json.loads((run / "error.json").read_text())
    assert (err["phase"], err["stage"], err["completed_micro_batches"]) == ("run", 1, 2)
    np.testing.assert_array_equal(np.load(run / "outputs.npz")["micro_batch"], [0, 1])
    assert (run / "job.log").exists() and (run / "plan.json").exists()


@pytest.mark.parametrize("scheme", ["auto", "ray://"])
def test_tvmpipe_run_joins_the_running_cluster(head: LocalHead, scheme: str):
    """`tvmpipe run --address` (the interactive command) against the same head: `auto` finds it
    through RAY_ADDRESS, `ray://` goes through the Ray Client server."""
    address = "auto" if scheme == "auto" else f"ray://127.0.0.1:{head.client_port}"
    tvmpipe = Path(sys.executable).with_name("tvmpipe")
    run = subprocess.run([str(tvmpipe), "run", "--address", address, "--stages", "2", "-n", "4"],
                         env={**head.env, "RAY_ADDRESS": f"127.0.0.1:{head.gcs_port}"},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "(1 node(s))" in run.stdout and "outputs match single-process run: yes" in run.stdout
    assert non_loopback_sockets(head.processes()) == []
