"""Route A and B of docs/cluster-jobs.md end to end: `ray up deploy/onprem.yaml`, `ray submit ...
deploy/job.py`, `ray job submit` through `ray dashboard`'s tunnel, `ray down`, on machines made of
network namespaces with their own sshd (sshbed.py): a head, two GPU workers (fake GPUs), and the
client where the `ray` commands run, which reaches the others only by SSH over the bridge.

What the test changes in deploy/onprem.yaml, and why (everything else runs as written):
- provider.head_ip / worker_ips: the bed's addresses; auth: root with the key made here;
- the `pip install` lines go: the bed has no network (no PyPI), and the nodes share this checkout's
  venv (each ~/tvmpipe-venv links to it, so the yaml's own venv lines find it);
- `ray start` gets --node-ip-address from `hostname -I`: with no default route Ray cannot find the
  node's address itself (it asks the route to 8.8.8.8); workers get --num-gpus=1 (fake GPUs), every
  node a small object store (the default takes 30% of this shared machine's memory each).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from netbed import NetBed
from sshbed import Machine, client_key, missing
from tvmpipe.bundle import load_bundle
from tvmpipe.app.oracle import reference_outputs
from tvmpipe.executor.inputs import random_micro_batches

ROOT = Path(__file__).resolve().parents[2]
# NOT PASSING YET: `ray up` succeeds (SSH, file mounts, head setup and start, token), but only one
# of the two workers the head's autoscaler launches over SSH joins within 5 min (`ray status`: head +
# 1 worker, 1.0 GPU). Opt-in until that is found: ~6 min, beyond the suite's budget as well.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.environ.get("TVMPIPE_RAYUP") != "1",
                                                   reason="opt-in (TVMPIPE_RAYUP=1): ray up end to end, not passing yet")]


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


@pytest.fixture(scope="module")
def machines(netbed_ok, tmp_path_factory):
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
        cfg = onprem_for(head.host.address, [w1.host.address, w2.host.address])
        (client.home / "onprem.yaml").write_text(yaml.safe_dump(cfg))
        yield {"head": head, "workers": [w1, w2], "client": client, "net": net}


def ray_cli(client: Machine, command: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """A `ray ...` command line run on the client, from the repository root (file_mounts syncs ".")."""
    env = {"PATH": f"{Path(shutil.which('ssh')).parent}:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8"}
    script = f"source /root/tvmpipe-venv/bin/activate && cd {ROOT} && {command}"
    return subprocess.run(client.wrap("bash", "-c", script), env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_ray_up_submit_job_submit_down(machines):
    head, workers, client = machines["head"], machines["workers"], machines["client"]
    t0 = time.time()
    up = ray_cli(client, "ray up /root/onprem.yaml --yes --no-config-cache", timeout=400)
    assert up.returncode == 0, (up.stdout + up.stderr)[-5000:]
    t_up = time.time() - t0

    deadline = time.time() + 300  # the head's autoscaler starts the workers over SSH after `ray up`
    while True:
        st = ray_cli(client, "ray exec /root/onprem.yaml 'ray status'", timeout=120)
        if "/2.0 GPU" in st.stdout or time.time() > deadline:  # both fake-GPU workers joined
            break
        time.sleep(5)
    assert "/2.0 GPU" in st.stdout, (st.stdout + st.stderr)[-3000:]
    t_nodes = time.time() - t0

    # Route A: the job runs on the head as a plain script; its run directory is on the head.
    sub = ray_cli(client, "ray submit /root/onprem.yaml deploy/job.py -- --stages 2 --backend reference "
                          "--gpus-per-stage 1 --placement STRICT_SPREAD -n 6 --seed 4 --run-dir /root/runs/mlp-2")
    assert sub.returncode == 0, (sub.stdout + sub.stderr)[-5000:]
    run = head.home / "runs" / "mlp-2"
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["cluster"]["nodes"] == 3 and metrics["cluster"]["ship_bundle"] is True, metrics["cluster"]
    mlp = ROOT / "examples" / "mlp"
    want = reference_outputs(mlp, random_micro_batches(load_bundle(mlp), 6, 4))
    np.testing.assert_array_equal(np.load(run / "outputs.npz")["output0"], np.stack([w[0] for w in want]))

    # Route B: `ray job submit` through the dashboard tunnel, with the cluster's token.
    tok = ray_cli(client, "ray rsync-down /root/onprem.yaml '~/.ray/auth_token' /root/cluster-token")
    assert tok.returncode == 0, (tok.stdout + tok.stderr)[-3000:]
    (client.home / "job").mkdir()
    shutil.copytree(mlp, client.home / "job" / "mlp")
    job = ray_cli(client, "(ray dashboard /root/onprem.yaml > /root/tunnel.log 2>&1 &) && sleep 5 && "
                          "RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=/root/cluster-token "
                          "ray job submit --address http://127.0.0.1:8265 --working-dir /root/job -- "
                          "python -m tvmpipe.job mlp --stages 2 --backend reference --gpus-per-stage 1 -n 4 "
                          "--run-dir /root/runs/job-b")
    assert job.returncode == 0 and "succeeded" in job.stdout + job.stderr, (job.stdout + job.stderr)[-5000:]
    assert (head.home / "runs" / "job-b" / "outputs.npz").exists()

    down = ray_cli(client, "ray down /root/onprem.yaml --yes")
    assert down.returncode == 0, (down.stdout + down.stderr)[-3000:]
    for m in (head, *workers):
        assert not any(_ray_process(p) for p in m.host.pids()), f"Ray still running on {m.host.name} after ray down"
    print(f"\nray up {t_up:.0f} s, all 3 nodes after {t_nodes:.0f} s, whole route A+B {time.time() - t0:.0f} s")


def _ray_process(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() in ("raylet", "gcs_server")
    except OSError:
        return False
