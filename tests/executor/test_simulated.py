"""The simulated backend: right shapes and dtypes, no compute, and delays that match its model."""

from __future__ import annotations

import time

import pytest

from tvmpipe.bundle import load_bundle
from tvmpipe.executor import ExecutorError, GraphRunner, Stage, feeds_by_entry, random_inputs
from tvmpipe.executor.backend_simulated import op_flops, precise_sleep


def test_outputs_shapes_dtypes(bundles):
    b = bundles["skipnet"]
    ref = Stage(b, 0, 7)
    sim = Stage(b, 0, 7, backend="simulated")
    feeds = feeds_by_entry(b, random_inputs(b))
    want, got = ref.run(feeds), sim.run(feeds)
    assert got.keys() == want.keys()
    for e in want:
        assert got[e].shape == want[e].shape and got[e].dtype == want[e].dtype and not got[e].any()
    with pytest.raises(ValueError):
        got[next(iter(got))][...] = 1  # shared zeros are read-only


def test_profile_driven_delay(bundles):
    b = bundles["convnet"]
    n = len(b.graph.nodes)
    per_node = {nid: 4000.0 for nid in b.graph.op_nodes}  # 4 ms per node
    prof = {"nodes": [{"node": nid, "name": b.graph.nodes[nid].name, "time_us": t} for nid, t in per_node.items()]}
    s = Stage(b, 0, n, backend="simulated", cost_profile=prof)
    want = sum(per_node.values()) * 1e-6
    feeds = feeds_by_entry(b, random_inputs(b))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        s.run(feeds)
        times.append(time.perf_counter() - t0)
    assert want <= min(times) < want + 0.003, (want, times)
    _, timings = s.run_profiled(feeds)
    assert [t.seconds for t in timings] == pytest.approx([4e-3] * len(timings))
    part = Stage(b, 0, b.graph.node_index["gap"], backend="simulated", cost_profile=prof)
    assert part.backend.total == pytest.approx(4e-3 * len(part.program.steps))


def test_profile_of_another_model_refused(bundles):
    b = bundles["convnet"]
    prof = {"nodes": [{"node": nid, "name": "other", "time_us": 1.0} for nid in b.graph.op_nodes]}
    with pytest.raises(ExecutorError, match="profile is of another model"):
        Stage(b, 0, len(b.graph.nodes), backend="simulated", cost_profile=prof)
    with pytest.raises(ExecutorError, match="no time for node"):
        Stage(b, 0, len(b.graph.nodes), backend="simulated", cost_profile={"nodes": []})


def test_analytic_model(bundles):
    b = bundles["convnet"]
    s = Stage(b, 0, len(b.graph.nodes), backend="simulated", device="t4")
    conv = b.ops["fused_conv2d_add_relu"].ops[0]
    assert op_flops(conv) == 2 * 8 * 8 * 8 * 3 * 3 * 3
    times = dict(zip([st.name for st in s.program.steps], s.backend.step_seconds))
    assert times["flatten"] == 0.0  # __nop: no launch
    assert times["conv1"] > 0 and times["fc"] > times["flatten"]
    slow = Stage(b, 0, len(b.graph.nodes), backend="simulated", device="t4", time_scale=10.0)
    assert slow.backend.total == pytest.approx(10 * s.backend.total)


def test_bare_graph_uniform(fixtures_dir):
    b = load_bundle(fixtures_dir / "wrn_fc_nnvm.json")
    r = GraphRunner(b, backend="simulated", uniform_us=1000.0)
    r.set_input(**random_inputs(b))
    prof = r.profile(repeat=1, warmup=0)
    assert [n.time_us for n in prof.nodes] == pytest.approx([1000.0] * len(b.graph.op_nodes))
    assert r.get_output(0).shape == b.graph.entries[b.graph.head_entries[0]].shape


def test_precise_sleep():
    """Never short; over by well under a millisecond (best of 5: CI machines get descheduled)."""
    for want in (0.0002, 0.002, 0.02):
        got = []
        for _ in range(5):
            t0 = time.perf_counter()
            precise_sleep(want)
            got.append(time.perf_counter() - t0)
        assert min(got) >= want and min(got) < want + 0.001
