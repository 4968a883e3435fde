"""Per-range tables: any stage's compute time, received bytes and memory in O(1).

The bottleneck DP asks about O(K n^2) candidate stages, so every per-stage quantity is
precomputed for all op-ordinal ranges [i, j) at once. A quantity "bytes of the items some op in
[i, j) uses" (params, workspaces, received entries) is a sum of rectangles in (i, j): an item used
at ordinals u1 < u2 < ... and available from `prior` counts for i in (u_{t-1}, u_t] and j > u_t
(u_0 = prior). Rectangles go into a 2-D difference array, two cumulative sums turn it into the
table; the cost is O(n^2 + uses), never a walk of the graph per range.

Memory model of a stage [i, j): params it reads + workspaces of the functions it calls (each
once) + received entries (held for the whole stage: they arrive as one frame) + the peak, over its
op steps t, of entries produced in the stage that are still needed at t (read at or after t, sent
to a later stage, or a graph output; an entry with no reader lives only at the step producing it).
`__nop` outputs share their input's buffer and cost no memory of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from tvmpipe.partition.cuts import GraphFlow


@dataclass
class RangeTables:
    """Tables indexed [i, j] for op-ordinal ranges [i, j), 0 <= i < j <= n; other cells are unused."""

    n: int
    time_prefix: np.ndarray  # (n+1,): sum of op times before ordinal k
    recv: np.ndarray  # bytes arriving at the stage: activations of earlier stages + graph inputs
    params: np.ndarray  # bytes of params the stage loads
    workspace: np.ndarray  # bytes of workspaces the stage allocates
    activations: np.ndarray  # peak bytes of entries produced in the stage
    send: np.ndarray | None = None  # bytes leaving the stage: its entries read after it, and graph outputs
    # resident state (bundle.json `state`, see `state_table`): slots x the buffers of every pair the
    # range holds whole; inf where the range holds part of a pair (no plan may cut one)
    state: np.ndarray | None = None

    def compute_us(self, i: int, j: int) -> float:
        return float(self.time_prefix[j] - self.time_prefix[i])

    @property
    def compute(self) -> np.ndarray:
        """(n+1, n+1) compute time of [i, j) (meaningful for i < j)."""
        return self.time_prefix[None, :] - self.time_prefix[:, None]

    @property
    def memory(self) -> np.ndarray:
        m = self.params + self.workspace + self.recv + self.activations
        return m if self.state is None else m + self.state

    @classmethod
    def build(cls, flow: GraphFlow, time_us: np.ndarray, workspace_by_func: dict[str, int]) -> RangeTables:
        n = flow.num_ops
        prefix = np.concatenate([[0.0], np.cumsum(np.asarray(time_us, dtype=np.float64))])
        acts = [e for e in flow.entries if e.kind == "activation"]
        recv = _union_table(n, [(e.nbytes, e.producer, e.uses) for e in acts] +
                            [(e.nbytes, -1, e.uses) for e in flow.entries if e.kind == "input"])
        params = _union_table(n, [(e.nbytes, -1, e.uses) for e in flow.entries if e.kind == "param"])
        calls: dict[str, list[int]] = {}
        for k, nid in enumerate(flow.ops):
            fn = flow.graph.nodes[nid].func_name
            if workspace_by_func.get(fn):
                calls.setdefault(fn, []).append(k)
        workspace = _union_table(n, [(workspace_by_func[fn], -1, tuple(us)) for fn, us in calls.items()])
        return cls(n, prefix, recv, params, workspace, _peak_activations(flow), _send_table(flow))


def _send_table(flow: GraphFlow) -> np.ndarray:
    """send[i, j]: bytes of entries produced in [i, j) that an op at j or later reads, or that are graph
    outputs: what the stage writes to its consumers. An entry produced at p and last read at u counts
    for i <= p < j <= u (j <= n for a graph output): one rectangle each in a 2-D difference array."""
    n = flow.num_ops
    d = np.zeros((n + 2, n + 2))
    for e in flow.entries:
        if e.kind != "activation" or not e.nbytes:
            continue
        p = e.producer
        last = n if e.is_head else (e.uses[-1] if e.uses else -1)
        if last <= p:
            continue
        # i in [0, p], j in [p + 1, last]
        d[0, p + 1] += e.nbytes
        d[p + 1, p + 1] -= e.nbytes
        d[0, last + 1] -= e.nbytes
        d[p + 1, last + 1] += e.nbytes
    return d.cumsum(axis=0).cumsum(axis=1)[: n + 1, : n + 1]


def _union_table(n: int, items: Iterable[tuple[int, int, tuple[int, ...]]]) -> np.ndarray:
    i0, i1, j0, w = [], [], [], []
    for nbytes, prior, uses in items:
        if not nbytes:
            continue
        prev = prior
        for u in uses:
            if u <= prev:
                continue
            i0.append(prev + 1), i1.append(u + 1), j0.append(u + 1), w.append(nbytes)
            prev = u
    d = np.zeros((n + 2, n + 2))
    if w:
        i0a, i1a, j0a, wa = (np.asarray(x) for x in (i0, i1, j0, w))
        wa = wa.astype(np.float64)
        # rectangle i in [i0, i1), j in [j0, n]
        np.add.at(d, (i0a, j0a), wa)
        np.add.at(d, (i1a, j0a), -wa)
    return d.cumsum(axis=0).cumsum(axis=1)[: n + 1, : n + 1]


def _peak_activations(flow: GraphFlow) -> np.ndarray:
    """act[i, j] = max over t in [i, j) of bytes produced in [i, t] still needed at t."""
    n = flow.num_ops
    last_use: dict[int, int] = {}
    head: dict[int, bool] = {}
    for e in flow.entries:
        if e.kind != "activation":
            continue
        root = flow.storage_root(e.id)
        if flow.entries[root].kind != "activation":
            continue  # a __nop view of a graph input or a param: no activation buffer
        last_use[root] = max(last_use.get(root, -1), e.uses[-1] if e.uses else -1)
        head[root] = head.get(root, False) or e.is_head
    live = np.zeros(n + 1)  # live[t]: items with producer <= t still needed at t
    d = np.zeros((n + 2, n + 1))  # earlier[i, t]: of those, the ones produced before i
    for root, lu in last_use.items():
        e = flow.entries[root]
        if not e.nbytes:
            continue
        end = n - 1 if head[root] else max(e.producer, lu)
        live[e.producer] += e.nbytes
        live[end + 1] -= e.nbytes
        d[e.producer + 1, 0] += e.nbytes
        d[e.producer + 1, end + 1] -= e.nbytes
    live = np.cumsum(live)[:n]
    earlier = d.cumsum(axis=0).cumsum(axis=1)[: n + 1, :n]
    a = live[None, :] - earlier
    t = np.arange(n)
    a[t[None, :] < np.arange(n + 1)[:, None]] = -np.inf
    peak = np.maximum.accumulate(a, axis=1)
    out = np.zeros((n + 1, n + 1))
    out[:, 1:] = np.maximum(peak, 0)
    return out


def state_table(n: int, spans: list[tuple[int, int, int]], slots: int) -> np.ndarray:
    """state[i, j] for op-ordinal ranges [i, j): per pair spanning ordinals [a, b] that holds
    `nbytes` per slot (its buffers: Bundle.state_buffers), slots x nbytes when i <= a and b < j;
    inf when the range holds part of the span only."""
    i = np.arange(n + 1)[:, None]
    j = np.arange(n + 1)[None, :]
    out = np.zeros((n + 1, n + 1))
    for a, b, nbytes in spans:
        whole = (i <= a) & (j > b)
        part = (i <= b) & (j > a) & ~whole
        out = out + np.where(whole, float(slots) * nbytes, 0.0)
        out[part] = np.inf
    return out
