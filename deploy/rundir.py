"""A job's run directory, where every file is either complete or absent.

Jobs run unattended on a cluster and are read by people and scripts that do not know whether the
job is still running, was killed, or failed: so each file is written to a temporary name in the
same directory and renamed into place (`os.replace` is atomic on POSIX). The only file that grows
while the job runs is `job.log.partial`; it becomes `job.log` when the job ends, however it ends.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tvmpipe.bundle.errors import TvmpipeError

PARTIAL_LOG = "job.log.partial"
LOG = "job.log"


class RunDirError(TvmpipeError):
    """The run directory cannot be created (exists with files in it, or is not writable)."""


def default_run_dir(model: str, root: str | Path = "runs", now: float | None = None) -> Path:
    """`runs/<YYYYmmdd-HHMMSS>-<model>`: sorts by time, says what ran."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model) or "model"
    return Path(root) / f"{stamp}-{safe}"


@dataclass
class RunDir:
    path: Path

    @classmethod
    def create(cls, path: str | Path, *, unique: bool = False) -> RunDir:
        """Create the directory. An existing non-empty one is refused: results are never mixed.

        `unique=True` (for generated default names) picks `<path>-1`, `<path>-2`, ... instead of
        failing when two jobs start in the same second.
        """
        base = Path(path).expanduser().resolve()
        candidates = [base] + ([base.with_name(f"{base.name}-{i}") for i in range(1, 100)] if unique else [])
        for cand in candidates:
            try:
                cand.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise RunDirError(f"cannot create run directory {cand}: {exc}") from None
            if not any(cand.iterdir()):
                return cls(cand)
        raise RunDirError(f"run directory {base} already holds files: pass another --run-dir")

    @contextmanager
    def writing(self, name: str) -> Iterator[Path]:
        """Yield a temporary path in the run directory; rename it to `name` if the block succeeds.

        The temporary name keeps the suffix so writers that infer a format from it (matplotlib's
        savefig, np.savez) behave as they would with the final name.
        """
        final = self.path / name
        tmp = self.path / f".{final.stem}.tmp-{uuid.uuid4().hex[:8]}{final.suffix}"
        try:
            yield tmp
            with open(tmp, "rb") as f:  # the rename must not be visible before the data is durable
                os.fsync(f.fileno())
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)

    def write_bytes(self, name: str, data: bytes) -> Path:
        with self.writing(name) as tmp:
            tmp.write_bytes(data)
        return self.path / name

    def write_json(self, name: str, obj: Any) -> Path:
        return self.write_bytes(name, (json.dumps(obj, indent=1, default=_json_default) + "\n").encode())

    def write_npz(self, name: str, arrays: dict[str, np.ndarray]) -> Path:
        with self.writing(name) as tmp:
            np.savez(tmp, **arrays)
        return self.path / name

    @property
    def partial_log(self) -> Path:
        return self.path / PARTIAL_LOG

    def finish_log(self) -> None:
        """Publish the streamed log under its final name (called once, when the job ends)."""
        if self.partial_log.exists():
            os.replace(self.partial_log, self.path / LOG)

    def files(self) -> list[str]:
        """Names of the published files (no temporaries)."""
        return sorted(p.name for p in self.path.iterdir() if not p.name.startswith("."))


def _json_default(obj: Any) -> Any:
    """numpy scalars and arrays turn up in metrics; JSON has no type for them."""
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")
