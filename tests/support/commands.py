"""The `tvmpipe` command run as users run it: a subprocess, so exit status, stdout and stderr (no
traceback on errors) are what a shell sees."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def run_tvmpipe(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tvmpipe", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
