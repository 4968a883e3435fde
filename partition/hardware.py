"""What-if clusters: a description of devices and links that `partition` and `sweep` plan for.

A researcher asks "8 H100 on 2 nodes over 100 Gb/s, or 16 A10 on 4 nodes?" without the hardware.
The answer needs, per pipeline stage, the device's speed and memory and the link its inbound frames
cross; this module reads that from a JSON file and lays K stages onto the devices in file order
(node by node, PACK): stage s runs on device s, stage s's inbound link is the node's own link when
device s-1 sits on the same node and the network between nodes otherwise; stage 0's inbound link is
the host link from the driver. Frames from further back (skip connections) are charged on the same
link, a simplification that the DP and the simulator share.

```json
{"format": "tvmpipe-cluster", "version": 1, "name": "8 H100 on 2 nodes",
 "reference_device": "h100",
 "nodes": [{"device": "h100", "devices": 4, "count": 2,
            "link": {"bandwidth": "450GB/s", "latency": "3us"}}],
 "network": {"bandwidth": "100Gbit/s", "latency": "10us"},
 "host": {"bandwidth": "25GB/s", "latency": "5us"}}
```

Per node: `device` (a name in devices.py), `devices` per node (default 1), `count` identical
nodes (default 1), optional `speed` (default: the device's fp32 peak over the reference device's,
where op times are for the reference device) and `memory` (default: the device's). Links take
(bandwidth, latency): measured figures (e.g. from the multi-node test bed) drop straight in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tvmpipe.partition.devices import DEVICES, Link, get_device, parse_bandwidth, parse_bytes, parse_duration_us
from tvmpipe.partition.errors import PartitionError

CLUSTER_FORMAT = "tvmpipe-cluster"
DEFAULT_INTRA = {"bandwidth": "300GB/s", "latency": "3us"}  # NVLink-class
DEFAULT_NETWORK = {"bandwidth": "100Gbit/s", "latency": "10us"}
DEFAULT_HOST = {"bandwidth": "25GB/s", "latency": "5us"}  # PCIe from the driver's host


@dataclass(frozen=True)
class Slot:
    """One device of the cluster, in placement order."""

    node: int
    device: str
    speed: float
    memory: int


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    slots: tuple[Slot, ...]
    node_links: tuple[Link, ...]  # per node: between its own devices
    network: Link  # between nodes
    host: Link  # driver -> first device

    @property
    def num_devices(self) -> int:
        return len(self.slots)

    @property
    def num_nodes(self) -> int:
        return len(self.node_links)

    def stages(self, k: int) -> tuple[list[float], list[int], list[Link]]:
        """Speeds, memory caps and inbound links of K stages placed on the first K devices."""
        if k > self.num_devices:
            raise PartitionError(f"cluster '{self.name}' has {self.num_devices} devices: it cannot run {k} stages "
                                 "(one stage per device)")
        slots = self.slots[:k]
        links = [self.host] + [self.node_links[b.node] if a.node == b.node else self.network
                               for a, b in zip(slots, slots[1:])]
        return [s.speed for s in slots], [s.memory for s in slots], links

    def describe(self) -> str:
        kinds: dict[str, int] = {}
        for s in self.slots:
            kinds[s.device] = kinds.get(s.device, 0) + 1
        devs = ", ".join(f"{n} x {d}" for d, n in kinds.items())
        return (f"{self.name}: {devs} on {self.num_nodes} node(s); network {_link_text(self.network)}, "
                f"host {_link_text(self.host)}")


def _link_text(link: Link) -> str:
    return f"{link.bandwidth / 1e9:g} GB/s + {link.latency_us:g} us"


def load_cluster(path: str | Path) -> ClusterSpec:
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PartitionError(f"{path}: cannot read the cluster description: {exc}") from None
    return parse_cluster(obj, str(path))


def parse_cluster(obj: Any, where: str = "cluster") -> ClusterSpec:
    """Read a cluster description (see the module docstring); errors name the file and the field."""
    if not isinstance(obj, dict):
        raise PartitionError(f"{where}: a cluster description is a JSON object")
    if obj.get("format", CLUSTER_FORMAT) != CLUSTER_FORMAT:
        raise PartitionError(f"{where}: format: must be {CLUSTER_FORMAT!r}, got {obj.get('format')!r}")
    unknown = set(obj) - {"format", "version", "name", "reference_device", "nodes", "network", "host"}
    if unknown:
        raise PartitionError(f"{where}: unknown field(s) {sorted(unknown)}")
    ref = _field(where, "reference_device", lambda v: get_device(str(v)), obj.get("reference_device", "h100"))
    nodes = obj.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise PartitionError(f"{where}: nodes: must be a non-empty list of node objects")
    slots: list[Slot] = []
    node_links: list[Link] = []
    for i, node in enumerate(nodes):
        fld = f"nodes[{i}]"
        if not isinstance(node, dict):
            raise PartitionError(f"{where}: {fld}: must be an object with 'device' and 'devices'")
        unknown = set(node) - {"name", "device", "devices", "count", "speed", "memory", "link"}
        if unknown:
            raise PartitionError(f"{where}: {fld}: unknown field(s) {sorted(unknown)}")
        if "device" not in node:
            raise PartitionError(f"{where}: {fld}.device: missing (one of {', '.join(DEVICES)})")
        spec = _field(where, f"{fld}.device", lambda v: get_device(str(v)), node["device"])
        per_node = _count(where, f"{fld}.devices", node.get("devices", 1))
        copies = _count(where, f"{fld}.count", node.get("count", 1))
        speed = _field(where, f"{fld}.speed", float, node.get("speed", spec.fp32_flops / ref.fp32_flops))
        if not speed > 0:
            raise PartitionError(f"{where}: {fld}.speed: must be positive, got {speed}")
        memory = _field(where, f"{fld}.memory", parse_bytes, node.get("memory", spec.memory))
        link = _link(where, f"{fld}.link", node.get("link", DEFAULT_INTRA))
        for _ in range(copies):
            node_links.append(link)
            slots += [Slot(len(node_links) - 1, spec.name, float(speed), int(memory)) for _ in range(per_node)]
    name = str(obj.get("name") or Path(where).stem)
    return ClusterSpec(name, tuple(slots), tuple(node_links), _link(where, "network", obj.get("network", DEFAULT_NETWORK)),
                       _link(where, "host", obj.get("host", DEFAULT_HOST)))


def _field(where: str, fld: str, convert: Any, value: Any) -> Any:
    try:
        return convert(value)
    except (PartitionError, ValueError, TypeError) as exc:
        raise PartitionError(f"{where}: {fld}: {exc}") from None


def _count(where: str, fld: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PartitionError(f"{where}: {fld}: must be a positive integer, got {value!r}")
    return value


def _link(where: str, fld: str, value: Any) -> Link:
    if not isinstance(value, dict) or "bandwidth" not in value:
        raise PartitionError(f"{where}: {fld}: must be an object {{\"bandwidth\": \"100Gbit/s\", \"latency\": \"10us\"}}")
    bw = _field(where, f"{fld}.bandwidth", parse_bandwidth, value["bandwidth"])
    lat = _field(where, f"{fld}.latency", parse_duration_us, value.get("latency", "0us"))
    return Link(bw, lat)
