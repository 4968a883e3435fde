"""StageActor: the thin Ray wrapper around StageWorker, and the launcher that places them.

The actor adds nothing to the worker but Ray's lifecycle: resources (`num_gpus`, `num_cpus`),
placement, and a handle the driver can call and kill. A build failure is kept and re-raised by
every call, so the driver reports "stage 2 failed to start: <reason>" instead of Ray's actor-died
traceback.
"""

from __future__ import annotations

import os
from typing import Any

import ray

from tvmpipe.cluster.control.launchers import CONTROL_METHODS, Timeouts, WorkerError, WorkerLost, describe
from tvmpipe.cluster.control.environment import missing_from_workers, thread_env
from tvmpipe.cluster.control.headwatch import HeadWatch
from tvmpipe.cluster.control.placement import Placement, create_placement_group
from tvmpipe.cluster.wire.tcp import Address
from tvmpipe.cluster.control.shipping import build_shipment, local_bundle
from tvmpipe.cluster.worker import StageSpec, StageWorker


class StageActor:
    def __init__(self, spec: StageSpec, shipment: list | None = None):
        """`shipment`: None (the bundle is read in place), or [ObjectRef of this node's Shipment],
        in a list so Ray does not resolve it before the actor runs, and so the worker can drop the
        last reference once the node's copy is on disk."""
        if spec.host is None:  # bind the data plane where other nodes can reach this one
            spec.host = ray.util.get_node_ip_address()
        self.stage = spec.index
        self.start_error: str | None = None
        self.worker: StageWorker | None = None
        try:
            self.worker = StageWorker(spec, local_bundle([ray.get(shipment[0])] if shipment else None, spec.index))
        except Exception as exc:  # kept and reported through call(), see module docstring
            self.start_error = describe(exc)

    def call(self, method: str, *args: Any) -> Any:
        if self.worker is None:
            raise WorkerError(self.stage, f"failed to start: {self.start_error}")
        if method not in CONTROL_METHODS:
            raise WorkerError(self.stage, f"unknown control method {method!r}")
        return getattr(self.worker, method)(*args)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None


def _unwrap(stage: int, exc: Exception) -> WorkerError:
    """Ray's exceptions, as the launcher interface's two kinds."""
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = exc.cause
        if isinstance(cause, WorkerError):
            return WorkerError(stage, cause.message)
        return WorkerError(stage, describe(cause) if cause is not None else str(exc))
    if isinstance(exc, ray.exceptions.GetTimeoutError):
        return WorkerLost(stage, f"no answer within the control timeout ({describe(exc)})")
    return WorkerLost(stage, f"actor died: {type(exc).__name__}")


class RayLauncher:
    """Stage actors in one placement group (one slot per stage). The model bundle reaches the actors as
    a path (shared filesystem, local mode: each reads only its own tensors) or, with `ship_bundle`,
    through the object store: one Shipment per node (shipping.py) with the small files and only the
    weights of the stages placed on that node, put once and taken by every stage actor there."""

    def __init__(self, placement: Placement = Placement(), timeouts: Timeouts = Timeouts(),
                 ship_bundle: bool = False, env: dict[str, str] | None = None):
        self.placement = placement
        self.env = dict(env or {})  # extra environment of the stage actors
        self.timeouts = timeouts
        self.ship_bundle = ship_bundle
        self._pg = None
        self._specs: list[StageSpec] = []
        self._actors: list[Any] = []
        self._ship_refs: dict[int, Any] = {}  # stage -> ObjectRef of its node's shipment (while starting)
        self.shipped: dict[str, int] = {}  # node id -> bytes shipped to it (small files + weights slice)
        self.shipped_tensors: dict[str, tuple[str, ...]] = {}  # node id -> the tensors in its slice
        # Stages on the driver's own node read the bundle path in place (it is readable there) and
        # are sent nothing; True ships to that node too (tests of the ship path on one machine).
        self.ship_same_node = False
        self._remote = ray.remote(StageActor)
        gcs = _gcs_address()
        self._head = HeadWatch(gcs) if gcs else None

    def watch_control(self, on_lost) -> None:
        """Call `on_lost(why)` (from another thread) if the cluster's head goes away (headwatch.py)."""
        if self._head is not None:
            self._head.on_lost = on_lost

    @property
    def control_lost(self) -> str | None:
        """Why the head is gone, or None. Once it is, no Ray call is made: some would block."""
        return self._head.lost if self._head else None

    def _create(self, spec: StageSpec) -> Any:
        opts = self.placement.actor_options(self._pg, spec.index)
        env = missing_from_workers({**thread_env(), **self.env})
        if env:
            opts["runtime_env"] = {"env_vars": env}
        ship = [self._ship_refs[spec.index]] if spec.index in self._ship_refs else None
        return self._remote.options(max_restarts=0, **opts).remote(spec, ship)

    def _addresses(self, stages: list[int]) -> list[Address]:
        refs = [self._actors[i].call.remote("address") for i in stages]
        out = []
        for i, ref in zip(stages, refs):
            try:
                out.append(tuple(ray.get(ref, timeout=self.timeouts.start)))
            except Exception as exc:  # any Ray failure becomes WorkerError/WorkerLost
                raise _unwrap(i, exc) from None
        return out

    def start(self, specs: list[StageSpec]) -> list[Address]:
        self._specs = list(specs)
        if self._head is not None:
            self._head.start()
        self._pg = create_placement_group(self.placement, len(specs), self.timeouts.start)
        try:
            if self.ship_bundle:
                self._put_shipments(specs)
            self._actors = [self._create(s) for s in specs]
            return self._addresses(list(range(len(specs))))
        except BaseException:
            self.shutdown()
            raise
        finally:
            self._ship_refs = {}  # the actors have unpacked theirs: the object store may free them

    def _nodes(self, n: int) -> list[str]:
        """The node id each placement slot landed on ('' where Ray does not say)."""
        from ray.util.placement_group import placement_group_table

        try:
            where = placement_group_table(self._pg).get("bundles_to_node_id", {})
        except Exception:  # noqa: BLE001 - unknown placement: one shipment per stage instead
            where = {}
        return [str(where.get(i, where.get(str(i), f"?stage{i}"))) for i in range(n)]

    def _put_shipments(self, specs: list[StageSpec]) -> None:
        """One object per node, holding the weights of every stage on it (and no others)."""
        nodes = self._nodes(len(self._specs))
        here = _driver_node()
        by_node: dict[str, list[StageSpec]] = {}
        for s in specs:
            if nodes[s.index] == here and not self.ship_same_node and os.path.exists(s.bundle_path):
                s.bundle_path = os.path.abspath(s.bundle_path)  # same node: read in place, its own tensors only
                continue
            by_node.setdefault(nodes[s.index], []).append(s)
        for node, group in by_node.items():
            ship = build_shipment(group[0].bundle_path, [(s.start, s.end) for s in group], [s.index for s in group])
            ref = ray.put(ship)
            self.shipped[node] = self.shipped.get(node, 0) + ship.nbytes
            self.shipped_tensors[node] = tuple(ship.tensors)
            del ship  # the object store holds it now
            for s in group:
                self._ship_refs[s.index] = ref

    def restart(self, stage: int) -> Address:
        if self.control_lost:
            raise WorkerLost(stage, self.control_lost)
        self.kill(stage)
        try:
            if self.ship_bundle:
                self._put_shipments([self._specs[stage]])
            self._actors[stage] = self._create(self._specs[stage])
        finally:
            self._ship_refs = {}
        return self._addresses([stage])[0]

    def call(self, stage: int, method: str, *args: Any) -> Any:
        if self.control_lost:
            raise WorkerLost(stage, self.control_lost)
        try:
            return ray.get(self._actors[stage].call.remote(method, *args), timeout=self.timeouts.call)
        except Exception as exc:  # any Ray failure becomes WorkerError/WorkerLost
            raise _unwrap(stage, exc) from None

    def call_all(self, method: str, args: list[tuple] | None = None) -> list[Any]:
        args = args or [()] * len(self._actors)
        if self.control_lost:
            return [WorkerLost(i, self.control_lost) for i in range(len(self._actors))]
        refs = [a.call.remote(method, *x) for a, x in zip(self._actors, args)]
        out = []
        for i, ref in enumerate(refs):
            try:
                out.append(ray.get(ref, timeout=self.timeouts.call))
            except Exception as exc:  # reported per stage, see Launcher.call_all
                out.append(_unwrap(i, exc))
        return out

    def actor(self, stage: int) -> Any:
        """The stage's actor handle (for fault-injection tests and debugging)."""
        return self._actors[stage]

    def kill(self, stage: int) -> None:
        if self.control_lost:  # ray.kill would block; the stage's node goes down with the head
            return
        ray.kill(self._actors[stage], no_restart=True)

    def shutdown(self) -> None:
        """Close each worker (sockets, stage) gracefully, then kill the actors and free the group."""
        from ray.util.placement_group import remove_placement_group

        if self._head is not None:
            self._head.stop()
        if self.control_lost:  # Ray calls would block; every node's raylet ends its workers
            self._actors, self._pg = [], None
            return
        refs = [a.close.remote() for a in self._actors]
        try:
            ray.get(refs, timeout=self.timeouts.shutdown)
        except Exception:  # dead or stuck actors are killed below either way
            pass
        for a in self._actors:
            ray.kill(a, no_restart=True)
        self._actors = []
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None


def _driver_node() -> str | None:
    """The node id this driver runs on (None under Ray Client or where Ray does not say)."""
    try:
        return str(ray.get_runtime_context().get_node_id())
    except Exception:  # noqa: BLE001 - unknown: every stage is shipped
        return None


def _gcs_address() -> tuple[str, int] | None:
    """(host, port) of the connected cluster's GCS; None where unknown (not connected, Ray Client)."""
    try:
        host, port = ray.get_runtime_context().gcs_address.rsplit(":", 1)
        return host, int(port)
    except Exception:  # noqa: BLE001 - no address, no watch: Ray's own failure handling remains
        return None
