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


# The environment the Ray cluster this process started (local.local_ray) gave its daemons, which
# every worker process they spawn inherits; None when this process did not start its cluster.
_inherited: dict[str, str] | None = None


@contextlib.contextmanager
def inherited_by_workers(env: dict[str, str]) -> Iterator[None]:
    """Inside the block, the cluster's workers are known to start with `env` (local.local_ray:
    the environment its daemons were started with)."""
    global _inherited
    _inherited = dict(env)
    try:
        yield
    finally:
        _inherited = None


def missing_from_workers(env: dict[str, str]) -> dict[str, str]:
    """The part of `env` a worker would not inherit, hence must get through a Ray runtime_env.

    A runtime_env is not free: Ray cannot hand such an actor a prestarted worker and sets the
    environment up through its runtime-env agent first, which costs ~0.6 s per actor on a 2-core
    machine, more than a whole worker start (bench/bigmodel.py's time to first output). On a
    cluster this process started itself the variables are already in every worker."""
    if _inherited is None:
        return dict(env)
    return {k: v for k, v in env.items() if _inherited.get(k) != v}
