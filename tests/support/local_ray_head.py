"""A throwaway Ray head on 127.0.0.1 for end-to-end job tests, stopped without touching other Rays.

`ray stop` kills every Ray process on the machine (other test sessions' included), so this head
tags everything it starts with a unique environment variable, which every Ray daemon, worker and
job entrypoint inherits, and stops exactly the processes that carry the tag.

RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is what keeps Ray on loopback on Linux: the switch defaults to
on there, and while on, Ray replaces 127.0.0.1 with the host's interface address. And the head runs
with its own HOME holding a `ray_bootstrap_config.yaml` (what `ray up` leaves on a head node): without
one, the dashboard asks the cloud metadata address 169.254.169.254 which cloud it runs on, usage
stats disabled or not (ray/_common/usage/usage_lib.py, get_cluster_config_to_report).
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable
from pathlib import Path

from tvmpipe.cluster.control.local import ray_daemon_home

MARK = "TVMPIPE_TEST_RAY_HEAD"


@dataclass
class LocalHead:
    ray: str  # the venv's `ray` executable
    gcs_port: int
    dashboard_port: int
    client_port: int
    agent_port: int  # Ray's default, 52365, is fixed: a second Ray on the machine has no job agent
    tag: str = field(default_factory=lambda: uuid.uuid4().hex)
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    temp_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="tvpj-", dir="/tmp")))

    def __post_init__(self) -> None:
        ray_daemon_home(self.temp_dir / "home")

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def env(self) -> dict[str, str]:
        """Environment for every command talking to this head (token auth, loopback, the tag)."""
        return {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token",
                "RAY_AUTH_TOKEN": self.token, MARK: self.tag, "RAY_USAGE_STATS_ENABLED": "0",
                "HOME": str(self.temp_dir / "home")}

    def start(self, timeout: float = 120) -> None:
        cmd = [self.ray, "start", "--head", "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
               f"--port={self.gcs_port}", f"--dashboard-port={self.dashboard_port}",
               f"--ray-client-server-port={self.client_port}", f"--dashboard-agent-listen-port={self.agent_port}",
               f"--temp-dir={self.temp_dir}",
               "--num-cpus=2", "--num-gpus=0", "--disable-usage-stats"]
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout,
                              start_new_session=True)
        if done.returncode != 0:
            raise RuntimeError(f"ray start failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")

    def processes(self) -> list[int]:
        """Live (non-zombie) processes carrying this head's tag."""
        needle = f"{MARK}={self.tag}".encode()
        found = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                if needle in (d / "environ").read_bytes().split(b"\0") and _state(d) != "Z":
                    found.append(int(d.name))
            except OSError:  # exited meanwhile, or not ours to read
                continue
        return found

    def stop(self, grace: float = 4.0) -> list[int]:
        """SIGTERM every tagged process, SIGKILL what is left after `grace`; return survivors."""
        return terminate(self.processes, grace)


def terminate(processes: Callable[[], list[int]], grace: float = 4.0) -> list[int]:
    """SIGTERM every process `processes()` lists, SIGKILL what is left after `grace`; return the
    survivors. `processes` says which are ours (a tag, a network namespace), so nothing else is hit."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for pid in processes():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + wait
        while processes() and time.time() < deadline:
            time.sleep(0.2)
    return processes()


def non_loopback_sockets(pids: list[int]) -> list[str]:
    """TCP sockets (listening or connected) of `pids` whose local address is not 127.0.0.1."""
    out = subprocess.run(["ss", "-Htanp"], capture_output=True, text=True, check=True).stdout
    wanted = {f"pid={p}," for p in pids}
    bad = []
    for line in out.splitlines():
        if not any(w in line for w in wanted):
            continue
        local = line.split()[3]
        if not local.rsplit(":", 1)[0].removeprefix("[::ffff:").rstrip("]") == "127.0.0.1":
            bad.append(line)
    return bad


def _state(proc_dir: Path) -> str:
    stat = (proc_dir / "stat").read_text()
    return stat[stat.rindex(")") + 2]
