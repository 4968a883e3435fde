"""An unpacked shipment lives exactly as long as some process on the node uses it (shipping.Lease).

A SIGKILLed stage actor cannot run its cleanup; before leases, its unpacked weights (gigabytes on a
big model) stayed in /tmp for good, and an actor restarted in its place reused them without ever
removing them. These tests kill real processes holding a lease.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.support.synthetic_bundles import write_dense_stack
from tvmpipe.bundle import load_bundle
from tvmpipe.cluster.control import shipping
from tvmpipe.cluster.control.shipping import build_shipment, sweep_unused, unpack

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def node_tmp(tmp_path, monkeypatch) -> Path:
    """This test's own node temp directory (in this process and in the children it starts)."""
    root = tmp_path / "node"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    monkeypatch.setenv("TMPDIR", str(root))
    return root


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Path:
    return write_dense_stack(tmp_path_factory.mktemp("lease") / "stack", layers=4, width=16)


def _shipment(stack: Path):
    return build_shipment(load_bundle(stack), [(0, 4)], [0])


def _entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


HOLDER = textwrap.dedent("""
    import pickle, sys, time
    from tvmpipe.cluster.control.shipping import unpack
    ship = pickle.loads(sys.stdin.buffer.read())
    made = unpack(ship, "child")
    print(made.path, flush=True)
    time.sleep(600)
""")


def _holder(ship) -> tuple[subprocess.Popen, str]:
    import pickle

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    proc.stdin.write(pickle.dumps(ship))
    proc.stdin.close()
    line = proc.stdout.readline().decode().strip()
    assert line, "the holder process failed to unpack"
    return proc, line


def test_the_last_user_removes_the_directory(stack, node_tmp):
    ship = _shipment(stack)
    a, b = unpack(ship, "a"), unpack(ship, "b")
    assert a.path == b.path and Path(a.path, "bundle.json").is_file()
    a.lease.release()
    assert Path(b.path, "bundle.json").is_file(), "removed while another process still used it"
    assert sweep_unused() == [] and Path(b.path).is_dir()
    b.lease.release()
    b.lease.release()  # idempotent
    assert _entries(node_tmp) == [], "the directory and its lock file are gone"


def test_a_killed_users_copy_is_swept_and_a_successor_that_reused_it_removes_it(stack, node_tmp):
    ship = _shipment(stack)
    proc, path = _holder(ship)
    try:
        assert sweep_unused() == [], "a live holder's shipment must not be swept"
        reused = unpack(ship, "restarted")  # a restarted actor on the node: reuses the killed one's copy
        assert reused.path == path
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert Path(path, "bundle.json").is_file(), "still used by the restarted actor"
    reused.lease.release()
    assert _entries(node_tmp) == []


def test_a_killed_actors_copy_goes_at_the_next_unpack_or_sweep(stack, node_tmp):
    ship = _shipment(stack)
    proc, path = _holder(ship)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert Path(path).is_dir(), "killed: nothing ran its cleanup"
    other = build_shipment(load_bundle(stack), [(0, 2)], [0])  # another run's shipment on this node
    assert other.key != ship.key
    made = unpack(other, "next")
    assert not Path(path).exists(), "the next unpack on the node sweeps what no live process uses"
    made.lease.release()
    assert _entries(node_tmp) == []


def test_a_legacy_whole_copy_is_leased_too(stack, node_tmp):
    files = {p.name: p.read_bytes() for p in stack.iterdir()}
    made = unpack(files, "old")
    assert Path(made.path, "bundle.json").is_file() and not made.partial
    assert sweep_unused() == []
    made.lease.release()
    assert _entries(node_tmp) == []


def test_a_half_written_unpack_of_a_killed_process_is_swept(stack, node_tmp):
    ship = _shipment(stack)
    final = node_tmp / f"{shipping.SHIP_PREFIX}{ship.key}"
    part = node_tmp / f".{final.name}-x1y2"  # what a process killed mid-write leaves
    part.mkdir()
    (part / "params.safetensors").write_bytes(b"\0" * 100)
    (node_tmp / f"{final.name}.lock").touch()
    assert sweep_unused() == [final]
    assert _entries(node_tmp) == []
