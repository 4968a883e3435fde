"""Output files that are either complete or absent.

Results are read by people and scripts that cannot tell a finished file from one cut short by a
full disk, a kill or an exception: so every output is written to a temporary name in the same
directory and renamed into place (`os.replace` is atomic on POSIX). `check_writable` lets a
command refuse an output path before it spends minutes computing what it could not save.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tvmpipe.core.errors import TvmpipeError


class OutputError(TvmpipeError):
    """An output file cannot be written where it was asked for."""


def check_writable(path: str | Path, what: str) -> Path:
    """`path` can be created: its directory exists and is writable, and it is not a directory.
    `what` names the option or file in the one-line error (e.g. "--save-outputs")."""
    path = Path(path).expanduser()
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise OutputError(f"{what} {path}: is a directory, expected a file name")
    if not parent.is_dir():
        raise OutputError(f"{what} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{what} {path}: directory {parent} is not writable")
    return path


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it to `path` if the block succeeds, delete it
    otherwise. The temporary name keeps the suffix, so writers that infer a format from it
    (matplotlib's savefig, np.savez) behave as they would with the final name."""
    final = Path(path)
    tmp = final.with_name(f".{final.stem}.tmp-{uuid.uuid4().hex[:8]}{final.suffix}")
    try:
        yield tmp
        with open(tmp, "rb") as f:  # the rename must not be visible before the data is durable
            os.fsync(f.fileno())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes(path: str | Path, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text(path: str | Path, text: str) -> Path:
    return write_bytes(path, text.encode("utf-8"))


def write_json(path: str | Path, obj: Any, indent: int | None = 1) -> Path:
    return write_text(path, json.dumps(obj, indent=indent, default=_json_default) + "\n")


def write_npz(path: str | Path, arrays: dict[str, Any]) -> Path:
    """np.savez, atomically; like np.savez, a name without the .npz suffix gets it."""
    import numpy as np

    path = Path(path)
    if path.suffix != ".npz":
        path = path.with_name(path.name + ".npz")
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, **arrays)
    return path


def _json_default(obj: Any) -> Any:
    """numpy scalars and arrays turn up in metrics; JSON has no type for them."""
    import numpy as np

    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


class JsonLines:
    """An append-only JSON-lines file whose every line is whole or absent: each record is one
    `write` of a complete line, made durable (fsync) before the next, so a process killed at any
    moment leaves the lines it finished and at most a torn last line, which reopening removes.
    `records` holds the lines already there (a job resumes by skipping what they cover)."""

    def __init__(self, path: str | Path, what: str = "--output"):
        self.path = check_writable(path, what)
        self.records: list[Any] = []
        keep = 0
        if self.path.exists():
            data = self.path.read_bytes()
            for line in data.splitlines(keepends=True):
                if not line.endswith(b"\n"):
                    break  # torn by a kill mid-write: dropped
                try:
                    self.records.append(json.loads(line))
                except ValueError:
                    raise OutputError(f"{what} {self.path}: line {len(self.records) + 1} is not JSON; "
                                      "not a file this job wrote (move it away or pick another name)") from None
                keep += len(line)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.ftruncate(self._fd, keep)
        os.lseek(self._fd, keep, os.SEEK_SET)

    def append(self, record: Any) -> None:
        line = (json.dumps(record, default=_json_default) + "\n").encode("utf-8")
        view = memoryview(line)
        while view:  # a regular file takes it in one write; loop for the letter of the API
            view = view[os.write(self._fd, view):]
        os.fsync(self._fd)
        self.records.append(record)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "JsonLines":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
