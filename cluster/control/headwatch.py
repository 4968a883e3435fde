"""HeadWatch: notices that a Ray cluster's head (its GCS) is gone, in time to end a run cleanly.

A driver that loses the GCS is ended by Ray's core worker with os._exit, 60 s later
(gcs_rpc_server_reconnect_timeout_s), running no Python on the way; meanwhile the data plane keeps
streaming, since it does not go through Ray. Without a watch a job would die mid-run with nothing
written. Ray calls are no way to notice: with the GCS gone some of them (creating or killing an
actor) block. So a daemon thread knocks on the GCS port with a plain TCP connect every `period_s`
and, once it has refused or ignored connections for `grace_s`, reports why, once, to `on_lost`.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable

HEAD_GRACE_S = 10.0  # well inside Ray's 60 s: enough time left to write the run's results
HEAD_PROBE_S = 2.0


class HeadWatch:
    def __init__(self, address: tuple[str, int], on_lost: Callable[[str], None] | None = None,
                 grace_s: float = HEAD_GRACE_S, period_s: float = HEAD_PROBE_S):
        self.address = address
        self.on_lost = on_lost
        self.grace_s = grace_s
        self.period_s = period_s
        self.lost: str | None = None  # why, once the head is considered gone
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="tvmpipe-headwatch")

    def start(self) -> HeadWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        since: float | None = None
        while not self._stop.wait(self.period_s):
            try:
                socket.create_connection(self.address, timeout=min(1.0, self.period_s)).close()
                since = None
                continue
            except OSError as exc:
                now = time.time()
                since = since or now
                if now - since < self.grace_s:
                    continue
                host, port = self.address
                self.lost = (f"the Ray head's GCS at {host}:{port} has been unreachable for {now - since:.0f} s "
                             f"({type(exc).__name__}: {exc})")
            if self.on_lost:
                self.on_lost(self.lost)
            return
