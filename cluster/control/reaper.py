"""The reaper: what cleans up after a local-mode driver that dies without running its `finally`.

A SIGKILLed (or OOM-killed) driver cannot shut Ray down. Ray fate-shares the daemons it starts
itself (GCS, raylet: PR_SET_PDEATHSIG), but the raylet's own children, the DashboardAgent and the
RuntimeEnvAgent, poll for their parent and were measured living on for 62 s, holding ports, and
the run's temporary directories (`tvp-ray-*`, `tvp-home-*`) were never removed.

So `local.local_ray` starts this small process first. It holds the read end of a pipe whose
write end only the driver has; when the driver exits in any way, the pipe reaches EOF at once. The
reaper then kills every process of the run and removes the run's directories. The processes are
found by what marks them as the run's, not through a process tree that is coming apart (the
raylet dies with the driver and its children are re-parented): each was started with the run's
private HOME (`tvp-home-<random>`, local.py) in its environment, and each keeps its log files open
in the run's Ray temp dir (`tvp-ray-<random>`). Both are checked, because Ray's processes rename
themselves (`ray::DashboardAgent`) with setproctitle, which overwrites the start of the memory
/proc/PID/environ shows, HOME included. After a clean shutdown the driver writes `exit` first; the
reaper still sweeps (a lingering agent is killed sooner) and exits.

Shared memory (shm.py): a ring's name lives in /dev/shm from its producer's creation until its
consumer maps it (then the consumer unlinks it). A SIGKILL in that window would leave the name,
and its memory, behind; so before killing, the reaper notes every `/dev/shm/tvmpipe-*` segment the
run's processes have mapped (/proc/PID/maps) and unlinks those still named once they are dead. Likewise the shipments the run's actors unpacked
(shipping.py): once their users are dead, no lock holds them, and the sweep removes them.

    python -m tvmpipe.cluster.control.reaper DRIVER_PID HOME TEMP_DIR [DIR_TO_REMOVE...]   (stdin: the driver's pipe)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

SWEEP_S = 4.0  # how long to keep looking for processes still starting or exiting
QUIET_ROUNDS = 3  # sweeps in a row that find nothing before the reaper stops looking


class Reaper:
    """The driver's handle on its reaper process."""

    def __init__(self, home: str, temp_dir: str, remove: list[str]):
        env = {k: v for k, v in os.environ.items() if v != home}  # the reaper must not match its own marker
        self._proc = subprocess.Popen([sys.executable, "-m", "tvmpipe.cluster.control.reaper", str(os.getpid()), home,
                                       temp_dir, *remove],
                                      stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env,
                                      start_new_session=True)  # a Ctrl-C to the driver's group spares it

    def done(self) -> None:
        """The run ended cleanly: the reaper sweeps once and exits (not waited for)."""
        try:
            self._proc.stdin.write(b"exit")
            self._proc.stdin.close()
        except OSError:  # it died already: nothing to tell
            pass


def run_processes(home: str, temp_dir: str, spare: int) -> list[int]:
    """Every process (but this one and `spare`, the driver: after a clean shutdown it may still
    hold a Ray log file open) with HOME=`home` in its environment or a file open below `temp_dir`
    (module docstring)."""
    marker = b"\0HOME=" + os.fsencode(home) + b"\0"
    below = temp_dir.rstrip("/") + "/"
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) in (os.getpid(), spare):
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                mine = marker in b"\0" + f.read()
            fds = f"/proc/{d}/fd"
            mine = mine or any(os.readlink(f"{fds}/{fd}").startswith(below) for fd in os.listdir(fds))
        except OSError:  # gone, or another user's
            continue
        if mine:
            found.append(int(d))
    return found


def mapped_segments(pids: list[int]) -> set[str]:
    """The tvmpipe shared-memory segments (paths under /dev/shm, still named) these processes map."""
    from tvmpipe.cluster.wire.shm import PREFIX, SHM_DIR

    below = f"{SHM_DIR}/{PREFIX}"
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    path = line.rstrip("\n").split(None, 5)[-1]
                    if path.startswith(below) and not path.endswith(" (deleted)"):
                        found.add(path)
        except OSError:
            continue
    return found


def sweep(home: str, temp_dir: str, dirs: list[str], spare: int, budget_s: float = SWEEP_S) -> list[int]:
    """SIGKILL the run's processes until none has shown up for a few rounds; remove `dirs` and the
    shared-memory segments they had mapped. Returns the pids killed."""
    killed: list[int] = []
    segments: set[str] = set()
    deadline = time.monotonic() + budget_s
    quiet = 0
    while quiet < QUIET_ROUNDS and time.monotonic() < deadline:
        found = run_processes(home, temp_dir, spare)
        segments |= mapped_segments(found)
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except OSError:
                pass
        quiet = 0 if found else quiet + 1
        time.sleep(0.05)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    from tvmpipe.cluster.control.shipping import sweep_unused

    sweep_unused()  # shipments the killed actors had unpacked (their locks died with them)
    for path in segments:
        try:
            os.unlink(path)
        except OSError:
            pass
    return killed


def main(argv: list[str]) -> int:
    driver, home, temp_dir, dirs = int(argv[0]), argv[1], argv[2], argv[3:]
    if not (Path(home).is_absolute() and Path(temp_dir).is_absolute()):
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the driver's end of the pipe ends the wait
    try:
        sys.stdin.buffer.read()  # returns at EOF: the driver closed it ("exit") or died
    except OSError:
        pass
    sweep(home, temp_dir, dirs, spare=driver)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
