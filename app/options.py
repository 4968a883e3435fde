"""What a run asks of the cluster, as data: the application layer's input from any front end."""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("auto", "reference", "cuda", "simulated")


@dataclass(frozen=True)
class ClusterOptions:
    """Where stages run (exactly one of `local`, `address`, `processes`) and how the pipeline
    treats them. Field names are the command-line options' (`--gpus-per-stage` -> gpus_per_stage),
    so a run's metrics.json records the command it came from."""

    local: bool = False
    address: str | None = None
    processes: bool = False
    backend: str = "auto"
    window: int | None = None  # default 2 x stages
    placement: str = "PACK"
    gpus_per_stage: float | None = None  # default 1 on cuda (a share when stages outnumber GPUs), else 0
    cpus_per_stage: float = 0.5
    max_restarts: int = 3
    transport: str = "auto"  # same-node edges: auto, shm or tcp (Pipeline's `transport`)
    progress_timeout: float = 60.0
    ray_temp_dir: str | None = None
    ship_bundle: bool | None = None  # send the bundle's files through Ray; None: when the cluster has >1 node
