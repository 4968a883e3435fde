"""The job without Ray (`--processes`): run directory contents, outputs equal to a
single-process run, and the failure path on a pipeline that really fails mid-run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.failing_bundle import poison_inputs, write_poison
from tvmpipe.bundle import load_bundle
from tvmpipe.executor.inputs import npz_micro_batches as npz_batches
from tvmpipe.deploy.job import main, parse_args, resolve_bundle
from tvmpipe.executor import GraphRunner, random_inputs
from tvmpipe.partition import Plan

RUN_FILES = {"plan.json", "metrics.json", "outputs.npz", "trace.json", "timeline.png", "job.log"}


def _reference_outputs(bundle_path: Path, batches: list[dict[str, np.ndarray]]) -> list[list[np.ndarray]]:
    runner = GraphRunner(bundle_path, backend="reference")
    out = []
    for b in batches:
        runner.run(**b)
        out.append([runner.get_output(k) for k in range(runner.get_num_outputs())])
    return out


def _published(run: Path) -> set[str]:
    names = {p.name for p in run.iterdir()}
    assert not [n for n in names if n.startswith(".") or n.endswith(".partial")], names  # no temporaries
    return names


def test_defaults_and_argument_errors():
    cfg = parse_args([])
    assert (cfg.bundle, cfg.stages, cfg.strategy, cfg.cluster.backend, cfg.cluster.address) == \
        ("mlp", 2, "equal", "auto", "auto")
    assert parse_args(["--processes"]).cluster.address is None
    assert resolve_bundle("mlp").is_dir()  # the built-in example
    for bad in (["--plan", "p.json", "--stages", "3"], ["--stages", "0"], ["-n", "0"],
                ["--processes", "--address", "local"], ["--backend", "tpu"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_success_writes_every_file_and_matches_a_single_process_run(tmp_path):
    run = tmp_path / "run"
    assert main(["mlp", "--processes", "-n", "3", "--seed", "5", "--run-dir", str(run)]) == 0
    assert _published(run) >= RUN_FILES and "error.json" not in _published(run)
    bundle = load_bundle(resolve_bundle("mlp"))
    want = _reference_outputs(bundle.path, [random_inputs(bundle, 5 + i) for i in range(3)])
    got = np.load(run / "outputs.npz")
    np.testing.assert_array_equal(got["micro_batch"], [0, 1, 2])
    np.testing.assert_array_equal(got["output0"], np.stack([o[0] for o in want]))  # bit-identical
    plan = Plan.from_json((run / "plan.json").read_text())
    assert plan.num_stages == 2 and plan.strategy == "equal"
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["completed"] == metrics["micro_batches"] == 3
    assert metrics["backend"] == "reference" and len(metrics["pipeline"]["stages"]) == 2
    assert "micro-batch 3/3 done" in (run / "job.log").read_text()


def test_plan_file_is_used_as_given(tmp_path):
    bundle = load_bundle(resolve_bundle("mlp"))
    plan = Plan.from_cuts(bundle.graph, [1, 3])
    plan.save(tmp_path / "plan.json")
    run = tmp_path / "run"
    assert main(["mlp", "--processes", "-n", "2", "--plan", str(tmp_path / "plan.json"),
                 "--run-dir", str(run)]) == 0
    assert Plan.from_json((run / "plan.json").read_text()).stages == plan.stages


def test_failure_mid_run_keeps_completed_outputs_and_says_where(tmp_path):
    bundle = write_poison(tmp_path / "poison")
    x = poison_inputs(6, bad=3)
    np.savez(tmp_path / "in.npz", x=x)
    run = tmp_path / "run"
    rc = main([str(bundle), "--processes", "--inputs", str(tmp_path / "in.npz"), "--max-restarts", "1",
               "--run-dir", str(run)])
    assert rc == 1
    assert _published(run) == RUN_FILES | {"error.json"}
    err = json.loads((run / "error.json").read_text())
    assert (err["error"], err["phase"], err["stage"]) == ("PipelineError", "run", 1)
    assert err["completed_micro_batches"] == 3 and err["micro_batches"] == 6
    assert "micro-batch 3" in err["last_error"] and "arange" in err["last_error"]
    got = np.load(run / "outputs.npz")
    np.testing.assert_array_equal(got["micro_batch"], [0, 1, 2])
    want = _reference_outputs(bundle, npz_batches(load_bundle(bundle), tmp_path / "in.npz")[:3])
    np.testing.assert_array_equal(got["output0"], np.stack([o[0] for o in want]))
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["restarts"] == [0, 2]  # restarted once, replayed micro-batch 3, failed again
    assert "job failed in phase run" in (run / "job.log").read_text()


def test_bad_inputs_fail_before_any_worker_starts(tmp_path):
    np.savez(tmp_path / "in.npz", x=np.zeros((2, 7), np.float32))
    run = tmp_path / "run"
    assert main(["mlp", "--processes", "--inputs", str(tmp_path / "in.npz"), "--run-dir", str(run)]) == 1
    err = json.loads((run / "error.json").read_text())
    assert (err["error"], err["phase"], err["completed_micro_batches"]) == ("InputError", "inputs", 0)
    assert "outputs.npz" not in _published(run)


def test_unloadable_bundle_still_leaves_an_error_summary(tmp_path):
    (tmp_path / "broken").mkdir()
    run = tmp_path / "run"
    assert main([str(tmp_path / "broken"), "--processes", "--run-dir", str(run)]) == 1
    err = json.loads((run / "error.json").read_text())
    assert (err["error"], err["phase"]) == ("BundleError", "load") and "bundle.json" in err["message"]


def test_results_are_never_mixed_into_a_used_run_dir(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.json").write_text("{}")
    assert main(["mlp", "--processes", "--run-dir", str(run)]) == 2
    assert "already holds files" in capsys.readouterr().err
    assert [p.name for p in run.iterdir()] == ["metrics.json"]


def test_npz_rows_are_micro_batches_and_plain_arrays_repeat(tmp_path):
    bundle = load_bundle(resolve_bundle("mlp"))
    x = np.arange(300, dtype=np.float32).reshape(3, 1, 100)
    np.savez(tmp_path / "rows.npz", x=x)
    batches = npz_batches(bundle, tmp_path / "rows.npz")
    assert len(batches) == 3 and np.array_equal(batches[2]["x"], x[2])
    np.savez(tmp_path / "one.npz", x=x[0])
    assert len(npz_batches(bundle, tmp_path / "one.npz")) == 1
    with pytest.raises(Exception, match="holds 3 micro-batch"):
        npz_batches(bundle, tmp_path / "rows.npz", count=4)


def test_sigterm_ends_the_job_like_a_failure(tmp_path):
    """`ray job stop` sends SIGTERM: the job must still publish what completed and error.json."""
    import os
    import signal
    import threading
    import time

    run = tmp_path / "run"
    finished = threading.Event()

    def stop_when_running() -> None:
        log = run / "job.log.partial"
        deadline = time.time() + 60
        while time.time() < deadline and not finished.is_set():
            if log.exists() and "micro-batch 20/" in log.read_text():
                if not finished.is_set():  # never signal pytest itself once the job is over
                    os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.05)

    before = signal.getsignal(signal.SIGTERM)  # other tests in the session (Ray) may have set one
    killer = threading.Thread(target=stop_when_running)
    killer.start()
    try:
        rc = main(["mlp", "--processes", "-n", "5000", "--run-dir", str(run)])
    finally:
        finished.set()
        killer.join()
    assert rc == 1
    err = json.loads((run / "error.json").read_text())
    assert (err["error"], err["phase"]) == ("JobStopped", "run") and err["completed_micro_batches"] >= 20
    assert len(np.load(run / "outputs.npz")["micro_batch"]) == err["completed_micro_batches"]
    assert signal.getsignal(signal.SIGTERM) is before  # the job's handler is gone again


def test_script_copied_next_to_the_checkout_runs_the_installed_tvmpipe(tmp_path):
    """`ray submit CLUSTER.yaml deploy/job.py` copies the script to ~/job.py on the head, where the
    synced checkout is ~/tvmpipe. Run as a script from there, ~ comes first on sys.path and the
    checkout (no __init__.py at its root) would shadow the installed package as a namespace
    package: the job must still import the installed tvmpipe and finish."""
    root = Path(__file__).resolve().parents[2]
    home = tmp_path / "home"
    home.mkdir()
    (home / "tvmpipe").symlink_to(root)  # what file_mounts `~/tvmpipe: .` leaves on the head
    shutil.copy(root / "deploy" / "job.py", home / "job.py")
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, str(home / "job.py"), "--processes", "-n", "2", "--run-dir", str(run)],
                          cwd=home, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["tvmpipe_version"] and not (run / "error.json").exists()
