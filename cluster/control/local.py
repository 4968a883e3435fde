"""Local single-node mode: an embedded Ray cluster that only ever talks on 127.0.0.1.

On Linux Ray rewrites 127.0.0.1 to the host's interface address and sends its own traffic there.
Ray's internal switch RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER, set to "0" before ray is imported, turns
its multi-node mode off, and then every Ray socket stays on 127.0.0.1 (verified with `ss -tnp`,
see docs/cluster.md; "1" is Linux's default and changes nothing). Local mode must not open ports on
the network, so it sets it, binds the node to 127.0.0.1 and runs without the dashboard.

Ray always starts its API server, even without the dashboard, and the server's usage-stats module
asks the cloud metadata address 169.254.169.254 which cloud it runs on, whether or not usage
stats are enabled. It skips that only when ~/ray_bootstrap_config.yaml exists, which is what `ray
up` leaves on a head node (ray/_common/usage/usage_lib.py, get_cluster_config_to_report). So Ray's
daemons start with a private HOME that holds one. Workers inherit it too: a HOME passed back
through a runtime_env (job or actor level) made Ray 2.60's workers never start. So the two things
of HOME a stage worker uses are pinned to the user's instead: PYTHONUSERBASE (user site-packages)
and TVMPIPE_CACHE (the cubin cache), unless already set.

The embedded head also leaves out three of Ray's daemons that a fixed single node with no dashboard
and no log streaming never uses (`lean_head`): the API server (with `include_dashboard=False` it
loads only the usage-stats module, the one that asks the metadata address), the autoscaler monitor
(nothing to scale) and the log monitor (it streams worker output to the driver, which
`log_to_driver=False` turns off; workers still write their log files). Each is a Python process
that boots while the stages do: on the 2-core VM they cost 1.5 CPU-s, 0.9 s of `ray.init` and, for
the monitor's slow SIGTERM, 1 s of `ray.shutdown`. If Ray renames the methods, the head starts them
as before (and the private HOME still keeps the API server off the metadata address).

Three more things of `ray.init` cost a local run time at every stage count (docs/cluster.md):
- Ray checks whether the dashboard's optional packages import (aiohttp, opentelemetry, ...) by
  importing them in the driver, and then starts the full dashboard agent, whose imports the raylet
  waits for before it registers. The embedded head starts the agent `--minimal` instead (what Ray
  does when those packages are missing): no metrics export, which nothing here reads.
- The dashboard and runtime-env agents are started under `nice -n 19`: they do nothing for a
  local run (stage actors get no runtime_env) yet took 1.5-2 CPU-s of the two cores while the
  stage processes booted.
- The driver asks the GCS for its raylet 0.1 s after starting it, and Ray's C++ accessor retries
  only every second: a raylet that registered 0.1 s too late cost a whole second. The head polls
  the node table every 20 ms first, so the accessor's first try finds it.
- Ray's raylet prestarts int(num_cpus) Python workers when the driver connects. A local run knows
  how many worker processes it will use (one per stage actor), so it prestarts exactly those
  (`workers`): at K = 1 on the 2-core VM the second prestarted worker only ever idled, yet took
  0.35 CPU-s while the stage booted and kept 78 MB. The raylet still boots at most
  min(cores, num_cpus) workers at once, so at K = 4 on 2 cores the last two boot once the first
  two have registered, as before (raising that limit too gained nothing, measured).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import site
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tvmpipe.core.errors import TvmpipeError
from tvmpipe.cluster.control.environment import inherited_by_workers, scoped_environ, thread_env
from tvmpipe.cluster.control.reaper import Reaper
from tvmpipe.executor.cubin import cache_root

LOOPBACK = "127.0.0.1"
# Ray's own switch: "0" turns its multi-node mode off on Linux, so the node address stays loopback.
LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
MAX_TEMP_DIR = 48  # + "/session_<date>_<time>_<pid>/sockets/plasma_store" stays under 108 bytes
# The warning ray.init logs each time it starts a new local cluster with RAY_AUTH_MODE unset (Ray
# 2.5x+, ray/_private/authentication/authentication_token_setup.py): token auth is on, which is what
# local mode wants, so the notice is noise on every `tvmpipe run --local`. Only this one message is
# dropped; Ray's other warnings and errors, and auth itself, are untouched.
TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
TOKEN_AUTH_NOTICE = "Token authentication is enabled for this Ray cluster."


def _not_token_auth_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(TOKEN_AUTH_NOTICE)


@contextmanager
def quiet_token_auth_notice() -> Iterator[None]:
    """Drop Ray's "token authentication is enabled" notice logged inside the block."""
    logger = logging.getLogger(TOKEN_AUTH_LOGGER)
    logger.addFilter(_not_token_auth_notice)
    try:
        yield
    finally:
        logger.removeFilter(_not_token_auth_notice)


# Ray's Node methods that start the daemons local mode does without (see the module docstring)
LEAN_HEAD_SKIPS = ("start_api_server", "start_monitor", "start_log_monitor")
PRESTART_FLAG = "--num_prestart_python_workers="  # the raylet's flag (ray/_private/services.py, start_raylet)
AGENT_NICENESS = 19
NODE_POLL_S = 0.02
NODE_WAIT_S = 30.0  # Ray's own raylet_start_wait_time_s


def _wait_for_node(get_node, gcs_address: str, node_id: str):
    """Ray's services.get_node, asked only once the node table lists `node_id` alive (polled every
    NODE_POLL_S), so that the accessor's one-second retry is never needed."""
    import time

    from ray._private import services, state

    table = state.GlobalState()
    table._initialize_global_state(services._get_gcs_client_options(gcs_address))
    deadline = time.monotonic() + NODE_WAIT_S
    try:
        while time.monotonic() < deadline:
            if any(n.get("NodeID") == node_id and n.get("Alive") for n in table.node_table()):
                break
            time.sleep(NODE_POLL_S)
    finally:
        table.disconnect()
    return get_node(gcs_address, node_id)


def prestarting(command: list[str], workers: int) -> list[str]:
    """The raylet's command line with its prestart count (Ray's int(num_cpus)) set to `workers`."""
    return [f"{PRESTART_FLAG}{workers}" if arg.startswith(PRESTART_FLAG) else arg for arg in command]


@contextmanager
def lean_head(workers: int | None = None) -> Iterator[list[str]]:
    """While the block runs, a Ray head started in this process starts none of LEAN_HEAD_SKIPS,
    runs its dashboard agent minimal and both agents niced, waits for its raylet without
    one-second steps and, given `workers`, prestarts that many Python workers (module docstring).
    Yields what it changed: the names of the daemons skipped (those this Ray version has), then
    "minimal agent", "niced agents", "node poll" and "prestart N" where this Ray version has the
    functions patched."""
    from ray._private import node, ray_constants, services, utils

    saved = {name: node.Node.__dict__[name] for name in LEAN_HEAD_SKIPS if name in node.Node.__dict__}
    patched: list[tuple[object, str, object]] = []

    def skipped(self, *args, **kwargs) -> None:
        return None

    def patch(owner: object, name: str, value: object) -> bool:
        if not callable(getattr(owner, name, None)):
            return False
        patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)
        return True

    agents = {getattr(ray_constants, n, None) for n in ("PROCESS_TYPE_DASHBOARD_AGENT", "PROCESS_TYPE_RUNTIME_ENV_AGENT")}
    python_command = getattr(services, "_build_python_executable_command_memory_profileable", None)
    nice = shutil.which("nice")

    def niced(component: str, *args, **kwargs) -> list[str]:
        cmd = python_command(component, *args, **kwargs)
        return [nice, "-n", str(AGENT_NICENESS), *cmd] if component in agents - {None} else cmd

    get_node = getattr(services, "get_node", None)
    start_process = getattr(services, "start_ray_process", None)
    raylet = getattr(ray_constants, "PROCESS_TYPE_RAYLET", None)

    def start_prestarting(command, process_type, *args, **kwargs):
        if process_type == raylet:
            command = prestarting(command, workers)
        return start_process(command, process_type, *args, **kwargs)

    changed = list(saved)
    for name in saved:
        setattr(node.Node, name, skipped)
    try:
        if patch(utils, "get_dashboard_dependency_error", lambda: "tvmpipe local mode: the agent runs minimal"):
            changed.append("minimal agent")
        if nice and python_command and patch(services, "_build_python_executable_command_memory_profileable", niced):
            changed.append("niced agents")
        if get_node and patch(services, "get_node", lambda gcs_address, node_id: _wait_for_node(get_node, gcs_address, node_id)):
            changed.append("node poll")
        if workers is not None and raylet and patch(services, "start_ray_process", start_prestarting):
            changed.append(f"prestart {workers}")
        yield changed
    finally:
        for owner, name, fn in reversed(patched):
            setattr(owner, name, fn)
        for name, fn in saved.items():
            setattr(node.Node, name, fn)


@contextmanager
def own_session() -> Iterator[bool]:
    """While the block runs, the daemons Ray starts (GCS, raylet, agents; the raylet's workers, the
    stage actors, follow the raylet) begin a session of their own, so that a signal to this
    process's group does not reach them: systemd's stop and `kill -TERM -PGID` signal the whole
    group, and a GCS killed under a draining server made it wait 60 s for Ray and exit 1. The driver
    stops them itself (ray.shutdown), and the reaper if it dies. Yields whether Ray's process class
    could be wrapped (False: a Ray that renamed it; its daemons then share the group, as before)."""
    from ray._private import services

    popen = getattr(services, "ConsolePopen", None)
    if popen is None:
        yield False
        return

    class SessionPopen(popen):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("start_new_session", True)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = SessionPopen
    try:
        yield True
    finally:
        services.ConsolePopen = popen


@contextmanager
def local_ray(num_cpus: float, num_gpus: int = 0, temp_dir: str | None = None,
              workers: int | None = None) -> Iterator[None]:
    """An embedded Ray head on loopback for the duration of the block, shut down afterwards.

    `num_cpus` is rounded up to a whole number: Ray refuses a node with a fractional CPU count, and
    the stages' fractional shares (--cpus-per-stage 0.5 x 5 stages = 2.5) must still fit on it.
    `workers`: how many Python workers the raylet prestarts (the run's stage actors); None leaves
    Ray's own count, the node's CPUs.

    `temp_dir` defaults to a fresh short directory (Ray's socket paths must stay under 108 bytes),
    removed on exit, so concurrent local runs never share Ray's session files.
    """
    os.environ[LOOPBACK_SWITCH] = "0"  # inherited by raylet, GCS and every worker process
    import ray
    from ray._private import ray_constants

    # Ray reads the switch once, at import; if ray was imported earlier in this process, set the
    # flag it read (Ray looks it up as a module attribute each time it resolves the node address).
    ray_constants.ENABLE_RAY_CLUSTER = False
    if temp_dir is not None and len(os.path.abspath(temp_dir)) > MAX_TEMP_DIR:
        raise TvmpipeError(f"Ray temp dir {temp_dir!r} is too long: Ray puts its sockets ~58 bytes below it and "
                           f"a socket path must stay under 108 bytes; use at most {MAX_TEMP_DIR} characters")
    own = temp_dir is None
    temp_dir = temp_dir or tempfile.mkdtemp(prefix="tvp-ray-", dir="/tmp")
    daemon_home = str(ray_daemon_home(tempfile.mkdtemp(prefix="tvp-home-", dir="/tmp")))
    # started first: if this process dies in any way from here on, the run's processes and
    # directories go with it (reaper.py); the private HOME marks every process of the run
    reaper = Reaper(daemon_home, os.path.abspath(temp_dir), [daemon_home] + ([temp_dir] if own else []))
    pinned = {"HOME": daemon_home, "PYTHONUSERBASE": os.environ.get("PYTHONUSERBASE", site.getuserbase()),
              "TVMPIPE_CACHE": str(cache_root()), **thread_env()}
    try:
        # the environment is inherited by the daemons ray.init starts, and by their workers
        with scoped_environ(pinned), quiet_token_auth_notice(), lean_head(workers), own_session():
            ray.init(address="local", num_cpus=math.ceil(round(num_cpus, 6)), num_gpus=num_gpus,
                     include_dashboard=False, _node_ip_address=LOOPBACK, _temp_dir=temp_dir, log_to_driver=False,
                     configure_logging=False)
            daemons = dict(os.environ)
    except BaseException:
        shutil.rmtree(daemon_home, ignore_errors=True)
        reaper.done()
        raise
    try:
        with inherited_by_workers(daemons):  # stage actors need no runtime_env for these (environment.py)
            yield
    finally:
        ray.shutdown()
        shutil.rmtree(daemon_home, ignore_errors=True)
        if own:
            shutil.rmtree(temp_dir, ignore_errors=True)
        reaper.done()


def ray_daemon_home(path: str | Path) -> Path:
    """Make `path` a HOME for Ray daemons: it holds the ray_bootstrap_config.yaml that keeps Ray's
    API server from asking the cloud metadata address (see the module docstring)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "ray_bootstrap_config.yaml").write_text("provider: {type: local}\n")
    return path


def detect_gpus() -> int:
    """NVIDIA GPUs this process may use (0 without a driver), for the local cluster's GPU resource:
    nvidia-smi's list, narrowed by CUDA_VISIBLE_DEVICES as CUDA narrows it."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    gpus = [line for line in out.splitlines() if line.startswith("GPU ")]
    return visible_count(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))


def visible_count(gpus: list[str], visible: str | None) -> int:
    """How many of `gpus` (nvidia-smi -L lines) CUDA_VISIBLE_DEVICES leaves visible. CUDA reads the
    list up to its first invalid entry: an index (CUDA's order, not nvidia-smi's PCI order, but the
    count is the same) below the device count, or a GPU-/MIG- UUID prefix; repeats are invalid."""
    if visible is None:
        return len(gpus)
    seen: set[str] = set()
    for item in (s.strip() for s in visible.split(",")):
        if item.isdigit():
            key = str(int(item)) if int(item) < len(gpus) else None
        else:
            hits = [str(i) for i, g in enumerate(gpus) if item and f"(UUID: {item}" in g]
            key = hits[0] if len(hits) == 1 else None
        if key is None or key in seen:
            break
        seen.add(key)
    return len(seen)
