"""What a Stage needs from a backend, and the factory that builds one by name.

A backend owns the stage's memory (per the program's storage plan) and its params. The interface
is deliberately small so the three backends stay interchangeable:

    write(entry, array)          copy one fed entry in (graph input or received entry)
    execute(profile) -> timings  run every step in order; per-step (and per-kernel) times if asked
    read(entry) -> array         copy one sent entry out: a fresh array the caller owns (the
                                 simulated backend returns cached read-only zeros instead)
    close()

Each backend module is imported only when asked for, so `pycuda` is never imported on CPU installs.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from tvmpipe.bundle import Bundle
from tvmpipe.executor.errors import ExecutorError
from tvmpipe.executor.program import StageProgram

BACKENDS = {
    "reference": ("tvmpipe.executor.backend_reference", "ReferenceBackend"),
    "cuda": ("tvmpipe.executor.backend_cuda", "CudaBackend"),
    "simulated": ("tvmpipe.executor.backend_simulated", "SimulatedBackend"),
}


@dataclass(frozen=True)
class StepTiming:
    """Time of program step `step` in seconds; `kernels` lists (symbol, seconds) per launch where the
    backend measures launches separately (cuda events)."""

    step: int
    seconds: float
    kernels: tuple[tuple[str, float], ...] = ()


class Backend(Protocol):
    name: str

    def write(self, entry: int, value: np.ndarray) -> None: ...
    def execute(self, profile: bool = False) -> list[StepTiming] | None: ...
    def read(self, entry: int) -> np.ndarray: ...
    def close(self) -> None: ...


def make_backend(name: str, bundle: Bundle, program: StageProgram, **opts: Any) -> Backend:
    if name not in BACKENDS:
        raise ExecutorError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
    module, cls_name = BACKENDS[name]
    cls = getattr(importlib.import_module(module), cls_name)
    known = set(inspect.signature(cls).parameters) - {"bundle", "program"}
    unknown = sorted(set(opts) - known)
    if unknown:
        raise ExecutorError(f"backend {name!r} has no option(s) {', '.join(unknown)}"
                            + (f" (it takes {', '.join(sorted(known))})" if known else " (it takes none)"))
    return cls(bundle, program, **opts)
