"""The GPU benches' first step (imported by them; running this file does nothing): without a GPU
they say why and exit 0, so `make bench` runs through on a CPU machine, or 1 with --require-gpu,
as bench/gpu_check.sh runs them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def add_require_gpu(ap) -> None:
    ap.add_argument("--require-gpu", action="store_true",
                    help="fail (exit 1) without a GPU instead of skipping (exit 0), as bench/gpu_check.sh runs it")


def no_gpu_exit(name: str, require_gpu: bool) -> int | None:
    """None when the cuda backend can run here; else the exit status, after saying why."""
    sys.path.insert(0, str(ROOT))
    from tvmpipe.executor.backend_cuda import cuda_unavailable

    why = cuda_unavailable()
    if why is None:
        return None
    print(f"{name}: no GPU here ({why}); nothing to benchmark", file=sys.stderr if require_gpu else sys.stdout)
    return 1 if require_gpu else 0


def write_result(out: str | Path, doc: dict) -> None:
    """A GPU bench's result file: `doc`, first marked with whether the fake PyCUDA made it (a file
    from the test suite's fake must never pass for a GPU measurement)."""
    import pycuda
    from stamp import stamp

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(stamp({"fake": bool(getattr(pycuda, "FAKE", False)), **doc}), indent=1) + "\n")
