"""Editing files of a written bundle in place, keeping bundle.json's checksums right (or not), so
tests can produce the broken bundles that write_bundle itself refuses to write."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable


def rewrite(bundle: Path, name: str, data: str | bytes, fix_checksum: bool = True) -> None:
    f = bundle / name
    f.write_bytes(data.encode() if isinstance(data, str) else data)
    if fix_checksum and name != "bundle.json":
        edit_json(bundle, "bundle.json", lambda m: m["files"].__setitem__(name, hashlib.sha256(f.read_bytes()).hexdigest()))


def edit_json(bundle: Path, name: str, fn: Callable[[Any], object], fix_checksum: bool = True) -> None:
    """Let fn change the decoded file in place (its return value is ignored) and write it back."""
    obj = json.loads((bundle / name).read_text())
    fn(obj)
    rewrite(bundle, name, json.dumps(obj), fix_checksum)
