"""ServedSequence: a reader that falls behind its sequence takes what arrived as one output (one
SSE event, not one a token), and nothing is lost or reordered around a failure."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tvmpipe.generation.output import RequestOutput
from tvmpipe.generation.requests import FinishReason, Request
from tvmpipe.serve.sequence import Bridge, SequenceFailed, ServedSequence


class QueuedEngine:
    """An engine that delivers `outputs` through the callback as soon as the request is submitted
    (the reader is behind by all of them) and records cancels."""

    def __init__(self, outputs):
        self.outputs = outputs
        self.cancelled: list[int] = []

    def submit(self, request, on_output):
        for out in self.outputs:
            on_output(out)
        return SimpleNamespace(index=0, error="boom")

    def cancel(self, index):
        self.cancelled.append(index)


def out(text, ids, finish=None, error=None):
    return RequestOutput(0, text, tuple(ids), finish, error)


async def read(outputs) -> tuple[list[RequestOutput], Exception | None, list[int]]:
    engine = QueuedEngine(outputs)
    seq = ServedSequence(engine, Bridge(asyncio.get_running_loop()), Request([1, 2], 8))
    got, failed = [], None
    await asyncio.sleep(0)  # the bridge flushes every output into the queue before the reader runs
    try:
        async for o in seq.outputs():
            got.append(o)
    except SequenceFailed as exc:
        failed = exc
    return got, failed, engine.cancelled


def test_a_reader_behind_takes_the_outputs_as_one():
    got, failed, cancelled = asyncio.run(read([out("a", [1]), out("b", [2]), out("c", [3], FinishReason.LENGTH)]))
    assert failed is None and cancelled == []
    assert [(o.text, o.token_ids, o.finish) for o in got] == [("abc", (1, 2, 3), FinishReason.LENGTH)]


@pytest.mark.parametrize("last", [None, out("", [], FinishReason.ERROR, "nan"), out("", [], FinishReason.CANCELLED)])
def test_what_came_before_a_failure_is_read_first(last):
    got, failed, cancelled = asyncio.run(read([out("a", [1]), out("b", [2]), last]))
    assert [(o.text, o.token_ids, o.finish) for o in got] == [("ab", (1, 2), None)]
    assert isinstance(failed, SequenceFailed) and failed.shutdown == (last is not None and last.finish
                                                                       == FinishReason.CANCELLED)
    assert cancelled == []  # it ended in the engine: nothing to cancel


def test_merged_keeps_the_later_outputs_end():
    a, b = out("x", [7]), RequestOutput(0, "y", (8,), FinishReason.STOP, None, None)
    m = a.merged(b)
    assert (m.index, m.text, m.token_ids, m.finish, m.error) == (0, "xy", (7, 8), FinishReason.STOP, None)
