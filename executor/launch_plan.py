"""The CUDA launch plan: every kernel of a stage with its grid, block, shared memory and packed
argument bytes, pointers resolved from the storage plan. Pure Python, built once per stage, so the
exact launch sequence can be checked on machines without a GPU.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from tvmpipe.executor.program import COPY, KERNELS, BoundOperand, StageProgram

SCALAR_FORMAT = {"int32": "i", "int64": "q", "uint32": "I", "uint64": "Q", "float32": "f", "float64": "d"}


def pack_args(args: tuple[BoundOperand, ...], slot_ptrs: list[int], entry_ptrs: dict[int, int] | None = None) -> bytes:
    """The kernel parameter buffer: pointers and scalars at their natural alignment (C ABI).
    `entry_ptrs` points chosen entries elsewhere than their storage slot (resident state)."""
    fmt, vals = "@", []
    for a in args:
        if a.kind == "scalar":
            fmt += SCALAR_FORMAT[a.dtype]
            vals.append(a.value)
        else:
            fmt += "P"
            vals.append(entry_ptrs[a.entry] if entry_ptrs and a.entry in entry_ptrs else slot_ptrs[a.slot])
    return struct.pack(fmt, *vals)


@dataclass(frozen=True)
class PlannedLaunch:
    step: int
    node: int
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    argbuf: bytes


@dataclass(frozen=True)
class PlannedCopy:  # a `__copy` node: device-to-device
    step: int
    node: int
    dst: int
    src: int
    nbytes: int


def build_launch_plan(program: StageProgram, slot_ptrs: list[int],
                      entry_ptrs: dict[int, int] | None = None) -> list[PlannedLaunch | PlannedCopy]:
    plan: list[PlannedLaunch | PlannedCopy] = []
    over = entry_ptrs or {}
    ptr = lambda e: over[e] if e in over else slot_ptrs[program.storage.entry_slot[e]]  # noqa: E731
    for i, s in enumerate(program.steps):
        if s.kind == KERNELS:
            plan += [PlannedLaunch(i, s.node, l.kernel, l.grid, l.block, l.shared_mem, pack_args(l.args, slot_ptrs, over))
                     for l in s.launches]
        elif s.kind == COPY:
            plan.append(PlannedCopy(i, s.node, ptr(s.outputs[0]), ptr(s.inputs[0]), program.entry_specs[s.outputs[0]].nbytes))
    return plan
