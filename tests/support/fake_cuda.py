"""Turn the strict fake PyCUDA (tests/fakecuda) on, for this process and for the stage workers it
starts: the environment variables a worker needs, and the in-process import path."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterable, Iterator

FAKE_ROOT = Path(__file__).resolve().parents[1] / "fakecuda"


def fake_env(cache: Path, bundles: Iterable[Path]) -> dict[str, str]:
    """Variables that make a (child) process use the fake: PYTHONPATH, PATH (fake nvcc), a private
    cubin cache, and the bundles whose kernels the fake may compute."""
    return {"PYTHONPATH": os.pathsep.join([str(FAKE_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
            "PATH": os.pathsep.join([str(FAKE_ROOT / "bin"), os.environ.get("PATH", "")]),
            "FAKE_PYCUDA": "1", "TVMPIPE_CACHE": str(cache),
            "FAKE_PYCUDA_BUNDLES": os.pathsep.join(str(b) for b in bundles)}


def activate(monkeypatch, cache: Path, bundles: Iterable[Path]) -> dict[str, str]:
    """The fake in this process (imported fresh) and in processes it spawns; undone by monkeypatch."""
    env = fake_env(cache, bundles)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.syspath_prepend(str(FAKE_ROOT))
    for name in [m for m in sys.modules if m == "pycuda" or m.startswith("pycuda.")]:
        monkeypatch.delitem(sys.modules, name)
    # Registered as absent first, so undoing the monkeypatch removes the fake modules this import
    # adds: a later test in the process then sees no pycuda, as on a machine without one.
    for name in ["pycuda"] + [f"pycuda.{p.stem}" for p in (FAKE_ROOT / "pycuda").glob("*.py") if p.stem != "__init__"]:
        monkeypatch.setitem(sys.modules, name, None)
        del sys.modules[name]
    import ctypes

    monkeypatch.setattr(ctypes, "CDLL", ctypes.CDLL)  # the fake patches it on import; restored after
    import pycuda.driver as drv

    assert getattr(sys.modules["pycuda"], "FAKE", False), "a real pycuda shadows the fake"
    monkeypatch.setattr(drv, "violations", [])
    yield_ = env
    return yield_


@contextlib.contextmanager
def spawn_path() -> Iterator[None]:
    """multiprocessing's spawn gives a child the parent's sys.path (PYTHONPATH is not consulted), so
    the fake is put on this process's path while children start, and taken off after."""
    sys.path.insert(0, str(FAKE_ROOT))
    try:
        yield
    finally:
        sys.path.remove(str(FAKE_ROOT))
