"""Open or join the cluster a run uses, and turn the cluster options into Pipeline arguments.

Three places for stages: `--local` (an embedded loopback-only Ray, started and stopped here),
`--address` (an existing Ray cluster, joined with a retry of Ray's client start-up race) and
`--processes` (plain child processes, no Ray).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Iterator

from tvmpipe.app.options import ClusterOptions
from tvmpipe.core.errors import TvmpipeError

RAY_CONNECT_ATTEMPTS = 3


@dataclass(frozen=True)
class Cluster:
    """Where stage workers run, as Pipeline keyword arguments, and what a report says about it."""

    launcher: str  # "ray" | "process"
    host: str | None  # the data plane's interface; None: each node's own address
    gpus: int
    ship_bundle: bool
    description: str
    nodes: int = 1
    ray_version: str | None = None
    grows: bool = False  # nodes may join (a cluster we joined, not the embedded head we started)


def connect_ray(address: str, attempts: int = RAY_CONNECT_ATTEMPTS, pause_s: float = 1.0) -> None:
    """ray.init(address), retried when a ray:// server fails a client's start-up.

    Ray's client proxier starts a server process per client and then reads its command line. If
    that process has just exited, psutil raises ZombieProcess inside the proxier, and the client
    gets "Initialization failure from server". This happened under load, in our end-to-end tests.
    The next attempt gets a fresh server. Any other failure is reported at once.
    """
    import ray

    for attempt in range(1, attempts + 1):
        try:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
            return
        except ConnectionError as exc:
            transient = address.startswith("ray://") and "Initialization failure from server" in str(exc)
            if not transient or attempt == attempts:
                tried = f" ({attempt} attempts)" if attempt > 1 else ""
                raise TvmpipeError(f"cannot connect to the Ray cluster at {address}{tried}: {exc} (a cluster with "
                                   "token auth needs RAY_AUTH_MODE=token and its token in this environment)") from None
            ray.shutdown()
            time.sleep(pause_s)


def check_where(opts: ClusterOptions) -> None:
    """Exactly one place to run was chosen (checked before anything is loaded or started)."""
    if not (opts.local or opts.address or opts.processes):
        raise TvmpipeError("say where to run: --local (embedded Ray on 127.0.0.1), --address auto|ray://HOST:PORT "
                           "(an existing cluster) or --processes (no Ray)")


@contextlib.contextmanager
def open_cluster(opts: ClusterOptions, max_stages: int) -> Iterator[Cluster]:
    """The cluster for the duration of the block: started (--local) or joined (--address), and
    stopped or left afterwards; --processes needs neither."""
    from tvmpipe.cluster.control.local import LOOPBACK, detect_gpus, local_ray
    from tvmpipe.cluster.control.placement import alive_nodes

    check_where(opts)
    if opts.processes:
        yield Cluster("process", LOOPBACK, detect_gpus(), False, "local processes (no Ray)")
    elif opts.local:
        import ray

        gpus = detect_gpus()
        with local_ray(num_cpus=max(2.0, max_stages * opts.cpus_per_stage), num_gpus=gpus,
                       temp_dir=opts.ray_temp_dir, workers=max_stages):
            yield Cluster("ray", LOOPBACK, gpus, bool(opts.ship_bundle), f"local Ray on {LOOPBACK}",
                          ray_version=ray.__version__)
    else:
        import ray

        connect_ray(opts.address)
        try:
            nodes = alive_nodes()
            gpus = int(ray.cluster_resources().get("GPU", 0))
            ship = nodes > 1 if opts.ship_bundle is None else opts.ship_bundle
            yield Cluster("ray", None, gpus, ship, f"Ray cluster {opts.address} ({nodes} node(s))", nodes,
                          ray.__version__, grows=True)
        finally:
            ray.shutdown()


def pick_backend(requested: str, gpus: int) -> str:
    if requested != "auto":
        return requested
    return "cuda" if gpus > 0 else "reference"


def pipeline_kwargs(opts: ClusterOptions, cluster: Cluster, backend: str, k: int) -> dict[str, Any]:
    """Pipeline keyword arguments for K stages of `backend` on `cluster`."""
    from tvmpipe.cluster.control.launchers import ProcessLauncher, Timeouts
    from tvmpipe.cluster.control.placement import Placement

    gpus = opts.gpus_per_stage
    if gpus is None:
        gpus = 0.0 if backend != "cuda" else (1.0 if cluster.gpus >= k else cluster.gpus / k)
    if backend == "cuda" and cluster.gpus == 0:
        raise TvmpipeError("the cuda backend needs a GPU, and this cluster has none (use --backend reference)")
    timeouts = Timeouts(progress=opts.progress_timeout)
    kw: dict[str, Any] = dict(backend=backend, window=opts.window, launcher=cluster.launcher, host=cluster.host,
                              ship_bundle=cluster.ship_bundle, max_restarts=opts.max_restarts, timeouts=timeouts,
                              transport=opts.transport)
    if cluster.launcher == "ray":
        kw["placement"] = Placement(strategy=opts.placement, gpus=gpus, cpus=opts.cpus_per_stage,
                                    grows=cluster.grows)
    elif backend == "cuda":  # processes: stage i on GPU i, round robin when stages outnumber GPUs
        kw["launcher"] = ProcessLauncher(timeouts, devices=[str(i) for i in range(cluster.gpus)])
    return kw
