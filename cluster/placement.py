"""Placement: one placement-group slot per stage, so a pipeline is scheduled all-or-nothing.

Ray calls a slot of a placement group a "bundle"; here "bundle" means only the model artifact,
and a slot is the resource set (CPUs, GPUs, node pin) one stage actor is placed into.

PACK puts stages on as few nodes as possible (fast NVLink/PCIe hops, shared host memory); SPREAD
prefers distinct nodes; STRICT_SPREAD requires them. A stage can be pinned to a node by address:
its slot then asks for a sliver of Ray's built-in `node:<ip>` resource, which only that node has.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from tvmpipe.core.errors import TvmpipeError

STRATEGIES = ("PACK", "SPREAD", "STRICT_SPREAD", "STRICT_PACK")
NODE_PIN = 0.001  # of `node:<ip>`: every node has 1.0, so a pinned slot fits only there


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
            out.append({k: v for k, v in b.items() if v})
        return out

    def actor_options(self, pg: Any, index: int) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)
        return {"num_cpus": self.cpus, "num_gpus": self.gpus, "scheduling_strategy": strategy}


def create_placement_group(placement: Placement, num_stages: int, timeout_s: float) -> Any:
    """Reserve one slot per stage, or raise PlacementError saying what the cluster lacks."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    slots = placement.slots(num_stages)
    # Unique per pipeline: several pipelines (jobs, sweeps) share one cluster, and Ray refuses a
    # second placement group with a name already in use.
    pg = placement_group(slots, strategy=placement.strategy,
                         name=f"tvmpipe-{num_stages}stages-{uuid.uuid4().hex[:8]}")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except Exception as exc:  # GetTimeoutError: the reservation cannot be met (now)
        remove_placement_group(pg)
        raise PlacementError(f"cannot place {num_stages} stages with {placement.strategy} "
                             f"(each needs {slots[0]}); cluster resources: {ray.cluster_resources()} "
                             f"[{type(exc).__name__}]") from None
    return pg
