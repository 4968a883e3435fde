"""Where a bench result comes from, stamped into its JSON: `when` (UTC), `commit` (the code measured)
and `machine`, so that bench/perfpage.py can date and place every figure without asking git
(imported by the bench scripts; running this file prints the stamp of this machine).

Standard library only, and nothing that can hang: the GPU kit runs the bench scripts on a machine
with a copy of the working tree and no git, where the commit comes from .gpu/PREP.json (written by
bench/gpu_prep.sh on the machine that has the repository).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*cmd: str) -> str | None:
    """stdout of `cmd`, stripped; None when it is missing, fails or takes more than 10 s."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def commit() -> tuple[str | None, bool]:
    """(HEAD's hash, whether tracked files differ from it). Without git: the head recorded by
    bench/gpu_prep.sh in .gpu/PREP.json, else (None, False)."""
    head = _run("git", "rev-parse", "HEAD")
    if head:
        return head, bool(_run("git", "status", "--porcelain", "--untracked-files=no"))
    try:
        prep = json.loads((ROOT / ".gpu" / "PREP.json").read_text())
        return prep.get("git_head") or None, bool(prep.get("git_dirty"))
    except (OSError, ValueError):
        return None, False


def machine() -> dict:
    """Cores, memory, platform, Python and, where nvidia-smi answers, the GPU (name, driver)."""
    out: dict = {"cpus": os.cpu_count(), "platform": platform.platform(),
                 "python": platform.python_version()}
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        out["mem_gib"] = round(pages * size / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    gpu = _run("nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader")
    if gpu:
        name, _, driver = gpu.splitlines()[0].partition(",")
        out["gpu"] = {"name": name.strip(), "driver": driver.strip(), "count": len(gpu.splitlines())}
    return out


def stamp(doc: dict) -> dict:
    """`doc` with `when`, `commit` (and `dirty`) and `machine` set, the stamp first. A `machine`
    the bench wrote itself keeps its own fields (load averages, ...) over the stamp's."""
    head, dirty = commit()
    here = machine()
    own = doc.get("machine")
    merged = {**here, **own} if isinstance(own, dict) else here
    rest = {k: v for k, v in doc.items() if k not in ("when", "commit", "dirty", "machine")}
    return {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": head, "dirty": dirty,
            "machine": merged, **rest}


if __name__ == "__main__":
    json.dump(stamp({}), sys.stdout, indent=1)
    print()
