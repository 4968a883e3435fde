"""Pipelines without Ray: worker processes (the GPU machine's mode) and in-process workers (fault
injection). The same driver runs on Ray in test_ray.py."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from tests.support.pipeline_harness import (FlakyWorker, ThreadLauncher, alive, assert_bit_identical, batches, case, listening_ports,
                    record_ports)

from tvmpipe.bundle import load_bundle
from tvmpipe.cluster.driver import Pipeline, PipelineError
from tvmpipe.cluster.wire.frames import DRIVER
from tvmpipe.cluster.control.launchers import Timeouts, WorkerError
from tvmpipe.executor.errors import InputError
from tvmpipe.partition import Plan


def run_pipeline(bundle, plan, inputs, **kw):
    with Pipeline(bundle, plan, **kw) as pipe:
        record_ports(pipe)
        return pipe.run(inputs), pipe


@pytest.mark.parametrize("model", ["tiny", "convnet", "skipnet"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_process_launcher_matches_single_process(bundles, model, k):
    if k > len(load_bundle(bundles[model]).graph.op_nodes):
        pytest.skip("fewer op nodes than stages")
    inputs, want = case(bundles[model], 12)
    got, _ = run_pipeline(bundles[model], k, inputs, launcher="process")
    assert_bit_identical(got, want)


def test_every_cut_of_a_graph_with_skip_connections(bundles):
    """skipnet: dense1's output feeds three later nodes, x is re-read by `mix`, and there are two
    graph outputs; every single cut sends them straight to every consumer stage."""
    b = load_bundle(bundles["skipnet"])
    inputs, want = case(bundles["skipnet"], 6)
    for cut in range(1, len(b.graph.op_nodes)):
        plan = Plan.from_cuts(b.graph, [cut])
        with Pipeline(b, plan, launcher=ThreadLauncher()) as pipe:
            assert_bit_identical(pipe.run(inputs), want)
            edges = pipe.topology.edges
            # no tensor reaches a stage through the driver: driver->stage edges carry graph inputs only
            assert all(set(e.entries) <= set(pipe.topology.inputs.values()) for e in edges if e.src == DRIVER)


def test_skip_edges_go_producer_to_every_consumer(bundles):
    b = load_bundle(bundles["skipnet"])
    n = len(b.graph.op_nodes)
    with Pipeline(b, Plan.from_cuts(b.graph, [1, 2, n - 1]), launcher=ThreadLauncher()) as pipe:
        edges = {(e.src, e.dst): e.entries for e in pipe.topology.edges}
        h1 = b.graph.entry_id(b.graph.node_index["dense1"])
        assert h1 in edges[(0, 1)] and h1 in edges[(0, 2)]  # skip connection 0 -> 2, not relayed by 1
        x = b.graph.entry_id(b.graph.node_index["x"])
        assert x in edges[(DRIVER, 0)] and x in edges[(DRIVER, 2)]  # graph input read late
        heads_from = {src for (src, dst), es in edges.items() if dst == DRIVER and es}
        assert len(heads_from) == 2  # graph outputs leave two different stages
        inputs, want = case(bundles["skipnet"], 4)
        assert_bit_identical(pipe.run(inputs), want)
        m = pipe.metrics()
        by_edge = {(e.src, e.dst): e for e in m.edges}
        assert by_edge[(0, 2)].frames == 4 and by_edge[(0, 2)].bytes > by_edge[(0, 2)].bytes_per_micro_batch * 4


def test_streaming_submit_get_in_order(bundles):
    inputs, want = case(bundles["tiny"], 30)
    with Pipeline(bundles["tiny"], 3, launcher=ThreadLauncher(), window=4) as pipe:
        seqs = [pipe.submit(x) for x in inputs[:10]]
        assert seqs == list(range(10))
        first = [pipe.get(timeout=10) for _ in range(5)]
        for x in inputs[10:]:
            pipe.submit(x)
        rest = list(pipe.results())
    assert_bit_identical(first + rest, want)


def test_a_producer_thread_and_a_consumer_thread(bundles):
    """submit() on a full window and get() both read outputs themselves (the driver's polled
    listener): with one thread each, neither may wait for the other's frames. 60 micro-batches
    through a window of 2 would take minutes if either waited out a poll timeout."""
    inputs, want = case(bundles["tiny"], 60)
    with Pipeline(bundles["tiny"], 3, launcher=ThreadLauncher(), window=2) as pipe:
        errors: list[BaseException] = []

        def produce():
            try:
                for x in inputs:
                    pipe.submit(x)
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        producer = threading.Thread(target=produce)
        t = time.monotonic()
        producer.start()
        got = []
        while len(got) < len(inputs):
            if pipe.submitted > len(got):
                got.append(pipe.get(timeout=30))
            else:
                time.sleep(0.001)
        producer.join(timeout=30)
        assert not errors and not producer.is_alive()
        assert time.monotonic() - t < 30
    assert_bit_identical(got, want)


def test_window_bounds_in_flight(bundles):
    with Pipeline(bundles["tiny"], 2, launcher=ThreadLauncher(), window=3) as pipe:
        inputs = batches(bundles["tiny"], 40)
        pipe.run(inputs)
        inflight = [sum(1 for s in pipe.submit_times if pipe.submit_times[s] <= t < pipe.done_times[s])
                    for t in pipe.submit_times.values()]
        assert max(inflight) <= 3


@pytest.mark.parametrize("bad, match", [
    ({"y": np.zeros((1, 4), np.float32)}, "unknown input"),
    ({}, "missing input"),
    ({"x": np.zeros((1, 4), np.float64)}, "float32"),
    ({"x": np.zeros((4, 1), np.float32)}, r"\[1, 4\]"),
    ({"x": [[0.0] * 4]}, "list"),
    ([np.zeros((1, 4), np.float32)], "dict"),
])
def test_wrong_inputs_are_rejected_before_any_stage_runs(bundles, bad, match):
    good, want = case(bundles["tiny"], 3)
    with Pipeline(bundles["tiny"], 2, launcher=ThreadLauncher()) as pipe:
        with pytest.raises(InputError, match=match):
            pipe.run(good + [bad])
        with pytest.raises(InputError, match=match):
            pipe.submit(bad)
        assert all(not s.events for s in pipe.launcher.call_all("stats"))
        assert pipe.metrics().micro_batches == 0
        assert_bit_identical(pipe.run(good), want)  # still usable


def test_a_failing_micro_batch_is_replayed_once_restarted(bundles):
    inputs, want = case(bundles["skipnet"], 20)
    FlakyWorker.fail = {(1, 7): 1}
    with Pipeline(bundles["skipnet"], 3, launcher=ThreadLauncher(FlakyWorker), window=4) as pipe:
        got = pipe.run(inputs)
        assert pipe.restarts == [0, 1, 0]
        assert any("injected failure at micro-batch 7" in e for e in pipe.errors)
    assert_bit_identical(got, want)


def test_a_stage_that_keeps_failing_ends_the_run_with_completed_outputs(bundles):
    inputs, want = case(bundles["skipnet"], 20)
    FlakyWorker.fail = {(2, 9): 100}
    with Pipeline(bundles["skipnet"], 3, launcher=ThreadLauncher(FlakyWorker), window=4, max_restarts=2) as pipe:
        with pytest.raises(PipelineError) as info:
            pipe.run(inputs)
    FlakyWorker.fail = {}
    err = info.value
    assert err.stage == 2 and "stage 2" in str(err) and "injected failure at micro-batch 9" in err.last_error
    assert_bit_identical(err.completed, want[:9])


def test_stage_that_fails_to_start_is_named(bundles):
    with pytest.raises(WorkerError, match="stage 0.*failed to start.*unknown simulated device"):
        Pipeline(bundles["tiny"], 2, launcher="process", backend="simulated", backend_opts={"device": "abacus"})


def test_kill_a_stage_process_mid_run(bundles):
    """200 micro-batches, stage 1's process SIGKILLed after ~60: 200 outputs, each once, in order,
    equal to a clean run."""
    inputs, want = case(bundles["mlp"], 200)
    with Pipeline(bundles["mlp"], 3, launcher="process", window=6, timeouts=Timeouts(progress=20)) as pipe:
        record_ports(pipe)
        pids = [s.pid for s in pipe.status()]
        got = []
        for i, x in enumerate(inputs):
            pipe.submit(x)
            if i == 60:
                assert pipe.submitted - pipe.ready - len(got) > 0  # micro-batches in flight when the stage dies
                pipe.launcher.kill(1)
            while pipe.ready:
                got.append(pipe.get())
        got += list(pipe.results())
        assert pipe.restarts == [0, 1, 0]
        new_pids = [s.pid for s in pipe.status()]
    assert_bit_identical(got, want)
    assert new_pids[0] == pids[0] and new_pids[2] == pids[2] and new_pids[1] != pids[1]
    assert not any(alive(p) for p in new_pids + pids)


def test_a_stuck_stage_is_restarted_then_fails_the_run(bundles):
    b = load_bundle(bundles["tiny"])
    slow = {"nodes": [{"node": n, "name": b.graph.nodes[n].name, "time_us": 3e6 if n == 5 else 10.0}
                      for n in b.graph.op_nodes]}
    t0 = time.time()
    with Pipeline(b, 2, launcher="process", backend="simulated", backend_opts={"cost_profile": slow}, warmup=0,
                  timeouts=Timeouts(progress=1.0, shutdown=1.0), max_restarts=1) as pipe:
        stuck = "stage 1 failed 2 times.*micro-batch 0 has run for .* s .no micro-batch completed for 1 s"
        with pytest.raises(PipelineError, match=stuck) as info:
            pipe.run(batches(b.path, 2))
        assert info.value.completed == []
    assert time.time() - t0 < 20


def test_close_leaves_no_process_or_socket(bundles):
    pipe = Pipeline(bundles["tiny"], 3, launcher="process")
    pids = [s.pid for s in pipe.status()]
    ports = {port for _, port in pipe.addresses}
    pipe.run(batches(bundles["tiny"], 5))
    pipe.close()
    pipe.close()  # idempotent
    assert not ports & listening_ports()
    assert not any(alive(p) for p in pids)


def test_record_since_returns_only_the_newer_micro_batches(bundles):
    """A sweep reads the record after every round of a pipeline that stays open for tens of thousands of
    micro-batches: `record(since=s)` carries the driver's and every worker's timings of micro-batches
    s on only, and byte counts since the start."""
    inputs, _ = case(bundles["skipnet"], 10)
    with Pipeline(bundles["skipnet"], 2, launcher="process") as pipe:
        pipe.run(inputs)
        whole, recent = pipe.record(), pipe.record(since=7)
    assert sorted(whole.done_times) == list(range(10)) and sorted(recent.done_times) == [7, 8, 9]
    assert sorted(recent.submit_times) == [7, 8, 9]
    for full, newer in zip(whole.worker_stats, recent.worker_stats):
        assert sorted(e.seq for e in full.events) == list(range(10))
        assert [e for e in full.events if e.seq >= 7] == newer.events
        assert newer.bytes_out == full.bytes_out and sum(newer.bytes_out.values()) > 0


def test_a_kill_racing_the_supervisors_restart_leaves_the_new_worker_in_place(bundles):
    """A fault injected from one thread (launcher.kill, as the fault tests do) while the supervisor
    restarts the same stage on another: the kill that finishes last must not empty the slot the
    restart filled, nor close a pipe a second time (its fd number may be the new worker's by then:
    "recovery ... failed: OSError: [Errno 9] Bad file descriptor" in a full-suite run). The
    launcher runs on its own here (a pipeline's stage specs, no supervisor), so that this thread's
    restart is the only one."""
    from tvmpipe.cluster.control.launchers import ProcessLauncher

    with Pipeline(bundles["mlp"], 2, launcher="process") as pipe:
        specs = list(pipe.launcher._specs)
    launcher = ProcessLauncher()
    try:
        launcher.start(specs)
        old = launcher._children[1]
        slow_join, in_kill = old.proc.join, threading.Event()

        def join(timeout=None):  # the injected kill reaps its process only once the restart has replaced it
            if threading.current_thread() is killer:
                in_kill.set()
                deadline = time.time() + 30
                while launcher._children[1] in (None, old) and time.time() < deadline:
                    time.sleep(0.01)
            return slow_join(timeout)

        old.proc.join = join
        killer = threading.Thread(target=launcher.kill, args=(1,))
        killer.start()
        assert in_kill.wait(10)
        launcher.restart(1)  # the supervisor's restart, while the kill is still under way
        killer.join()
        new = launcher._children[1]
        assert new is not None and new is not old and new.proc.is_alive()
        assert len(launcher.call(1, "address")) == 2  # its control pipe works
    finally:
        launcher.shutdown()
