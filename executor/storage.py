"""Storage plan of one stage: which buffer (slot) holds each tensor, reused by lifetime.

graph.json carries TVM's storage_id plan for the whole graph, but a stage only holds part of the
graph and must keep its sent entries alive until they are copied out, so the plan is recomputed per
stage from liveness: a slot is reused once the last reader of its tensor has run. A `__nop` output
shares its input's slot (same bytes, new shape), so liveness is tracked per alias group. Params get
slots of their own (uploaded once, never overwritten); workspaces get one slot per (function, index),
allocated once and shared by every node that calls the function, since steps run one at a time.
An entry of no bytes (state the stage holds resident: executor/program.py `resident_state`) takes
no slot's room: every such entry shares one empty slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

PARAM, ACTIVATION, WORKSPACE = "param", "activation", "workspace"


@dataclass(frozen=True)
class Slot:
    """One device allocation. `nbytes` is the largest tensor ever placed in it."""

    id: int
    nbytes: int
    kind: str  # PARAM | ACTIVATION | WORKSPACE


@dataclass
class StoragePlan:
    slots: list[Slot]
    entry_slot: dict[int, int]  # entry id -> slot id
    workspace_slot: dict[tuple[str, int], int]  # (function, workspace index) -> slot id

    def total_bytes(self, kind: str | None = None) -> int:
        return sum(s.nbytes for s in self.slots if kind is None or s.kind == kind)


@dataclass(frozen=True)
class StepUse:
    """What the planner needs to know about one step: entries read and written, and whether the
    step is a `__nop` (its single output aliases its single input)."""

    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    alias: bool = False


def plan_storage(steps: Sequence[StepUse], nbytes: dict[int, int], params: Sequence[int],
                 feeds: Sequence[int], sends: Sequence[int],
                 workspaces: dict[tuple[str, int], int]) -> StoragePlan:
    """Greedy best-fit allocation over the stage's steps (like TVM's GraphPlanMemory, per stage).

    A step's outputs are placed before its dead inputs are released, so a kernel never writes into
    memory it is still reading.
    """
    n = len(steps)
    root: dict[int, int] = {}
    for s in steps:
        if s.alias:
            root[s.outputs[0]] = root.get(s.inputs[0], s.inputs[0])

    def find(e: int) -> int:  # the entry owning e's bytes (chains were resolved above)
        return root.get(e, e)

    born: dict[int, int] = {e: -1 for e in feeds}  # entry owning a slot -> step that writes it
    last: dict[int, int] = {}  # owning entry -> last step that needs its bytes (n: sent)
    size: dict[int, int] = {}
    for i, s in enumerate(steps):
        for e in s.inputs:
            last[find(e)] = max(last.get(find(e), -1), i)
        for e in s.outputs:
            if not s.alias:
                born[e] = i
    for e in sends:
        last[find(e)] = n
    for e, r in root.items():
        size[r] = max(size.get(r, 0), nbytes[e])
    for e in born:
        size[e] = max(size.get(e, 0), nbytes[e])

    slots: list[list] = []  # [nbytes, kind]
    entry_slot: dict[int, int] = {}
    for e in params:
        entry_slot[e] = len(slots)
        slots.append([nbytes[e], PARAM])
    free: list[int] = []

    empty: list[int] = []  # the one slot of no bytes that every empty entry shares (never freed, never grown)

    def place(e: int) -> None:
        need = size[e]
        if need == 0:  # no bytes of its own (state a stage holds resident): it takes no slot's room
            if not empty:
                empty.append(len(slots))
                slots.append([0, ACTIVATION])
            entry_slot[e] = empty[0]
            return
        fits = [k for k in free if slots[k][0] >= need]
        if fits:
            k = min(fits, key=lambda k: (slots[k][0], k))
        elif free:
            k = max(free, key=lambda k: (slots[k][0], -k))
            slots[k][0] = need  # grow the largest free slot rather than open a new one
        else:
            k = len(slots)
            slots.append([need, ACTIVATION])
        if k in free:
            free.remove(k)
        entry_slot[e] = k

    dies: dict[int, list[int]] = {}
    for e, b in born.items():
        dies.setdefault(last.get(e, b), []).append(e)

    def release(step: int) -> None:
        free.extend(entry_slot[e] for e in dies.get(step, ()) if size[e])

    for e in feeds:
        place(e)
    release(-1)
    for i, s in enumerate(steps):
        for e in s.outputs:
            if not s.alias:
                place(e)
        release(i)
    for e, r in root.items():
        entry_slot[e] = entry_slot[r]

    workspace_slot = {}
    for key, nb in workspaces.items():
        workspace_slot[key] = len(slots)
        slots.append([nb, WORKSPACE])
    return StoragePlan(slots=[Slot(i, nb, kind) for i, (nb, kind) in enumerate(slots)], entry_slot=entry_slot,
                       workspace_slot=workspace_slot)
