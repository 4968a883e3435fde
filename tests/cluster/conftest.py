"""Cluster test fixtures: bundles, one session-wide loopback Ray cluster, and leak checks.

Ray costs ~4-8 s and ~700 MB to start on the 2-core machines, so every Ray test shares ONE cluster
(`ray_cluster`), started lazily by the first test that needs it and shut down at session end, when
the fixture also asserts that nothing the tests started survived: no Ray or worker processes
below this one, and none of the data-plane ports the workers listened on.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.support.paths import EXAMPLES, EXAMPLES_DIR
from tests.support.pipeline_harness import cmdline, descendants, listening_ports, opened_ports
from tests.support.synthetic_bundles import write_convnet, write_skipnet
from tests.support.tiny_bundle import write_tiny


RAY_CPUS = 4  # logical: stage actors reserve 0.25 each (Placement(cpus=0.25))
RAY_FAKE_GPUS = 2  # ray.init(num_gpus=2) on a CPU machine: tests fractional GPU placement


@pytest.fixture(scope="session")
def bundles(tmp_path_factory) -> dict[str, Path]:
    """name -> bundle directory: the built-in examples and handmade graphs (skipnet: skip connections
    crossing any cut, a graph input read by a late node, graph outputs from two stages)."""
    d = tmp_path_factory.mktemp("bundles")
    out = {"tiny": write_tiny(d / "tiny"), "skipnet": write_skipnet(d / "skipnet"),
           "convnet": write_convnet(d / "convnet")}
    for name in EXAMPLES:
        out[name] = EXAMPLES_DIR / name
    return out


@pytest.fixture(scope="session")
def ray_cluster():
    """The one embedded Ray cluster of the session, on 127.0.0.1 only."""
    from tvmpipe.cluster.control.local import local_ray

    before = descendants(os.getpid())
    with local_ray(num_cpus=RAY_CPUS, num_gpus=RAY_FAKE_GPUS):
        import ray

        yield ray
    deadline = time.time() + 10  # Ray's processes exit asynchronously after shutdown
    while (left := descendants(os.getpid()) - before) and time.time() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left after Ray shutdown: {[(p, cmdline(p)) for p in sorted(left)]}"
    still = opened_ports() & listening_ports()
    assert not still, f"worker data-plane ports still listening after the session: {sorted(still)}"
