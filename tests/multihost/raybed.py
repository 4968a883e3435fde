"""A real multi-node Ray cluster on a NetBed: the head on hosts[0], one worker node per other host.

Every node is started with `ray start` inside its host's namespace and its own `--node-ip-address`
(the host's bridge address), so Ray's GCS, raylets, object transfers and workers talk across the
bridge exactly as on separate machines. Worker nodes get `--num-gpus=1` (a fake GPU: Ray only counts
it), the head `--num-gpus=0` like deploy/onprem.yaml, so GPU stages never land on the head.

Ray's fixed default ports (GCS 6379, dashboard 8265, client 10001, agent 52365) are fine here:
ports are per namespace, so other Ray clusters on the machine (other test sessions on 127.0.0.1)
never see them. Multi-node mode stays on (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1, Linux's default):
with it off Ray refuses worker nodes. Nothing can leak: a host has no interface but its veth.

Node failure is noticed by the GCS health check; it is shortened (HEALTH below) so a killed node is
declared dead within a few seconds instead of Ray's default ~30 s.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from netbed import Host, NetBed
from tvmpipe.cluster.control.local import ray_daemon_home

RAY = str(Path(sys.executable).with_name("ray"))
GCS_PORT = 6379
DASHBOARD_PORT = 8265
OBJECT_STORE = 80 * 1024 * 1024  # bytes per node: the default (30% of RAM) x4 would be ~28 GB
HEALTH = {"RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "1000",
          "RAY_health_check_timeout_ms": "1000", "RAY_health_check_failure_threshold": "3"}


@dataclass
class RayBed:
    net: NetBed
    dashboard: bool = False  # the job API (8265) on the head's own address, for `ray job submit`
    worker_cpus: float = 2
    head_cpus: float = 2
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    temp_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="tvmpmh-", dir="/tmp")))

    def __post_init__(self) -> None:
        ray_daemon_home(self.temp_dir / "home")

    @property
    def head(self) -> Host:
        return self.net.hosts[0]

    @property
    def workers(self) -> list[Host]:
        return self.net.hosts[1:]

    @property
    def address(self) -> str:
        return f"{self.head.address}:{GCS_PORT}"

    @property
    def env(self) -> dict[str, str]:
        """For every process on the bed: token auth, no usage stats, the daemons' HOME, the head."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        return {**env, **HEALTH, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token,
                "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
                "HOME": str(self.temp_dir / "home"), "RAY_ADDRESS": self.address,
                "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

    def _start(self, host: Host, *args: str, hide: Path | None = None) -> None:
        # `ray start` daemonizes; what it starts stays in the mount namespace that `unshare` made.
        wrap = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                'mount -t tmpfs -o size=1m hidden "$0" && exec "$@"', str(hide)] if hide else []
        cmd = host.command(*wrap, RAY, "start", f"--node-ip-address={host.address}", f"--temp-dir={self.temp_dir}",
                           f"--object-store-memory={OBJECT_STORE}", "--disable-usage-stats", *args)
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=180)
        if done.returncode != 0:
            raise RuntimeError(f"ray start on {host.name} ({host.address}) failed ({done.returncode}):\n"
                               f"{(done.stdout + done.stderr)[-3000:]}")

    def start_head(self) -> None:
        dash = ([f"--dashboard-host={self.head.address}", f"--dashboard-port={DASHBOARD_PORT}"] if self.dashboard
                else ["--include-dashboard=false"])
        self._start(self.head, "--head", f"--port={GCS_PORT}", f"--num-cpus={self.head_cpus}", "--num-gpus=0",
                    *dash)

    @property
    def head_only(self) -> Path:
        """A directory only the head sees: worker nodes run with an empty tmpfs mounted over it
        (a mount namespace of their own), as if it were the head's local disk."""
        return self.temp_dir / "head-only"

    def start_worker(self, host: Host) -> None:
        self._start(host, f"--address={self.address}", f"--num-cpus={self.worker_cpus}", "--num-gpus=1",
                    hide=self.head_only)

    def up(self, timeout: float = 120) -> RayBed:
        self.head_only.mkdir(exist_ok=True)
        self.start_head()
        for h in self.workers:  # one after another: started together they timed out registering (2 cores)
            self.start_worker(h)
        self.wait_nodes(len(self.net.hosts), timeout)
        return self

    def alive_nodes(self) -> list[str]:
        """Addresses of the nodes the head's GCS counts as alive."""
        code = "import ray; ray.init(log_to_driver=False); print(' '.join(sorted(n['NodeManagerAddress'] " \
               "for n in ray.nodes() if n['Alive'])))"
        done = self.head.run(sys.executable, "-c", code, env=self.env, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"cannot list the bed's Ray nodes:\n{(done.stdout + done.stderr)[-2000:]}")
        return done.stdout.split()

    def wait_nodes(self, n: int, timeout: float) -> list[str]:
        deadline = time.time() + timeout
        while True:
            nodes = self.alive_nodes()
            if len(nodes) == n:
                return nodes
            if time.time() > deadline:
                raise RuntimeError(f"{len(nodes)} of {n} Ray nodes alive after {timeout:.0f} s: {nodes}")
            time.sleep(1)

    def python(self, *argv: str, host: Host | None = None, timeout: float = 300,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """This venv's python on a host (default: the head, where drivers run)."""
        return (host or self.head).run(sys.executable, *argv, env={**self.env, **(env or {})}, timeout=timeout)

    def popen(self, *argv: str, host: Host | None = None, **kw) -> subprocess.Popen:
        return subprocess.Popen((host or self.head).command(sys.executable, *argv), env=self.env,
                                stdout=subprocess.PIPE, text=True, **kw)

    def running(self, host: Host, program: str) -> bool:
        """Whether a process named `program` (its comm) runs on the host."""
        for pid in host.pids():
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == program:
                    return True
            except OSError:
                continue
        return False

    def revive(self, timeout: float = 120) -> None:
        """Bring the cluster back to every host alive, after a test broke part of it: without its GCS
        everything starts again; a worker host the GCS does not count as alive is wiped and rejoins."""
        for h in self.net.hosts:
            h.link(True)
        if not self.running(self.head, "gcs_server"):
            for h in self.net.hosts:
                h.kill_all(wait=10)
            self.up(timeout)
            return
        alive = set(self.alive_nodes())
        for h in self.workers:
            if h.address not in alive or not self.running(h, "raylet"):
                h.kill_all(wait=10)
                self.start_worker(h)
        self.wait_nodes(len(self.net.hosts), timeout)

    def down(self) -> None:
        """Processes and namespaces go with the NetBed; here only Ray's files."""
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def drive(bed: RayBed, cfg: dict, on_event=None, timeout: float = 300) -> tuple[list[dict], str]:
    """Run drive.py on the head with `cfg`; `on_event(event)` sees each JSON event as it arrives
    (after "ready", a held driver is released once on_event returns). Returns (events, stderr)."""
    import json
    import threading

    errfile = tempfile.TemporaryFile("w+")  # a pipe left unread could fill up and block the driver
    proc = bed.popen(str(Path(__file__).with_name("drive.py")), json.dumps(cfg), stdin=subprocess.PIPE,
                     stderr=errfile)
    timer = threading.Timer(timeout, proc.kill)  # a hung driver fails the test instead of the suite
    timer.start()
    events = []
    try:
        for line in proc.stdout:
            if not line.startswith("{"):
                continue
            ev = json.loads(line)
            events.append(ev)
            if on_event:
                on_event(ev)
            if ev["event"] == "ready" and cfg.get("hold"):
                proc.stdin.write("go\n")
                proc.stdin.flush()
        proc.wait()
        errfile.seek(0)
        err = errfile.read()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        errfile.close()
    return events, err
