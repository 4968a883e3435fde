"""serve/app.py's Gate around a stand-in ASGI app: the body timeout bounds the wait for a request's
body, and nothing after it (a non-streamed request waits on receive() for a disconnect while it
generates, however long that takes)."""

from __future__ import annotations

import asyncio
import json

from tvmpipe.serve import metrics
from tvmpipe.serve.app import Gate

TIMEOUT = 0.2


def run(messages: list[dict], linger: float) -> tuple[list[dict], list[str]]:
    """The Gate over an app that reads the body, then waits `linger` s on receive() (as a route
    watching for a disconnect), then answers 200; `messages` are what the client sends, then
    nothing. The response messages and what the app saw."""
    seen: list[str] = []

    async def app(scope, receive, send):
        while True:
            m = await receive()
            seen.append(m["type"])
            if not m.get("more_body", False):
                break
        try:
            await asyncio.wait_for(receive(), linger)
        except asyncio.TimeoutError:
            seen.append("waited")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def main():
        queue: asyncio.Queue = asyncio.Queue()
        for m in messages:
            queue.put_nowait(m)
        sent: list[dict] = []

        async def send(m):
            sent.append(m)

        gate = Gate(app, api_key=None, max_body_bytes=1 << 20, counters=metrics.Counters(), body_timeout=TIMEOUT)
        await gate({"type": "http", "path": "/v1/completions", "method": "POST", "headers": []}, queue.get, send)
        return sent

    return asyncio.run(main()), seen


def test_a_body_that_stops_short_is_a_408():
    sent, seen = run([{"type": "http.request", "body": b"{", "more_body": True}], linger=0)
    assert sent[0]["status"] == 408 and seen == ["http.request"]
    assert json.loads(sent[1]["body"])["error"]["code"] == "request_timeout"


def test_a_whole_body_then_a_long_wait_is_not_cut():
    sent, seen = run([{"type": "http.request", "body": b"{}", "more_body": True},
                      {"type": "http.request", "body": b"", "more_body": False}], linger=5 * TIMEOUT)
    assert sent[0]["status"] == 200 and seen == ["http.request", "http.request", "waited"]
