"""`tvmpipe run` and `tvmpipe sweep`."""

from __future__ import annotations

import csv
import json
import time
import subprocess
import sys

import numpy as np
import pytest

from tvmpipe.core.errors import TvmpipeError

from tvmpipe.cli import main


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_run_builtin_example_with_processes_json(capsys):
    code, out, _ = run_cli(capsys, "run", "--stages", "3", "--processes", "--json", "-n", "6")
    summary = json.loads(out)
    assert code == 0 and summary["match"] is True and summary["model"] == "mlp"
    assert len(summary["stages"]) == 3 and summary["micro_batches"] == 6 and summary["backend"] == "reference"
    m = summary["metrics"]
    assert m["micro_batches"] == 6 and m["throughput"] > 0 and m["latency_p99_ms"] >= m["latency_p50_ms"] > 0
    assert [s["micro_batches"] for s in m["stages"]] == [6, 6, 6]
    phases = summary["startup_s"]  # where the time to first output went
    assert set(phases) == {"cluster", "stages", "first_output"} and all(v >= 0 for v in phases.values())
    assert abs(sum(phases.values()) - summary["time_to_first_output_s"]) < 0.05
    assert 0 < time.time() - summary["started_at"] < 60  # wall clock: lines the phases up with other samples


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_run_transport_forces_the_path_of_every_edge(capsys, transport):
    code, out, _ = run_cli(capsys, "run", "--stages", "2", "--processes", "--json", "-n", "4", "--transport", transport)
    summary = json.loads(out)
    assert code == 0 and summary["match"] is True
    assert summary["edge_paths"] and set(summary["edge_paths"].values()) == {transport}, summary["edge_paths"]


def test_run_table_inputs_outputs_trace(capsys, tmp_path, bundles):
    x = np.random.default_rng(0).standard_normal((5, 1, 8)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    code, out, _ = run_cli(capsys, "run", str(bundles["skipnet"]), "--stages", "2", "--processes", "-n", "5",
                           "--inputs", str(tmp_path / "in.npz"), "--save-outputs", str(tmp_path / "out.npz"),
                           "--trace", str(tmp_path / "t.json"))
    assert code == 0, out
    assert "outputs match single-process run: yes (5/5" in out and "busy %" in out and "p99" in out
    # units stated: per-micro-batch means vs totals over the run (issue 16)
    assert "ms/mb (mean)" in out and "bytes out (total)" in out
    with np.load(tmp_path / "out.npz") as z:
        assert z["output0"].shape == (5, 8) and z["output1"].shape == (5, 16)
    trace = json.loads((tmp_path / "t.json").read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == 10 and {e["pid"] for e in slices} == {0, 1}
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_run_exits_nonzero_on_mismatch(capsys, monkeypatch):
    import tvmpipe.app.oracle as reference

    real = reference.reference_outputs
    monkeypatch.setattr(reference, "reference_outputs",
                        lambda *a, **k: [[o + 1 for o in outs] for outs in real(*a, **k)])
    code, out, err = run_cli(capsys, "run", "--stages", "2", "--processes", "-n", "3")
    assert code == 1 and "match single-process run: NO (0/3" in out and "max abs difference 1" in err


def test_run_rejects_bad_inputs_and_missing_cluster_choice(capsys, tmp_path):
    np.savez(tmp_path / "in.npz", x=np.zeros((2, 3), np.float32))
    code, _, err = run_cli(capsys, "run", "--processes", "--inputs", str(tmp_path / "in.npz"))
    assert code == 2 and "'x' has shape [2, 3], expected [1, 100]" in err and "Traceback" not in err
    code, _, err = run_cli(capsys, "run")
    assert code == 2 and "--local" in err
    code, _, err = run_cli(capsys, "run", "--local", "--ray-temp-dir", "/tmp/" + "x" * 60)
    assert code == 2 and "too long" in err


def test_sweep_simulated_writes_a_report(capsys, tmp_path, bundles):
    out_dir = tmp_path / "report"
    code, out, _ = run_cli(capsys, "sweep", str(bundles["skipnet"]), "--stages", "1..2", "--strategies", "equal",
                           "--processes", "--backend", "simulated", "--time-scale", "300", "-n", "12",
                           "--rounds", "2", "-o", str(out_dir))
    assert code == 0, out
    assert "[equal-k1] predicted" in out and "[equal-k2] predicted" in out
    for f in ("sweep.md", "sweep.csv", "throughput.png", "gantt.png", "plans/equal-k2.json",
              "traces/equal-k2.json", "traces/equal-k2.metrics.json"):
        assert (out_dir / f).is_file(), f
    rows = (out_dir / "sweep.csv").read_text().splitlines()
    assert len(rows) == 3 and all(r.split(",")[4] for r in rows[1:])  # meas_throughput filled


def test_sweep_runtime_costs_enter_every_prediction(capsys, tmp_path, bundles):
    """Predictions for tiny stages are meaningless without the runtime's own costs: the sweep calibrates
    them (auto: a 1-stage zero-compute run), takes them from a file, or leaves them out (none)."""
    args = ["sweep", str(bundles["skipnet"]), "--stages", "1..2", "--strategies", "equal", "--processes",
            "--backend", "simulated", "-n", "8", "--rounds", "2"]
    code, out, _ = run_cli(capsys, *args, "--runtime", "none", "-o", str(tmp_path / "zero"))
    assert code == 0 and "runtime costs for planning (none): receive 0.0 us" in out
    (tmp_path / "big.json").write_text(json.dumps({"recv_us": 2500, "send_us": 2500}))
    code, out, _ = run_cli(capsys, *args, "--runtime", str(tmp_path / "big.json"), "-o", str(tmp_path / "big"))
    assert code == 0 and "receive 2500.0 us and send 2500.0 us per frame" in out
    pred = {}
    for name in ("zero", "big"):
        with open(tmp_path / name / "sweep.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        pred[name] = [float(row["pred_throughput"]) for row in rows]
        assert len(rows) == 2 and all(r["rounds"] == "2" for r in rows)
        assert all(float(r["meas_throughput_min"]) <= float(r["meas_throughput"]) <= float(r["meas_throughput_max"])
                   for r in rows)
    # 5 ms of receive + send per stage bounds every stage at < 200 micro-batches/s
    assert all(p < 200 for p in pred["big"]) and all(z > 10 * b for z, b in zip(pred["zero"], pred["big"]))
    code, out, _ = run_cli(capsys, *args, "--runtime", "auto", "-o", str(tmp_path / "auto"))
    assert code == 0 and "runtime costs for planning (calibrated)" in out and "runtime alongside: receive" in out
    md = (tmp_path / "auto" / "sweep.md").read_text()
    assert "Runtime costs (calibrated)" in md and "min-max" in md and "Load average" in md
    (tmp_path / "bad.json").write_text(json.dumps({"recv_us": -3}))
    code, _, err = run_cli(capsys, *args, "--runtime", str(tmp_path / "bad.json"), "-o", str(tmp_path / "neg"))
    assert code == 2 and "recv_us must be a non-negative number" in err and "Traceback" not in err


def test_whatif_sweep_runs_a_described_cluster_in_the_event_simulator(capsys, tmp_path, bundles):
    cluster = tmp_path / "c.json"
    cluster.write_text(json.dumps({"name": "2 nodes", "nodes": [{"device": "h100", "devices": 2, "count": 2}],
                                   "network": {"bandwidth": "1GB/s", "latency": "50us"}}))
    out_dir = tmp_path / "whatif"
    code, out, _ = run_cli(capsys, "sweep", str(bundles["cnn"]), "--stages", "1..6", "--backend", "simulated",
                           "--cluster", str(cluster), "-o", str(out_dir))
    assert code == 0, out
    assert "2 nodes: 4 x h100 on 2 node(s)" in out and "[optimal-k4] predicted" in out and "k5" not in out
    rows = list(csv.DictReader(open(out_dir / "sweep.csv")))
    assert len(rows) == 8 and {r["measured_by"] for r in rows} == {"simulated"}
    for r in rows:  # the simulator and the closed form are one model: they agree
        assert float(r["meas_throughput"]) == pytest.approx(float(r["pred_throughput"]), rel=0.05)
    assert (out_dir / "gantt.png").stat().st_size > 5000
    code, _, err = run_cli(capsys, "sweep", str(bundles["cnn"]), "--cluster", str(cluster), "--processes",
                           "-o", str(out_dir))
    assert code == 2 and "--backend simulated" in err


@pytest.mark.parametrize("address, message, calls, ok", [
    ("ray://127.0.0.1:1", "Initialization failure from server: ... psutil.ZombieProcess ...", 2, True),
    ("ray://127.0.0.1:1", "Initialization failure from server: ... psutil.ZombieProcess ...", 3, False),
    ("ray://127.0.0.1:1", "Failed to connect", 1, False),  # not Ray's start-up race: reported at once
    ("127.0.0.1:6379", "Initialization failure from server", 1, False),  # not a ray:// client
])
def test_connect_ray_retries_only_the_client_server_start_race(monkeypatch, address, message, calls, ok):
    import ray

    from tvmpipe.app.connect import connect_ray

    seen = []

    def init(**kw):
        seen.append(kw["address"])
        if len(seen) < calls or not ok:
            raise ConnectionError(message)

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    if ok:
        connect_ray(address, attempts=3, pause_s=0)
    else:
        with pytest.raises(TvmpipeError, match="cannot connect to the Ray cluster"):
            connect_ray(address, attempts=3, pause_s=0)
    assert seen == [address] * calls


def test_sweep_round_counts_auto_scale_with_the_model(bundles):
    """A fixed count is noise for fast models and minutes for slow ones: 'auto' micro-batches aim at
    SWEEP_ROUND_S per round at the 1-stage rate, within 32..2000, and 'auto' rounds at SWEEP_MEASURE_S
    per plan, within SWEEP_ROUNDS; given counts are kept."""
    from tvmpipe.bundle import load_bundle
    from tvmpipe.app.sweep import SWEEP_MEASURE_S, SWEEP_ROUND_S, SWEEP_ROUNDS, simulated_profile, sweep_micro_batches, sweep_rounds
    from tvmpipe.partition.model import PipelineModel
    from tvmpipe.partition.planners import make_plan
    from tvmpipe.partition.predict import predict

    b = load_bundle(bundles["cnn"])
    counts, rounds = {}, {}
    for scale in (1.0, 30.0, 1e5):
        model = PipelineModel.build(b, profile=simulated_profile(b, scale))
        rate = predict(model, make_plan(model, 1, "equal", requests=1), 1).throughput
        counts[scale] = sweep_micro_batches("auto", model)
        assert counts[scale] == int(min(2000, max(32, rate * SWEEP_ROUND_S)))
        rounds[scale] = sweep_rounds("auto", model, counts[scale])
        assert SWEEP_ROUNDS[0] <= rounds[scale] <= SWEEP_ROUNDS[1]
        assert rounds[scale] == int(min(SWEEP_ROUNDS[1], max(SWEEP_ROUNDS[0], round(SWEEP_MEASURE_S * rate / counts[scale]))))
    assert counts[1.0] > counts[30.0] > counts[1e5] == 32
    assert rounds[1e5] == SWEEP_ROUNDS[0]  # 32 micro-batches of a slow model: as few rounds as allowed
    assert rounds[30.0] == round(SWEEP_MEASURE_S / SWEEP_ROUND_S)  # ~0.1 s rounds: 30 of them
    assert sweep_micro_batches("7", model) == 7 and sweep_rounds("4", model, 7) == 4


def test_sweep_rejects_bad_micro_batch_counts(capsys, tmp_path, bundles):
    for option in ("-n", "--rounds"):
        for bad, message in (("0", "must be >= 1"), ("many", "expected a count or 'auto'")):
            code, _, err = run_cli(capsys, "sweep", str(bundles["skipnet"]), "--stages", "1", "--processes",
                                   "--backend", "simulated", option, bad, "-o", str(tmp_path / "r"))
            assert code == 2 and message in err and option in err and "Traceback" not in err


@pytest.mark.ray
def test_run_local_is_the_readme_command():
    """`tvmpipe run --stages 2 --local`: its own embedded Ray (a separate process, since this test
    session already holds one), the built-in example, outputs checked."""
    proc = subprocess.run([sys.executable, "-m", "tvmpipe", "run", "--stages", "2", "--local", "-n", "8"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "local Ray on 127.0.0.1" in proc.stdout and "outputs match single-process run: yes (8/8" in proc.stdout
    # Ray's "token authentication is enabled" notice is dropped (issue 16); auth itself stays on
    assert "Token authentication is enabled for this Ray cluster" not in proc.stderr, proc.stderr[-3000:]
    # the table says which columns are per micro-batch and which are totals over the run
    assert "ms/mb (mean)" in proc.stdout and "bytes out (total)" in proc.stdout


@pytest.mark.ray
def test_run_local_with_a_fractional_cpu_total():
    """--stages 3 --cpus-per-stage 0.75 asks the embedded head for 2.25 CPUs (so did any odd K >= 5
    at the default 0.5): Ray refuses a node with a fractional CPU count, which `run` printed as a
    ValueError traceback; the head gets the next whole number and the run goes through."""
    proc = subprocess.run([sys.executable, "-m", "tvmpipe", "run", "--stages", "3", "--local", "--cpus-per-stage",
                           "0.75", "-n", "4"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "3 stage(s)" in proc.stdout and "outputs match single-process run: yes (4/4" in proc.stdout
    assert "Traceback" not in proc.stderr


@pytest.mark.ray
def test_run_local_refuses_a_placement_one_node_cannot_hold():
    """`run --local --placement STRICT_SPREAD -k 2` (a node per stage, one node) printed nothing
    and waited out the 300 s start timeout; now one line, exit 2, seconds after Ray starts."""
    proc = subprocess.run([sys.executable, "-m", "tvmpipe", "run", "--stages", "2", "--local", "--placement",
                           "STRICT_SPREAD", "-n", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("tvmpipe run: error:")]
    assert len(lines) == 1 and "STRICT_SPREAD" in lines[0] and "cannot hold it" in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
