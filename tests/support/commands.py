"""The `tvmpipe` command and the bench scripts run as users run them: a subprocess, so exit status,
stdout and stderr (no traceback on errors) are what a shell sees."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO


def run_tvmpipe(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tvmpipe", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def run_bench(script: str, *args: str, out: Path, timeout: float = 600) -> dict:
    """`python bench/SCRIPT ARGS --out OUT`: it exits 0 (else its output's tail is the failure) and
    its JSON result is returned."""
    r = subprocess.run([sys.executable, str(REPO / "bench" / script), *args, "--out", str(out)],
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads(out.read_text())


def assert_fits_100_columns(lines: list[str], path: object, params: object = None) -> None:
    """`inspect`'s text: every line within 100 columns but those that end in a path, the title (the
    bundle's `path`) and, with a params file, the params row: they name it in full, however long,
    so the directory the test runs in cannot decide the test."""
    assert str(path) in lines[0], (lines[0], path)
    rest = lines[1:]
    if params is not None:
        row = next(line for line in rest if line.startswith("  params "))
        assert row.endswith(f" in {params}"), row
        rest = [line for line in rest if line is not row]
    assert max(map(len, rest)) <= 100, max(rest, key=len)
