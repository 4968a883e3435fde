"""The link probe (cluster/linkprobe.py): figures through the real data plane, and a listener that
refuses whoever does not hold the probe's secret, like every other listener."""

from __future__ import annotations

import math
import socket

import pytest

from tvmpipe.cluster.wire.handshake import new_secret
from tvmpipe.cluster.linkprobe import BIG, SMALL, LinkFigures, Prober, figures, measure_links


@pytest.fixture
def probers():
    secret = new_secret()
    a, b = Prober("127.0.0.1", 0, "run1", secret), Prober("127.0.0.1", 1, "run1", secret)
    peers = {0: a.address(), 1: b.address()}
    a.set_peers(peers)
    b.set_peers(peers)
    yield a, b
    a.close()
    b.close()


def test_round_trips_of_small_and_big_frames(probers):
    a, b = probers
    small, big = a.probe(1)
    assert 0 < small < big  # 4 MB takes longer than 4 KB on any machine
    f = figures("127.0.0.1", "127.0.0.1", small, big)
    assert f.latency_us == pytest.approx(small / 2 * 1e6)
    assert f.bandwidth == pytest.approx((BIG - SMALL) / (big - small))
    self_small, self_big = b.probe(1)  # loopback to itself: the same path
    assert 0 < self_small < self_big


def test_a_peer_without_the_secret_is_refused_and_the_probe_goes_on(probers, monkeypatch):
    monkeypatch.setattr("tvmpipe.cluster.linkprobe.CONNECT_TIMEOUT_S", 1.0)  # it retries until then
    a, b = probers
    stranger = Prober("127.0.0.1", 0, "run1", new_secret())  # right run id and index, wrong key
    stranger.set_peers({0: stranger.address(), 1: b.address()})
    try:
        with pytest.raises(OSError):
            stranger.probe(1)
    finally:
        stranger.close()
    with socket.create_connection(b.address(), timeout=5) as raw:  # junk instead of a hello
        raw.sendall(b"\x00" * 300)
        raw.settimeout(5)
        try:
            while raw.recv(4096):
                pass
        except OSError:
            pass
    small, big = a.probe(1)
    assert 0 < small < big


def test_measure_links_on_a_ray_cluster(ray_cluster):
    (f,) = measure_links()  # one node: its loopback
    assert isinstance(f, LinkFigures) and f.src == f.dst == "127.0.0.1"
    assert 0 < f.latency_us < 1e6 and 0 < f.bandwidth and math.isfinite(f.bandwidth)
    with pytest.raises(Exception, match="no alive Ray node at 10.9.9.9"):
        measure_links(["10.9.9.9"])


def test_the_planner_charges_what_was_measured(bundles):
    """summarize -> model_link: loopback median as the baseline, the network's bandwidth and only the
    latency it adds; a slower measured network makes the predicted transfer, and the stage, slower."""
    from tvmpipe.bundle import load_bundle
    from tvmpipe.cluster.linkprobe import summarize
    from tvmpipe.partition import plan_equal_ops
    from tvmpipe.partition.model import PipelineModel
    from tvmpipe.partition.predict import predict

    loops = [LinkFigures(h, h, lat, 2e9) for h, lat in (("10.0.0.1", 80.0), ("10.0.0.2", 90.0), ("10.0.0.3", 100.0))]
    net = [LinkFigures("10.0.0.1", "10.0.0.2", 150.0, 1e9), LinkFigures("10.0.0.2", "10.0.0.1", 130.0, 1.2e9),
           LinkFigures("10.0.0.1", "10.0.0.3", 170.0, 0.8e9)]
    m = summarize(loops + net)
    assert (m.loopback.latency_us, m.network.latency_us, m.network.bandwidth) == (90.0, 150.0, 1e9)
    across, local = m.model_link(across_nodes=True), m.model_link(across_nodes=False)
    assert (across.latency_us, across.bandwidth) == (60.0, 1e9)  # only what the network adds to loopback
    assert (local.latency_us, local.bandwidth) == (0.0, 2e9)
    assert summarize(loops).network is None and summarize(loops).model_link(True).bandwidth == 2e9
    b = load_bundle(bundles["cnn"])
    plan = plan_equal_ops(b.graph, 2)
    fast = predict(PipelineModel.build(b, link=across), plan, 100)
    slow_links = summarize(loops + [LinkFigures(f.src, f.dst, f.latency_us, f.bandwidth / 100) for f in net])
    slow = predict(PipelineModel.build(b, link=slow_links.model_link(True)), plan, 100)
    nbytes = fast.stages[1].in_bytes
    assert fast.stages[1].transfer_us == pytest.approx(60.0 + nbytes / 1e9 * 1e6)
    assert slow.stages[1].transfer_us == pytest.approx(60.0 + nbytes / 1e7 * 1e6)
    assert slow.throughput < fast.throughput
