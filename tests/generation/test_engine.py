"""The EngineThread (the Engine on its own thread, for servers) on a real pipeline: the zoo's GPT-2
decode step (max context 20) as 2 stage processes on the reference backend.

Requests submitted from several threads give the tokens of an offline Generator run of the same
requests; the callback sees every output, then the end; cancel frees a row for a waiting request;
the bound on waiting requests; drain; close; and the steps left in flight once every sequence has
ended are collected (left unread they would look like a stall to the driver's supervisor)."""

from __future__ import annotations

import threading
import time

import pytest

from tvmpipe.cluster.driver import Pipeline
from tvmpipe.core.errors import TvmpipeError
from tvmpipe.executor.sampler import Sampling
from tvmpipe.generation import Generator, Request, layout_of
from tvmpipe.generation.engine import EngineClosed, EngineThread as Engine, QueueFull
from tvmpipe.generation.requests import FinishReason

pytest.importorskip("tvm")
pytestmark = [pytest.mark.tvm]

PROMPTS = [[5, 17, 3], [60], [1, 2, 3, 4], [9, 9], [33, 0, 12], [7], [100, 3], [8, 8, 8]]
SAMPLED = Sampling(0.8, 30, 11, 0.9)


@pytest.fixture(scope="module")
def pipe(zoo_decoder):
    bundle, _ = zoo_decoder("gpt2")
    with Pipeline(bundle, 2, launcher="process", logits=False) as p:  # 4 slots: 4 rows
        yield p


def requests(pipe, n: int, sampling: Sampling = Sampling(), prompts=PROMPTS) -> list[Request]:
    layout = layout_of(pipe.bundle)
    return [Request.checked(p, n, layout, sampling=sampling, key=0) for p in prompts]


def wait_for(what, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while not what():
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("sampling", [Sampling(), SAMPLED], ids=["greedy", "sampled"])
def test_requests_from_many_threads_equal_an_offline_run(pipe, sampling):
    """8 requests (4 rows: half wait) submitted from 8 threads at once, each keyed 0 as a served
    request is: each stream's tokens equal an offline Generator run of the same request, the
    callback gets every event in order and then None, and the stats count them."""
    reqs = requests(pipe, 8, sampling)
    want = [r.tokens for r in Generator(pipe).generate_all(reqs)]
    engine = Engine(pipe)
    try:
        assert engine.rows == 4
        seen: dict[int, list] = {}
        streams = [None] * len(reqs)

        def submit(i: int) -> None:
            log = seen.setdefault(i, [])
            streams[i] = engine.submit(reqs[i], on_output=log.append)

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(reqs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        got = [[t for e in s for t in e.token_ids] for s in streams]  # iterating blocks until each ends
        assert got == want
        for i, s in enumerate(streams):
            assert s.result.finish == FinishReason.LENGTH and s.result.tokens == want[i] and s.error is None
            wait_for(lambda: seen[i] and seen[i][-1] is None)
            assert [t for e in seen[i][:-1] for t in e.token_ids] == want[i] and len(seen[i]) == 9
            assert seen[i][-2].finish == FinishReason.LENGTH and seen[i][-2].result is s.result
            assert all(e.finish is None for e in seen[i][:-2])
        stats = engine.stats()
        assert (stats.submitted, stats.finished, stats.cancelled, stats.generated_tokens) == (8, 8, 0, 64)
        assert stats.running == stats.waiting == 0 and stats.free_rows == 4
    finally:
        engine.close()


def test_cancel_frees_a_row_for_a_waiting_request(pipe):
    """4 rows busy with long sequences and a fifth waiting: cancelling one (a client that went
    away) ends it early with finish CANCELLED, its last output saying so, and the waiting one
    takes its row and runs to the end while the others still run."""
    reqs = requests(pipe, 16, prompts=[[5], [6], [7], [8], [9]])
    engine = Engine(pipe)
    try:
        streams = [engine.submit(r) for r in reqs]
        first = iter(streams[0])
        next(first)  # running
        wait_for(lambda: engine.stats().running == 4)
        assert engine.stats().waiting == 1
        engine.cancel(streams[0].index)
        assert streams[4].wait(60).finish == FinishReason.LENGTH
        for s in streams:
            s.wait(60)
        assert streams[0].result.finish == FinishReason.CANCELLED and len(streams[0].result.tokens) < 16
        assert list(streams[0])[-1].finish == FinishReason.CANCELLED
        # the waiting request did not wait for the others to end: they still ran when it got a row
        assert min(s.result.token_times[-1] for s in streams[2:4]) > streams[4].result.token_times[0]
        stats = engine.stats()
        assert (stats.finished, stats.cancelled) == (5, 1)
        engine.cancel(streams[2].index)  # already ended: nothing
        assert engine.stats().cancelled == 1
    finally:
        engine.close()


def test_the_wait_bound_and_drain(pipe):
    """At most rows + max_waiting requests at once: one more is QueueFull (and counted), and a
    row freed makes room again. drain() lets running and waiting requests finish; afterwards
    submit is EngineClosed. A drain whose bound is too short cancels what is left."""
    engine = Engine(pipe, max_waiting=2)
    try:
        reqs = requests(pipe, 12, prompts=[[p] for p in range(10, 17)])
        streams = [engine.submit(r) for r in reqs[:6]]
        with pytest.raises(QueueFull, match="4 sequence rows are busy and 2 requests"):
            engine.submit(reqs[6])
        assert engine.stats().rejected == 1
        streams[0].wait(60)
        streams.append(engine.submit(reqs[6]))  # room again
        assert engine.drain(60) is True
        assert all(s.result.finish == FinishReason.LENGTH and len(s.result.tokens) == 12 for s in streams)
        with pytest.raises(EngineClosed, match="shutting down"):
            engine.submit(reqs[0])
        assert engine.stats().draining
    finally:
        engine.close()
    engine = Engine(pipe)
    try:
        long = requests(pipe, 18, prompts=[[p] for p in range(20, 26)])
        streams = [engine.submit(r) for r in long]
        next(iter(streams[0]))
        assert engine.drain(0.0) is False
        assert all(s.done for s in streams)
        assert any(s.result.finish == FinishReason.CANCELLED for s in streams)
        assert engine.stats().cancelled >= 1
    finally:
        engine.close()


def test_steps_left_in_flight_are_collected_when_idle(pipe):
    """A sequence that stops on a stop token leaves steps submitted ahead in flight; the idle
    engine collects them, so the pipeline has nothing outstanding (no stall for the supervisor)."""
    engine = Engine(pipe)
    try:
        layout = layout_of(pipe.bundle)
        greedy = Generator(pipe).generate_all(requests(pipe, 10, prompts=[[5, 17, 3]]))[0].tokens
        stop = greedy[3]
        s = engine.submit(Request.checked([5, 17, 3], 10, layout, stop_tokens=[stop], key=0))
        assert s.wait(60).finish == FinishReason.STOP and s.result.tokens == greedy[:greedy.index(stop) + 1]
        wait_for(lambda: pipe.in_flight == 0, 10)
    finally:
        engine.close()


def test_a_failing_callback_is_dropped_and_close_ends_open_streams(pipe):
    """A callback that raises (its event loop gone) is dropped, the engine serves on, and the
    stream stays readable; close() ends the streams still open with an error."""
    engine = Engine(pipe)
    try:
        def boom(output):
            raise RuntimeError("event loop is closed")

        reqs = requests(pipe, 8, prompts=[[5], [6]])
        s = engine.submit(reqs[0], on_output=boom)
        assert len([t for e in s for t in e.token_ids]) == 8 and s.on_output is None
        assert engine.submit(reqs[1]).wait(60).finish == FinishReason.LENGTH
        long = engine.submit(requests(pipe, 19, prompts=[[7]])[0])
        next(iter(long))
    finally:
        engine.close()
    assert long.done and (long.result.finish == FinishReason.LENGTH if long.result else long.error == "the engine was closed")
    with pytest.raises(EngineClosed):
        engine.submit(reqs[0])


def test_a_bad_bound_is_one_line(pipe):
    with pytest.raises(TvmpipeError, match="max_waiting must be an integer >= 0"):
        Engine(pipe, max_waiting=-1)


def test_static_batch_rows(zoo_decoder):
    """A `--batch 2` step: rows are slots x 2, and served requests (keyed 0) give the tokens of an
    offline run whatever row they land in."""
    bundle, _ = zoo_decoder("gpt2", 2)
    with Pipeline(bundle, 2, launcher="process", logits=False, slots=2) as p:
        reqs = requests(p, 6, SAMPLED, prompts=PROMPTS[:5])
        want = [r.tokens for r in Generator(p).generate_all(reqs)]
        engine = Engine(p, max_waiting=1)
        try:
            assert engine.rows == 4
            streams = [engine.submit(r) for r in reqs]
            assert [[t for e in s for t in e.token_ids] for s in streams] == want
        finally:
            engine.close()
