"""Multi-host fixtures: one NetBed of 4 hosts with a Ray cluster on it, shared by the whole session.

Starting 4 Ray nodes costs ~20-40 s and ~2 GB on the 2-core machines, so every multi-host test
shares ONE bed (`raybed`), torn down at session end; the teardown asserts that no process,
namespace or interface of the bed is left. Tests take it through `bed`, which first brings back
whatever an earlier test broke (`RayBed.revive`: a few seconds when nothing is broken).

These tests need root (network namespaces); they are skipped without it.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # netbed.py, raybed.py

from netbed import NetBed, available, sweep_orphans  # noqa: E402
from raybed import RayBed  # noqa: E402

ROOT = HERE.parents[1]


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.multihost)
    # The `ray up` module brings up (and tears down) a bed of its own: run it before any test that
    # starts the session's shared bed, so the two clusters never load the 2-core machine together.
    rayup = [i for i in items if Path(str(i.fspath)).name == "test_multihost_rayup.py"]
    if rayup:
        first = min(n for n, i in enumerate(items) if HERE in Path(str(i.fspath)).parents)
        rest = [i for i in items if i not in rayup]
        items[:] = rest[:first] + rayup + rest[first:]


@pytest.fixture(scope="session")
def netbed_ok() -> None:
    why = available()
    if why:
        pytest.skip(why)
    sweep_orphans()


@pytest.fixture(scope="session")
def raybed(netbed_ok):
    """4 hosts: the Ray head on hosts[0] (0 GPUs) with its job API (the dashboard, for `ray job
    submit`), workers on hosts[1..3] (1 fake GPU each); the mlp example copied to a directory only
    the head can see."""
    net = NetBed(4)
    bed = RayBed(net, dashboard=True)
    with net:
        try:
            bed.up()
            shutil.copytree(ROOT / "examples" / "mlp", bed.head_only / "mlp")
            yield bed
        finally:
            bed.down()
    assert net.leftovers() == []


@pytest.fixture
def bed(raybed: RayBed) -> RayBed:
    """The session's bed with every host in the cluster."""
    raybed.revive()
    return raybed
