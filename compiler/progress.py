"""Step lines with timings on stderr, so a slow compile shows where its time goes."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, TextIO


@dataclass
class Progress:
    """Prints `[  2.1s] import onnx ... done (0.8s)` per step and keeps the durations.

    `timings` maps step name -> seconds (summed when a step repeats); the benchmark reads it.
    """

    stream: TextIO | None = field(default_factory=lambda: sys.stderr)
    start: float = field(default_factory=time.perf_counter)
    timings: dict[str, float] = field(default_factory=dict)

    def _elapsed(self) -> str:
        return f"[{time.perf_counter() - self.start:5.1f}s]"

    @contextmanager
    def step(self, name: str, detail: str = "") -> Iterator[None]:
        label = f"{name} {detail}".strip()
        if self.stream is not None:
            print(f"{self._elapsed()} {label} ...", file=self.stream, flush=True)
        t0 = time.perf_counter()
        try:
            yield
        except BaseException:
            if self.stream is not None:
                print(f"{self._elapsed()} {label} ... failed", file=self.stream, flush=True)
            raise
        dt = time.perf_counter() - t0
        self.timings[name] = self.timings.get(name, 0.0) + dt
        if self.stream is not None:
            print(f"{self._elapsed()} {label} ... done ({dt:.1f}s)", file=self.stream, flush=True)

    def note(self, message: str) -> None:
        if self.stream is not None:
            print(f"{self._elapsed()} {message}", file=self.stream, flush=True)


@contextmanager
def native_stderr_silenced(enabled: bool = True) -> Iterator[None]:
    """Send file descriptor 2 to /dev/null: TVM's C++ logger writes warnings there directly
    (`Warning: Fast mode segfaults ...`), past Python's sys.stderr, so `--quiet` must close the fd.

    On an error, the original exception chained to ours keeps TVM objects alive whose destructors
    warn (`BlockBuilder destroyed with remaining blocks`); the chain is dropped and collected while
    fd 2 is still silenced, so the one error line the CLI prints afterwards is all that shows.
    """
    import gc
    import os
    import sys

    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    except BaseException as exc:
        exc.__context__ = None
        exc.__cause__ = None
        gc.collect()
        raise
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
