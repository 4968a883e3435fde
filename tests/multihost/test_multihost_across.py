"""Pipelines across hosts: K stages, one per host (STRICT_SPREAD), on the 4-host bed.

The bundle exists only on the head (worker nodes see an empty directory at its path), so the
stages get it only because it is shipped through Ray. Each stage's data listener must sit on its
own host's bridge address (never 0.0.0.0), frames must cross the bridge between the hosts'
addresses (checked with `ss` inside each host while the pipeline is wired), and the outputs must
equal the single-process run bit for bit (the hosts run with the test's environment, so with its
BLAS kernels: oraclecheck.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from oraclecheck import assert_matches_oracle
from raybed import RayBed, drive
from tvmpipe.bundle import load_bundle
from tvmpipe.bundle.weights import DATA_ALIGN
from tvmpipe.cluster.wire.frames import DRIVER
from tvmpipe.app.oracle import reference_outputs
from tvmpipe.cluster.topology import build_topology
from tvmpipe.executor.inputs import random_micro_batches
from tvmpipe.partition import plan_equal_ops

N = 12


def _port(addr: str) -> tuple[str, int]:
    host, port = addr.rsplit(":", 1)
    return host.removeprefix("[::ffff:").rstrip("]"), int(port)


def _check_sockets(bed: RayBed, addresses: list[tuple[str, int]], edges) -> dict:
    """Every stage listens on its host's address only; every edge is an ESTABLISHED connection
    from the producer's address to the consumer's listener. Returns what `ss` showed, per host."""
    by_addr = {h.address: h for h in bed.net.hosts}
    seen = {}
    for i, (addr, port) in enumerate(addresses):
        host = by_addr[addr]  # KeyError: a stage bound something that is not a bed address
        listening = [_port(c[3]) for c in host.sockets("-tl")]
        assert (addr, port) in listening, f"stage {i} does not listen on {addr}:{port}: {listening}"
        wild = [a for a in listening if a[1] == port and a[0] != addr]
        assert not wild, f"stage {i}'s data port {port} is also bound on {wild} (only {addr} allowed)"
    for src, dst in edges:
        (src_addr, _), (dst_addr, dst_port) = addresses[src], addresses[dst]
        host = by_addr[dst_addr]
        estab = [(_port(c[3]), _port(c[4])) for c in host.sockets("-t") if c[0] == "ESTAB"]
        peers = [peer for local, peer in estab if local == (dst_addr, dst_port)]
        assert any(p[0] == src_addr for p in peers), \
            f"no connection {src_addr} -> {dst_addr}:{dst_port} (edge {src}->{dst}); peers: {peers}"
        seen[f"{src}->{dst}"] = f"{src_addr} -> {dst_addr}:{dst_port}"
    return seen


@pytest.mark.parametrize("k,gpus", [(2, 1.0), (4, 0.0)])
def test_stages_one_per_host(bed: RayBed, tmp_path: Path, k: int, gpus: float):
    """K=2: GPU stages on two worker hosts; K=4: CPU stages on all four hosts, the head included."""
    bundle_dir = bed.head_only / "mlp"
    out = tmp_path / "out.npz"
    topo = build_topology(load_bundle(bundle_dir), plan_equal_ops(load_bundle(bundle_dir).graph, k))
    driver = k  # index of the driver's address in the "ready" event's list
    edges = [(driver if e.src == DRIVER else e.src, driver if e.dst == DRIVER else e.dst)
             for e in topo.edges if e.carries_data or e.dst == DRIVER]
    checked = {}

    def on_event(ev: dict) -> None:
        if ev["event"] == "ready":
            addrs = [tuple(a) for a in ev["addresses"]]
            stage_hosts = [a[0] for a in addrs[:k]]
            assert len(set(stage_hosts)) == k, f"STRICT_SPREAD put two stages on one host: {stage_hosts}"
            if gpus:
                assert bed.head.address not in stage_hosts, "a GPU stage landed on the head (0 GPUs)"
            assert addrs[driver][0] == bed.head.address, "the driver's listener is not on the head's address"
            checked.update(_check_sockets(bed, addrs, edges))

    events, err = drive(bed, {"bundle": str(bundle_dir), "stages": k, "gpus": gpus, "n": N, "seed": 5,
                                 "out": str(out), "hold": True}, on_event)
    end = events[-1] if events else {}
    assert end.get("event") == "end" and end["error"] is None, f"{events[-3:]}\n{err[-3000:]}"
    assert len(checked) == len(edges)
    want = reference_outputs(bundle_dir, random_micro_batches(load_bundle(bundle_dir), N, 5))
    got = np.load(out)
    assert_matches_oracle(got["output0"], np.stack([w[0] for w in want]), bed.env)


def test_edges_within_a_host_use_shared_memory_and_edges_between_hosts_tcp(bed: RayBed, tmp_path: Path):
    """4 stages at half a GPU each, packed: two stages per worker host. With transport="shm" every
    edge whose two ends share a host (Ray node) goes through shared memory, every edge between
    hosts (the driver is on the head) stays TCP, and the outputs are bit for bit the reference."""
    bundle_dir = bed.head_only / "mlp"
    out = tmp_path / "out.npz"
    events, err = drive(bed, {"bundle": str(bundle_dir), "stages": 4, "gpus": 0.5, "placement": "PACK", "n": N,
                              "seed": 5, "out": str(out), "transport": "shm"})
    end = events[-1] if events else {}
    assert end.get("event") == "end" and end["error"] is None, f"{events[-3:]}\n{err[-3000:]}"
    addrs = end["addresses"]
    host = lambda i: addrs[-1][0] if i == DRIVER else addrs[i][0]  # noqa: E731
    paths = {(src, dst): path for src, dst, path in end["paths"]}
    assert paths and all(path == ("shm" if host(s) == host(d) else "tcp") for (s, d), path in paths.items()), \
        (paths, addrs)
    assert {"shm", "tcp"} <= set(paths.values()), (paths, addrs)  # both kinds of edge were there
    want = reference_outputs(bundle_dir, random_micro_batches(load_bundle(bundle_dir), N, 5))
    assert_matches_oracle(np.load(out)["output0"], np.stack([w[0] for w in want]), bed.env)


def test_bundle_not_shipped_is_missing_on_workers(bed: RayBed, tmp_path: Path):
    """The control for the test above: without shipping, the worker hosts cannot read the bundle,
    and the run fails at start with an error naming the stage, not a hang."""
    events, err = drive(bed, {"bundle": str(bed.head_only / "mlp"), "stages": 2, "n": 2, "ship": False,
                                 "out": str(tmp_path / "o.npz"), "timeouts": {"start": 60}})
    assert not events or events[-1]["event"] != "end"
    assert "stage 0" in err and "mlp" in err, err[-3000:]


def test_job_ships_the_bundle_by_itself(bed: RayBed, tmp_path: Path):
    """`python -m tvmpipe.job` on the head, --ship-bundle auto (the default): it sees 4 nodes and
    ships; 3 GPU stages STRICT_SPREAD over the three worker hosts."""
    run = tmp_path / "run"
    done = bed.python("-m", "tvmpipe.job", str(bed.head_only / "mlp"), "--stages", "3", "--placement",
                         "STRICT_SPREAD", "--backend", "reference", "--gpus-per-stage", "1", "-n", "6",
                         "--seed", "2", "--run-dir", str(run))
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["cluster"]["nodes"] == 4, metrics["cluster"]
    assert not (run / "error.json").exists()
    want = reference_outputs(bed.head_only / "mlp", random_micro_batches(load_bundle(bed.head_only / "mlp"), 6, 2))
    assert_matches_oracle(np.load(run / "outputs.npz")["output0"], np.stack([w[0] for w in want]), bed.env)


def test_each_host_is_shipped_only_its_own_stages_weights(bed: RayBed, tmp_path: Path):
    """K = 3 across three hosts with the bundle shipped (it exists only on the head): each host
    receives one shipment holding exactly its stage's tensors (+ the small files and a slice
    header), each stage reads only those, and the outputs are the single-process run's."""
    from tests.support.synthetic_bundles import write_dense_stack
    from tvmpipe.cluster.control.shipping import stage_param_names

    bundle_dir = write_dense_stack(bed.head_only / "stack3", layers=6, width=64)
    bundle = load_bundle(bundle_dir)
    plan = plan_equal_ops(bundle.graph, 3)
    small = sum(p.stat().st_size for p in bundle_dir.iterdir() if p.name != "params.safetensors")
    out = tmp_path / "out.npz"
    events, err = drive(bed, {"bundle": str(bundle_dir), "stages": 3, "gpus": 0.0, "n": 4, "seed": 1,
                              "out": str(out), "weights": True})
    end = events[-1] if events else {}
    assert end.get("event") == "end" and end["error"] is None, f"{events[-3:]}\n{err[-3000:]}"
    hosts = [w["host"] for w in end["weights"]]
    assert len(set(hosts)) == 3, hosts
    away = [i for i, h in enumerate(hosts) if h != bed.head.address]
    assert len(end["shipped"]) == len(away) >= 2, f"one shipment per node the bundle is not on: {end['shipped']}"
    for i, (start, end_) in enumerate(plan.stages):
        own = sum(bundle.param_nbytes(n) for n in stage_param_names(bundle, start, end_))
        w = end["weights"][i]
        assert w["resident"] == own
        if i in away:
            assert small + own < w["shipped"] <= small + own + DATA_ALIGN, (i, w, own, small)
        else:  # on the head, where the bundle is: read in place, nothing sent
            assert w["shipped"] == 0, (i, w)
        assert own < w["read"] <= own + DATA_ALIGN, (i, w, own)
    assert sorted(end["shipped"].values()) == sorted(end["weights"][i]["shipped"] for i in away)
    want = reference_outputs(bundle_dir, random_micro_batches(bundle, 4, 1))
    assert_matches_oracle(np.load(out)["output0"], np.stack([x[0] for x in want]), bed.env)
