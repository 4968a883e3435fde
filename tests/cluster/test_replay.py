"""Replay after a fault starts from what the surviving stages still hold (driver.py `_resume_points`):
a stage killed or failed mid-run is restarted, and no stage before or after it computes any
micro-batch a second time; only the restarted one does. The same runs with `replay="driver"`
recompute upstream, which is what these tests tell apart."""

from __future__ import annotations

from collections import Counter

import pytest
from tests.support.pipeline_harness import FlakyWorker, ThreadLauncher, assert_bit_identical, case, run_killing

from tvmpipe.bundle import load_bundle
from tvmpipe.cluster.control.launchers import Timeouts
from tvmpipe.cluster.driver import Pipeline
from tvmpipe.core.errors import TvmpipeError
from tvmpipe.partition import Plan


def computes(pipe: Pipeline) -> list[Counter]:
    """Per stage: how many times each micro-batch was computed by the worker that is there now."""
    return [Counter(e.seq for e in st.events) for st in pipe.record().worker_stats]


@pytest.mark.parametrize("replay,transport", [("upstream", "auto"), ("driver", "auto"), ("upstream", "shm")])
def test_a_killed_middle_stage_is_replayed_from_its_upstream_neighbour(bundles, replay, transport):
    """examples/cnn in 4 stage processes, 120 micro-batches, stage 2 SIGKILLed after 50: every output
    once, in order, equal to a clean run. Upstream replay: stages 0, 1 and 3 computed each
    micro-batch exactly once; the restarted stage 2 began where stage 3 had stopped. With
    transport="shm" every hop goes through shared-memory rings, and the retained outputs are sent
    again through the new epoch's rings."""
    inputs, want = case(bundles["cnn"], 120)
    with Pipeline(bundles["cnn"], 4, launcher="process", window=6, replay=replay, transport=transport,
                  timeouts=Timeouts(progress=20)) as pipe:
        got = run_killing(pipe, inputs, at=50, stage=2)
        assert pipe.restarts == [0, 0, 1, 0]
        counts = computes(pipe)
        (rp,) = pipe.replays
        if transport == "shm":
            assert set(pipe.edge_paths().values()) == {"shm"}
    assert_bit_identical(got, want)
    assert all(set(counts[s]) == set(range(120)) for s in (0, 1, 3))  # the survivors computed every one
    again = {s: sorted(q for q, n in counts[s].items() if n > 1) for s in (0, 1, 3)}
    if replay == "upstream":
        assert again == {0: [], 1: [], 3: []}, again
        assert rp.resume[0] >= rp.resume[1] >= rp.resume[3] >= rp.first and rp.resume[2] == rp.resume[3]
        assert rp.resume[1] > rp.first  # the in-flight micro-batches stage 1 had sent were not recomputed
        assert min(counts[2]) == rp.resume[3]  # the new stage 2 computed only what stage 3 still needed
    else:
        assert rp.resume == (rp.first,) * 4
        assert again[0], "driver replay recomputes what stage 0 had already sent"


def test_skip_edges_replay_from_every_producer(bundles):
    """skipnet cut in 4: stage 0 sends dense1 to stages 1 and 2 (a skip edge), the driver feeds x to
    stages 0 and 2, graph outputs leave stages 2 and 3. Stage 2 fails at micro-batch 7: each of its
    producers (stage 0, stage 1, the driver) serves it again, and nothing else is recomputed."""
    b = load_bundle(bundles["skipnet"])
    plan = Plan.from_cuts(b.graph, [1, 2, len(b.graph.op_nodes) - 1])
    inputs, want = case(bundles["skipnet"], 30)
    FlakyWorker.fail = {(2, 7): 1}
    try:
        with Pipeline(b, plan, launcher=ThreadLauncher(FlakyWorker), window=5) as pipe:
            got = pipe.run(inputs)
            assert pipe.restarts == [0, 0, 1, 0]
            counts = computes(pipe)
            (rp,) = pipe.replays
    finally:
        FlakyWorker.fail = {}
    assert_bit_identical(got, want)
    assert {s: max(counts[s].values()) for s in (0, 1, 3)} == {0: 1, 1: 1, 3: 1}
    assert all(set(counts[s]) == set(range(30)) for s in (0, 1, 3))
    # the new stage 2 starts at the micro-batch the old one failed on. The driver's first incomplete one can
    # be earlier: stage 3's output of micro-batch 6 may still be on its way when the fault is seen (seen once
    # in a fresh-clone run: first = 6); stage 3 then sends it again from what it kept, computing nothing twice
    assert rp.restarted == (2,) and rp.first <= rp.resume[2] == 7


def test_a_plan_that_needs_outputs_no_longer_held_is_refused(bundles):
    """A worker asked to send again what it did not keep says so (one line) instead of leaving its
    consumer waiting for frames that never come."""
    from tvmpipe.cluster.worker import StageSpec, StageWorker, Wiring

    b = load_bundle(bundles["tiny"])
    worker = StageWorker(StageSpec(0, 0, len(b.graph.nodes), str(b.path)))
    try:
        worker._next_seq = 5  # computed 0..4, kept nothing
        with pytest.raises(TvmpipeError, match="stage 0 cannot send micro-batches 2..4 again: it holds 5..4"):
            worker.prepare(Wiring("run", 1, 5, {}, [], send_from={-1: 2}, retain=4))
    finally:
        worker.close()


def test_replay_mode_is_checked(bundles):
    with pytest.raises(TvmpipeError, match="replay must be one of upstream, driver, none, got .sideways."):
        Pipeline(bundles["tiny"], 1, launcher=ThreadLauncher(), replay="sideways")
