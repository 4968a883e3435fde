"""A `tvmpipe run --local` driver SIGKILLed mid-run leaves nothing behind (issue 14, item 4).

Ray's DashboardAgent and RuntimeEnvAgent used to live on for ~62 s holding ports, and the run's
`tvp-ray-*` / `tvp-home-*` directories were never removed. The reaper (cluster/control/reaper.py) sees the
driver's end of its pipe close and kills and removes them."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from tests.support.pipeline_harness import alive, cmdline, descendants, local_run

RUN_DIR = re.compile(rb"/tmp/tvp-(?:ray|home)-[A-Za-z0-9_]+")
GONE_WITHIN_S = 5.0  # the target; a loaded 2-core machine gets twice that before the test fails


def run_dirs(pid: int) -> set[str]:
    """The run directories a process names in its command line or environment."""
    found = set()
    for name in ("cmdline", "environ"):
        try:
            found |= {m.decode() for m in RUN_DIR.findall(Path(f"/proc/{pid}/{name}").read_bytes())}
        except OSError:
            pass
    return found


@pytest.mark.ray
def test_sigkilled_local_driver_leaves_no_process_or_directory():
    # mid-run: the stage actors and both Ray agents are up
    driver = local_run(2, lambda lines: sum("StageActor" in c for c in lines) >= 2
                       and any("dashboard/agent.py" in c for c in lines)
                       and any("runtime_env/agent" in c for c in lines))
    try:
        time.sleep(1.0)
        procs = descendants(driver.pid)
        dirs = set().union(*(run_dirs(p) for p in procs))
        assert any("tvp-ray-" in d for d in dirs) and any("tvp-home-" in d for d in dirs)
        assert all(os.path.isdir(d) for d in dirs)
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        killed = time.monotonic()
        while (left := [p for p in procs if alive(p)] + [d for d in dirs if os.path.exists(d)]) and \
                time.monotonic() - killed < 2 * GONE_WITHIN_S:
            time.sleep(0.1)
        took = time.monotonic() - killed
        assert not left, f"still there {took:.1f} s after the driver's SIGKILL: " + \
            ", ".join(cmdline(x) if isinstance(x, int) else x for x in left)
        print(f"{len(procs)} processes and {len(dirs)} directories gone {took:.1f} s after SIGKILL")
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
