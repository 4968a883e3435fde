"""HeadWatch against real sockets on 127.0.0.1: a head that answers is left alone; one whose port
stops answering is reported once, after the grace period, naming the address."""

from __future__ import annotations

import socket
import threading
import time

from tvmpipe.cluster.control.headwatch import HeadWatch


def test_reports_a_head_that_went_away_once_after_the_grace():
    server = socket.create_server(("127.0.0.1", 0))
    address = server.getsockname()
    calls: list[tuple[float, str]] = []
    got = threading.Event()
    watch = HeadWatch(address, lambda why: (calls.append((time.time(), why)), got.set()), grace_s=0.5, period_s=0.1)
    watch.start()
    time.sleep(0.5)
    assert calls == [] and watch.lost is None  # answering: nothing to report
    server.close()
    gone = time.time()
    assert got.wait(10)
    time.sleep(0.3)
    assert len(calls) == 1 and calls[0][0] - gone >= 0.5
    assert f"127.0.0.1:{address[1]}" in calls[0][1] and "ConnectionRefusedError" in calls[0][1]
    assert watch.lost == calls[0][1]


def test_a_short_outage_is_not_reported():
    server = socket.create_server(("127.0.0.1", 0))
    address = server.getsockname()
    calls: list[str] = []
    watch = HeadWatch(address, calls.append, grace_s=1.5, period_s=0.1).start()
    server.close()
    time.sleep(0.5)
    server = socket.create_server(address)  # back before the grace ran out
    try:
        time.sleep(1.6)
        assert calls == [] and watch.lost is None
    finally:
        watch.stop()
        server.close()
