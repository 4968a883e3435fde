"""Measured links between the nodes of a Ray cluster, through tvmpipe's own data plane.

The partitioner charges every boundary frame a link's latency plus its bytes over the link's
bandwidth (partition/devices.py `Link`). Datasheet figures say little about what a frame gets
through our framing, our authenticated sockets and the host's network stack, so this measures it
with exactly that machinery: a `Prober` on each node (a Ray actor pinned to the node, no CPU
reserved) runs a data-plane `Listener` under a per-probe secret, and for each ordered pair (a, b)
prober a opens an authenticated `Link` to b and sends frames one at a time; b answers each with a
small frame on its own link back. Round trips of 4 KB frames give the latency (half the median),
round trips of 4 MB frames the bandwidth (4 MB over the extra time they take). Each prober also
probes itself over loopback: the same path without a network, the baseline the runtime's calibrated
per-frame costs (partition/runtime.py) already contain.

Every listener refuses a peer without the probe's secret (handshake.py) and reads only the two
frame layouts a probe sends (FrameLimits.exact), like every stage's listener.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from tvmpipe.cluster.wire.frames import Frame, FrameError, FrameLimits
from tvmpipe.cluster.wire.handshake import Peer, new_secret
from tvmpipe.cluster.wire.tcp import Address, Link, Listener
from tvmpipe.core.errors import TvmpipeError

SMALL, BIG = 4 << 10, 4 << 20  # bytes per probe frame
SMALL_ROUNDS, BIG_ROUNDS = 40, 6
ACK_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10.0
# a frame's layout per epoch of the probe connection: epoch 0 small frames, 1 big ones; answers are small
_LAYOUT = {0: (0, "uint8", (SMALL,)), 1: (1, "uint8", (BIG,))}


@dataclass(frozen=True)
class LinkFigures:
    """One direction between two node addresses (equal for a node's loopback): one-way latency of a
    small frame and the bandwidth big frames get, both through the data plane."""

    src: str
    dst: str
    latency_us: float
    bandwidth: float  # bytes/s

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Prober:
    """One node's end of the probe: answers frames sent to it, and probes others (see the module)."""

    def __init__(self, host: str, index: int, run: str, secret: bytes):
        self.index, self.run, self.secret = index, run, secret
        self.host = host
        self._peers: dict[int, Address] = {}
        self._back: dict[int, Link] = {}  # answers, to the prober that sent
        self._acks = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._listener = Listener(host, self._hello, self._frame, lambda peer, error: None, secret=secret)

    def address(self) -> Address:
        return self._listener.address

    def set_peers(self, peers: dict[int, Address]) -> None:
        self._peers = {int(k): tuple(v) for k, v in peers.items()}

    def _hello(self, peer: Peer) -> FrameLimits:
        if peer.run != self.run or peer.stage not in self._peers or peer.epoch not in (0, 1, 2):
            raise FrameError(f"probe hello from {peer.stage} run {peer.run} epoch {peer.epoch}: not this probe")
        entry, dtype, shape = _LAYOUT[1 if peer.epoch == 1 else 0]
        return FrameLimits.exact([(entry, dtype, shape)])

    def _frame(self, peer: Peer, frame: Frame) -> None:
        if frame.kind != "data":
            raise FrameError(f"probe got a {frame.kind} frame")
        if peer.epoch == 2:  # an answer to one of our own frames
            self._acks.release()
            return
        with self._lock:
            back = self._back.get(peer.stage)
            if back is None:
                hello = Frame("hello", self.run, 2, 0, self.index)
                back = self._back[peer.stage] = Link(self._peers[peer.stage], hello, self.secret, lambda exc: None)
        back.put(Frame("data", self.run, 2, frame.seq, self.index, {0: _ZEROS[0]}))

    def probe(self, dst: int) -> tuple[float, float]:
        """Median round trips (seconds) of a small and of a big frame to prober `dst`."""
        out = []
        for epoch, rounds in ((0, SMALL_ROUNDS), (1, BIG_ROUNDS)):
            entry = _LAYOUT[epoch][0]
            link = Link(self._peers[dst], Frame("hello", self.run, epoch, 0, self.index), self.secret,
                        lambda exc: None, connect_timeout_s=CONNECT_TIMEOUT_S, inline_bytes=BIG + 1)
            try:
                times = []
                for seq in range(rounds + 1):  # the first warms the connection up
                    t0 = time.perf_counter()
                    link.put(Frame("data", self.run, epoch, seq, self.index, {entry: _ZEROS[entry]}))
                    if not self._acks.acquire(timeout=ACK_TIMEOUT_S):
                        raise TvmpipeError(f"link probe: no answer from {self._peers[dst][0]} within {ACK_TIMEOUT_S:.0f} s")
                    times.append(time.perf_counter() - t0)
            finally:
                link.close()
            out.append(statistics.median(times[1:]))
        return out[0], out[1]

    def close(self) -> None:
        for link in self._back.values():
            link.close(flush=False)
        self._listener.close()


_ZEROS = {0: np.zeros(SMALL, np.uint8), 1: np.zeros(BIG, np.uint8)}


def figures(src: str, dst: str, small_rtt_s: float, big_rtt_s: float) -> LinkFigures:
    """Latency: half a small frame's round trip. Bandwidth: a big frame's extra bytes over the
    extra time its round trip takes (the answer is small either way)."""
    extra = max(big_rtt_s - small_rtt_s, 1e-9)
    return LinkFigures(src, dst, small_rtt_s / 2 * 1e6, (BIG - SMALL) / extra)


def measure_links(nodes: list[str] | None = None) -> list[LinkFigures]:
    """Probe every ordered pair of the alive nodes of the connected Ray cluster (or of `nodes`,
    their addresses), loopback on each node included. Needs `ray.init()` first."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    alive = [n for n in ray.nodes() if n.get("Alive")]
    by_ip = {n["NodeManagerAddress"]: n["NodeID"] for n in alive}
    ips = sorted(by_ip) if nodes is None else list(nodes)
    unknown = [ip for ip in ips if ip not in by_ip]
    if unknown:
        raise TvmpipeError(f"link probe: no alive Ray node at {', '.join(unknown)} (nodes: {', '.join(sorted(by_ip))})")
    run, secret = uuid.uuid4().hex[:12], new_secret()
    actor = ray.remote(num_cpus=0)(Prober)
    probers = [actor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(by_ip[ip], soft=False))
               .remote(ip, i, run, secret) for i, ip in enumerate(ips)]
    try:
        addresses = dict(enumerate(ray.get([p.address.remote() for p in probers], timeout=60)))
        ray.get([p.set_peers.remote(addresses) for p in probers], timeout=60)
        out = []
        for i, src in enumerate(ips):
            for j, dst in enumerate(ips):
                small, big = ray.get(probers[i].probe.remote(j), timeout=120)
                out.append(figures(src, dst, small, big))
        return out
    finally:
        for p in probers:
            try:
                ray.get(p.close.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - a dead prober's node is gone; nothing to close there
                pass
            ray.kill(p)


@dataclass(frozen=True)
class MeasuredLinks:
    """What the planner takes from a probe: the loopback baseline and the network between nodes
    (medians over nodes and over ordered pairs; None on a one-node cluster)."""

    loopback: LinkFigures
    network: LinkFigures | None
    pairs: tuple[LinkFigures, ...]

    def model_link(self, across_nodes: bool):
        """The partitioner's Link for frames between stages: the bandwidth frames measured, and the
        latency the network adds to loopback (the loopback part is already in the runtime's
        calibrated per-frame costs, partition/runtime.py, so it is not charged twice)."""
        from tvmpipe.partition.devices import Link as ModelLink

        if not across_nodes or self.network is None:
            return ModelLink(self.loopback.bandwidth, 0.0)
        return ModelLink(self.network.bandwidth, max(0.0, self.network.latency_us - self.loopback.latency_us))

    def describe(self) -> str:
        text = f"loopback {_text(self.loopback)}"
        if self.network is not None:
            text += f"; between nodes {_text(self.network)} (median of {len(self.pairs) - self._loops} ordered pairs)"
        return text

    @property
    def _loops(self) -> int:
        return sum(1 for p in self.pairs if p.src == p.dst)

    def to_json(self) -> dict[str, Any]:
        return {"format": "tvmpipe-links", "version": 1, "loopback": self.loopback.to_json(),
                "network": self.network.to_json() if self.network else None,
                "pairs": [p.to_json() for p in self.pairs]}


def _text(f: LinkFigures) -> str:
    return f"{f.latency_us:.0f} us one way, {f.bandwidth / 1e9:.2f} GB/s"


def summarize(pairs: list[LinkFigures]) -> MeasuredLinks:
    """Medians: over each node's loopback, and over every pair of distinct nodes."""
    def median(fs: list[LinkFigures], src: str, dst: str) -> LinkFigures:
        return LinkFigures(src, dst, statistics.median(f.latency_us for f in fs), statistics.median(f.bandwidth for f in fs))

    loops = [p for p in pairs if p.src == p.dst]
    net = [p for p in pairs if p.src != p.dst]
    if not loops:
        raise TvmpipeError("link probe: no loopback figure measured")
    return MeasuredLinks(median(loops, "*", "*"), median(net, "*", "*") if net else None, tuple(pairs))
