"""A job's run directory, where every file is either complete or absent.

Jobs run unattended on a cluster and are read by people and scripts that do not know whether the
job is still running, was killed, or failed: so each file is written atomically (tvmpipe.core.files).
The only file that grows while the job runs is `job.log.partial`; it becomes `job.log` when the
job ends, however it ends.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager

import numpy as np

from tvmpipe.core import files
from tvmpipe.core.errors import TvmpipeError

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

    def writing(self, name: str) -> ContextManager[Path]:
        """A temporary path in the run directory, renamed to `name` if the block succeeds."""
        return files.atomic_path(self.path / name)

    def write_bytes(self, name: str, data: bytes) -> Path:
        return files.write_bytes(self.path / name, data)

    def write_json(self, name: str, obj: Any) -> Path:
        return files.write_json(self.path / name, obj)

    def write_npz(self, name: str, arrays: dict[str, np.ndarray]) -> Path:
        return files.write_npz(self.path / name, arrays)

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

