"""Environment variables of the processes that run stages: one place, so every stage worker and
the single-process oracle compute with the same BLAS thread count (results depend on it)."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def thread_env() -> dict[str, str]:
    """BLAS/OpenMP thread counts for workers: the driver's if it set them, else one."""
    return {k: os.environ.get(k, "1") for k in THREAD_VARS}


@contextlib.contextmanager
def worker_environment(extra: dict[str, str] | None = None) -> Iterator[None]:
    """Environment for processes spawned inside the block (a spawned child inherits it at start):
    thread_env() plus `extra`. K workers each spinning a BLAS thread per core starve each other,
    and OpenBLAS results depend on its thread count, so every worker (Ray actors get the same
    variables) and the single-process oracle (tvmpipe.app.oracle) must agree on it."""
    with scoped_environ({**thread_env(), **(extra or {})}):
        yield


@contextlib.contextmanager
def scoped_environ(env: dict[str, str]) -> Iterator[None]:
    """os.environ updated with `env` inside the block and restored after (unset ones removed)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
