"""Route A and B of docs/cluster-jobs.md end to end: `ray up deploy/onprem.yaml`, `ray submit ...
deploy/job.py`, `ray job submit` through `ray dashboard`'s tunnel, `ray down`, on machines made of
network namespaces with their own sshd (sshbed.py): a head, two GPU workers (fake GPUs), and the
client where the `ray` commands run, which reaches the others only by SSH over the bridge.

One cluster serves the module (`ray up` + the workers joining is half of its ~80 s): the tests run
in file order, up -> listeners -> submit -> job submit -> down. The fixture's teardown removes the
whole bed (every process in the namespaces, the namespaces) whether the tests passed or not, and
checks it.

What the test changes in deploy/onprem.yaml, and why (everything else runs as written, including
the head's RAY_enable_autoscaler_v2=0, without which only one worker ever joins):
- provider.head_ip / worker_ips: the bed's addresses; auth: root with the key made here;
- the `pip install` lines go: the bed has no network (no PyPI), and the nodes share this checkout's
  venv (each ~/tvmpipe-venv links to it, so the yaml's own venv lines find it);
- `ray start` gets --node-ip-address from `hostname -I`: with no default route Ray cannot find the
  node's address itself (it asks the route to 8.8.8.8); workers get --num-gpus=1 (fake GPUs), every
  node a small object store (the default takes 30% of this shared machine's memory each).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from netbed import NetBed
from oraclecheck import assert_matches_oracle
from sshbed import Machine, client_key, missing
from tvmpipe.app.oracle import reference_outputs
from tvmpipe.bundle import load_bundle
from tvmpipe.executor.inputs import random_micro_batches

ROOT = Path(__file__).resolve().parents[2]
MLP = ROOT / "examples" / "mlp"  # the built-in example (`tvmpipe.job`'s default bundle)
pytestmark = pytest.mark.slow
JOB_ARGS = "--stages 3 --placement STRICT_SPREAD --backend reference --gpus-per-stage 0 -n 6 --seed 4"
# Waits up to 60 s for the tunnel's local end (127.0.0.1:8265 on the client) to accept connections.
WAIT_TUNNEL = ("import socket, time\nfor _ in range(120):\n    try:\n        socket.create_connection(('127.0.0.1', 8265), 1)"
               ".close()\n        break\n    except OSError:\n        time.sleep(0.5)")
RUN_FILES = {"plan.json", "outputs.npz", "metrics.json", "trace.json", "timeline.png", "job.log"}


def onprem_for(head: str, workers: list[str]) -> dict:
    cfg = yaml.safe_load((ROOT / "deploy" / "onprem.yaml").read_text())
    cfg["provider"].update(head_ip=head, worker_ips=workers)
    cfg["auth"] = {"ssh_user": "root", "ssh_private_key": "/root/.ssh/id_ed25519"}
    for key in ("setup_commands", "head_setup_commands", "worker_setup_commands"):
        cfg[key] = [c for c in cfg.get(key, []) if "pip install" not in c]
    node = "ray start --node-ip-address=$(hostname -I | cut -d' ' -f1) --object-store-memory=80000000"
    cfg["head_start_ray_commands"] = [c.replace("ray start", node) for c in cfg["head_start_ray_commands"]]
    cfg["worker_start_ray_commands"] = [c.replace("ray start", node) + (" --num-gpus=1" if "ray start" in c else "")
                                        for c in cfg["worker_start_ray_commands"]]
    return cfg


def ray_cli(client: Machine, command: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """A `ray ...` command line run on the client, from the repository root (file_mounts syncs ".")."""
    env = {"PATH": f"{Path(shutil.which('ssh')).parent}:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8"}
    script = f"source /root/tvmpipe-venv/bin/activate && cd {ROOT} && {command}"
    return subprocess.run(client.wrap("bash", "-c", script), env=env, capture_output=True, text=True,
                          timeout=timeout)


def ray_processes(m: Machine) -> list[str]:
    """Every process on a machine but its sshd: Ray's daemons, agents, workers and helpers (the
    log monitor is a plain `python`)."""
    names = []
    for pid in m.host.pids():
        try:
            names.append(Path(f"/proc/{pid}/comm").read_text().strip())
        except OSError:
            pass
    return [n for n in names if n not in ("unshare", "sshd", "sh")]


@pytest.fixture(scope="module")
def cluster(netbed_ok, tmp_path_factory):
    """`ray up` on a bed of four machines, then the wait for both workers; yields once all three
    nodes are in. Teardown: `ray down` if a test did not get to it, then the bed goes, and nothing
    of it may be left (NetBed raises otherwise)."""
    why = missing()
    if why:
        pytest.skip(why)
    base = Path(str(tmp_path_factory.mktemp("rayup")))
    with NetBed(4) as net:
        head, w1, w2, client = (Machine(h, base / h.name.rsplit("-", 1)[1]) for h in net.hosts)
        for m in (head, w1, w2, client):
            m.root.mkdir()
        client.prepare(None)
        key, pub = client_key(client)
        for m in (head, w1, w2):
            m.prepare(pub)
            m.start_sshd()
        (client.home / "onprem.yaml").write_text(yaml.safe_dump(onprem_for(head.host.address,
                                                                           [w1.host.address, w2.host.address])))
        state = {"head": head, "workers": [w1, w2], "client": client, "down": False, "times": {}}
        try:
            t0 = time.time()
            up = ray_cli(client, "ray up /root/onprem.yaml --yes --no-config-cache", timeout=400)
            if up.returncode != 0:
                pytest.fail(f"ray up failed:\n{(up.stdout + up.stderr)[-5000:]}")
            state["times"]["ray up"] = time.time() - t0
            deadline = time.time() + 240  # the head's autoscaler starts the workers over SSH after `ray up`
            while True:
                st = ray_cli(client, "ray exec /root/onprem.yaml 'ray status'", timeout=120)
                if "/2.0 GPU" in st.stdout or time.time() > deadline:
                    break
                time.sleep(3)
            state["status"] = st.stdout + st.stderr
            state["times"]["all 3 nodes"] = time.time() - t0
            yield state
        finally:
            if not state["down"]:
                ray_cli(client, "ray down /root/onprem.yaml --yes", timeout=180)
            print("\n" + ", ".join(f"{k} {v:.0f} s" for k, v in state["times"].items()))


def listeners(m: Machine) -> list[tuple[str, str]]:
    """(local address:port, process name) of every TCP listener on a machine."""
    out = []
    for cols in m.host.sockets("-tlp"):
        name = re.search(r'users:\(\("([^"]+)"', cols[-1])
        out.append((cols[3], name.group(1) if name else "?"))
    return out


def test_ray_up_brings_up_head_and_two_gpu_workers(cluster):
    status = cluster["status"]
    assert "/2.0 GPU" in status, status[-3000:]  # the 2 workers' fake GPUs (the head has none)
    for m in (cluster["head"], *cluster["workers"]):  # a node on each machine
        assert ray_processes(m).count("raylet") == 1, f"{m.host.name}: {ray_processes(m)}"


def test_what_listens_beyond_the_node_address_is_rays_own(cluster):
    """sshd (ours) listens on the node's address only. Ray 2.60 binds its gRPC servers (GCS,
    raylet, core workers, the dashboard agent) and metrics exporters to every interface whenever the
    node's address is not loopback, with no option to name the address (docs/cluster-jobs.md): the
    head's GCS on *:6379 shows it. Nothing else may listen there."""
    for m in (cluster["head"], *cluster["workers"]):
        own = (f"{m.host.address}:", "127.0.0.1:", "[::ffff:127.0.0.1]:", f"[::ffff:{m.host.address}]:")
        socks = listeners(m)
        assert [a for a, p in socks if p == "sshd"] == [f"{m.host.address}:22"], socks
        wide = [(a, p) for a, p in socks if not a.startswith(own)]
        assert all(p in ("gcs_server", "raylet", "python") or p.startswith("ray::") for _, p in wide), wide
        cluster["wildcard " + m.host.name.rsplit("-", 1)[1]] = sorted(wide)
    head_wide = cluster["wildcard h0"]
    assert any(a.endswith(":6379") and p == "gcs_server" for a, p in head_wide), head_wide
    print("\n" + "\n".join(f"{k}: {v}" for k, v in cluster.items() if k.startswith("wildcard")))


def _check_run_dir(cluster, run: Path, n: int, seed: int) -> dict:
    """The run directory on the head holds every file, no error, outputs equal to the oracle's
    (within the tolerance across hosts: the machines compute in their SSH logins' environment, not
    in this process's, so their BLAS may pick other kernels), and the three stages ran one per host."""
    assert not (run / "error.json").exists(), (run / "error.json").read_text()
    assert RUN_FILES <= {p.name for p in run.iterdir()}, sorted(p.name for p in run.iterdir())
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["cluster"]["nodes"] == 3 and metrics["cluster"]["ship_bundle"] is True, metrics["cluster"]
    hosts = [s["host"] for s in metrics["pipeline"]["stages"]]
    machines = {m.host.address for m in (cluster["head"], *cluster["workers"])}
    assert len(hosts) == 3 and set(hosts) == machines, hosts
    want = reference_outputs(MLP, random_micro_batches(load_bundle(MLP), n, seed))
    assert_matches_oracle(np.load(run / "outputs.npz")["output0"], np.stack([w[0] for w in want]), None,
                          f"{run.name} on the `ray up` machines")
    return metrics


def test_ray_submit_runs_the_job_across_the_hosts(cluster):
    """Route A: deploy/job.py runs on the head as a plain script; its run directory is on the head."""
    t0 = time.time()
    sub = ray_cli(cluster["client"], f"ray submit /root/onprem.yaml deploy/job.py -- {JOB_ARGS} "
                                     "--run-dir /root/runs/mlp-3")
    assert sub.returncode == 0, (sub.stdout + sub.stderr)[-5000:]
    cluster["times"]["ray submit"] = time.time() - t0
    _check_run_dir(cluster, cluster["head"].home / "runs" / "mlp-3", 6, 4)


def test_ray_job_submit_through_the_dashboard_tunnel(cluster):
    """Route B: `ray job submit` to the head's job API, reached through `ray dashboard`'s SSH tunnel
    (the dashboard listens on the head's loopback only), with the cluster's token."""
    client = cluster["client"]
    tok = ray_cli(client, "ray rsync-down /root/onprem.yaml '~/.ray/auth_token' /root/cluster-token")
    assert tok.returncode == 0, (tok.stdout + tok.stderr)[-3000:]
    (client.home / "job").mkdir()
    t0 = time.time()
    # The tunnel lives in the client's PID namespace and ends with this command.
    job = ray_cli(client, "(ray dashboard /root/onprem.yaml > /root/tunnel.log 2>&1 &) && "
                          f"python -c {shlex.quote(WAIT_TUNNEL)}; "
                          "RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=/root/cluster-token "
                          "ray job submit --address http://127.0.0.1:8265 --working-dir /root/job -- "
                          f"python -m tvmpipe.job {JOB_ARGS} --run-dir /root/runs/job-b")
    assert job.returncode == 0 and "succeeded" in job.stdout + job.stderr, (job.stdout + job.stderr)[-5000:]
    cluster["times"]["ray job submit"] = time.time() - t0
    _check_run_dir(cluster, cluster["head"].home / "runs" / "job-b", 6, 4)


def test_ray_down_leaves_no_ray_process(cluster):
    """`ray down` runs `ray stop` on the head only (the local provider cannot stop a host; Ray on a
    worker ends itself ~2 min after losing the GCS), so deploy/stop_workers.py, submitted to the
    head first, stops the workers' Ray over SSH. Then nothing of Ray is left on any machine."""
    client = cluster["client"]
    t0 = time.time()
    stop = ray_cli(client, "ray submit /root/onprem.yaml deploy/stop_workers.py", timeout=180)
    assert stop.returncode == 0, (stop.stdout + stop.stderr)[-3000:]
    for w in cluster["workers"]:
        assert f"{w.host.address}: ray stopped" in stop.stdout, stop.stdout[-3000:]
    down = ray_cli(client, "ray down /root/onprem.yaml --yes", timeout=180)
    cluster["down"] = True
    assert down.returncode == 0, (down.stdout + down.stderr)[-3000:]
    cluster["times"]["stop_workers + ray down"] = time.time() - t0
    deadline = time.time() + 15  # `ray stop` waits for what it stops; allow stragglers a moment
    left = {m.host.name: ray_processes(m) for m in (cluster["head"], *cluster["workers"])}
    while any(left.values()) and time.time() < deadline:
        time.sleep(1)
        left = {m.host.name: ray_processes(m) for m in (cluster["head"], *cluster["workers"])}
    assert not any(left.values()), f"Ray still running after ray down: {left}"
