"""Placement: one placement-group slot per stage, so a pipeline is scheduled all-or-nothing.

Ray calls a slot of a placement group a "bundle"; here "bundle" means only the model artifact,
and a slot is the resource set (CPUs, GPUs, node pin) one stage actor is placed into.

PACK puts stages on as few nodes as possible (fast NVLink/PCIe hops, shared host memory); SPREAD
prefers distinct nodes; STRICT_SPREAD requires them. A stage can be pinned to a node by address:
its slot then asks for a sliver of Ray's built-in `node:<ip>` resource, which only that node has.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from tvmpipe.core.errors import TvmpipeError

log = logging.getLogger(__name__)

STRATEGIES = ("PACK", "SPREAD", "STRICT_SPREAD", "STRICT_PACK")
NODE_PIN = 0.001  # of `node:<ip>`: every node has 1.0, so a pinned slot fits only there
MIN_CPU = 0.0001  # Ray's resource grain: the slot of a stage that reserves nothing (Ray refuses an empty one)
POLL_S = 0.5  # how often a pending reservation is looked at


class PlacementError(TvmpipeError):
    """The cluster cannot hold the pipeline as asked."""


@dataclass(frozen=True)
class Placement:
    """How stages map onto the cluster. `gpus` per stage may be fractional (0.5 packs two stages on
    one GPU) or 0 (CPU stages, reference/simulated backends); `cpus` is always explicit because Ray
    otherwise reserves one CPU per actor and a small machine runs out silently."""

    strategy: str = "PACK"
    gpus: float = 0.0
    cpus: float = 0.5
    nodes: tuple[str | None, ...] | None = None  # per stage: node IP to pin to, or None
    # Whether nodes may still join (an autoscaler, workers starting): a reservation Ray finds
    # infeasible on the nodes it has then waits for them; on a cluster that cannot grow (the
    # embedded --local one) it fails at once instead of waiting out the start timeout.
    grows: bool = True

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise PlacementError(f"unknown placement strategy {self.strategy!r} (choose from {', '.join(STRATEGIES)})")
        if self.gpus < 0 or self.cpus < 0:
            raise PlacementError("gpus and cpus per stage must be >= 0")

    def slots(self, num_stages: int) -> list[dict[str, float]]:
        """The resource set of each stage's slot (what Ray's placement_group() calls bundles)."""
        if self.nodes is not None and len(self.nodes) != num_stages:
            raise PlacementError(f"{len(self.nodes)} node pins for {num_stages} stages")
        out = []
        for i in range(num_stages):
            b: dict[str, float] = {"CPU": self.cpus}
            if self.gpus:
                b["GPU"] = self.gpus
            if self.nodes and self.nodes[i]:
                b[f"node:{self.nodes[i]}"] = NODE_PIN
            out.append({k: v for k, v in b.items() if v} or {"CPU": MIN_CPU})
        return out

    def actor_options(self, pg: Any, index: int) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)
        return {"num_cpus": self.cpus, "num_gpus": self.gpus, "scheduling_strategy": strategy}


def create_placement_group(placement: Placement, num_stages: int, timeout_s: float) -> Any:
    """Reserve one slot per stage, or raise PlacementError saying what the cluster lacks.

    Ray keeps an unsatisfiable reservation pending for ever; its scheduler says INFEASIBLE when no
    node it has could hold it (a GPU slot on a CPU-only cluster, STRICT_SPREAD over more stages
    than nodes). That fails at once where the cluster cannot grow, and is said once in the log
    where it can; anything else waits up to `timeout_s` (other jobs may free what it needs)."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    slots = placement.slots(num_stages)
    # Unique per pipeline: several pipelines (jobs, sweeps) share one cluster, and Ray refuses a
    # second placement group with a name already in use.
    pg = placement_group(slots, strategy=placement.strategy,
                         name=f"tvmpipe-{num_stages}stages-{uuid.uuid4().hex[:8]}")
    ready = pg.ready()
    deadline = time.monotonic() + timeout_s
    told = False
    while True:
        left = deadline - time.monotonic()
        done, _ = ray.wait([ready], timeout=max(0.0, min(POLL_S, left)))
        if done:
            try:
                ray.get(ready)
                return pg
            except Exception as exc:  # the reservation was removed or failed
                why = f"{type(exc).__name__}"
                break
        state = placement_group_table(pg).get("stats", {}).get("scheduling_state")
        if state == "INFEASIBLE" and not placement.grows:
            why = "the cluster's nodes cannot hold it (Ray finds it infeasible)"
            break
        if state == "INFEASIBLE" and not told:
            told = True
            log.warning("the cluster's nodes cannot hold %d stages with %s (each needs %s) yet; waiting up to "
                        "%.0f s for nodes to join", num_stages, placement.strategy, slots[0], timeout_s)
        if left <= 0:
            why = f"not reserved within {timeout_s:g} s"
            break
    remove_placement_group(pg)
    raise PlacementError(f"cannot place {num_stages} stages with {placement.strategy} (each needs {slots[0]}): "
                         f"{why}; cluster resources: {_resources()}")


def alive_nodes() -> int:
    """Nodes of the connected Ray cluster that are up."""
    import ray

    return sum(1 for n in ray.nodes() if n.get("Alive"))


def _resources() -> dict[str, float]:
    """The cluster's CPUs, GPUs and nodes, for errors (not its memory or node-id resources)."""
    import ray

    res = ray.cluster_resources()
    out = {k: res.get(k, 0.0) for k in ("CPU", "GPU")}
    out["nodes"] = alive_nodes()
    return out
