"""The `reference` backend: runs each fused function's ops.json program with NumPy.

It honours the stage's storage plan (every entry is a view into its slot's bytes), so a wrong plan
shows up as wrong numbers here too, not only on the GPU. Unknown ops are reported when the backend
is built, all at once, naming op, function and node.
"""

from __future__ import annotations

import time

import numpy as np

from tvmpipe.bundle import Bundle
from tvmpipe.bundle.dtypes import np_dtype
from tvmpipe.bundle.weights import map_params, param_into, settle_params
from tvmpipe.core.memory import POPULATE_FROM, populated_bytes
from tvmpipe.executor.backend import StepTiming
from tvmpipe.executor.errors import ExecutorError, UnsupportedOpError
from tvmpipe.executor.program import COPY, KERNELS, NOP, StageProgram
from tvmpipe.executor.reference_ops import OpFailure, run_function, unknown_ops

ALIGN = 64  # slot alignment, so BLAS sees the same alignment whichever stage a tensor lives in


def aligned_bytes(nbytes: int) -> np.ndarray:
    """A slot's zeroed bytes, ALIGN-aligned. Large slots (weights read straight into them) are
    page-aligned mappings populated in one call (core/memory.py: ~1.5-6x faster to fill)."""
    if nbytes >= POPULATE_FROM:
        return populated_bytes(nbytes)
    raw = np.zeros(nbytes + ALIGN, dtype=np.uint8)
    off = (-raw.ctypes.data) % ALIGN
    return raw[off:off + nbytes]


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether `a` is `b`'s bytes exactly (same start, shape and strides): nothing to copy."""
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.strides == b.strides \
        and a.shape == b.shape


class ReferenceBackend:
    name = "reference"

    def __init__(self, bundle: Bundle, program: StageProgram):
        self.program = program
        if bundle.is_bare:
            raise UnsupportedOpError(f"{bundle.path} is a bare graph.json: it has no ops.json for the reference "
                                     "backend (use --backend simulated, or a bundle)")
        self.functions = {}
        problems = []
        for s in program.steps:
            if s.kind != KERNELS:
                continue
            fn = bundle.ops.get(s.func)
            if fn is None:
                problems.append(f"node {s.node} '{s.name}': function '{s.func}' has no op program in ops.json")
                continue
            for name in unknown_ops(fn.op_names):
                problems.append(f"op '{name}' in function '{s.func}' (node {s.node} '{s.name}')")
            self.functions[s.func] = fn
        if problems:
            raise UnsupportedOpError("the reference backend cannot run this stage:\n  - " + "\n  - ".join(dict.fromkeys(problems)))
        # Weights in a safetensors file are mapped, not copied: a param's slot is the file's own
        # pages (map_params), hashed on the helper thread. What cannot be mapped (in-memory params,
        # an unaligned tensor) goes straight from the file into its slot, each slot's pages made
        # just before its tensor is read, while the previous tensors are still being hashed
        # (param_into with a pending list). Every checksum is compared before the stage is used.
        sizes = [max(s.nbytes, 1) for s in program.storage.slots]
        self.slots: list = [None] * len(sizes)
        pending: list = []
        try:
            mapped = map_params(bundle.params, program.param_entries, pending)
            for name, e in program.param_entries.items():
                slot = program.storage.entry_slot[e]
                if name in mapped:  # a param's slot holds it alone, at its exact size (plan_storage)
                    self.slots[slot] = mapped[name]
                    continue
                if self.slots[slot] is None:
                    self.slots[slot] = aligned_bytes(sizes[slot])
                param_into(bundle.params, name, self.view(e), pending)
        except BaseException:
            settle_params(bundle.params, pending, compare=False)  # the hashing lets go of the slots; this error stands
            raise
        settle_params(bundle.params, pending)  # every checksum compared before the stage is used
        self.slots = [b if b is not None else aligned_bytes(n) for b, n in zip(self.slots, sizes)]
        self.views = {e: self.view(e) for e in program.entry_specs}
        self._bound: set[int] = set()  # state entries pointed at a slot's buffer (bind_state)
        self._nop_copy: set[int] = set()  # NOP steps that must copy: one side is a bound entry

    def free_memory(self) -> int | None:
        """Host memory this process could still take (Linux MemAvailable), for SlotState's check
        that a stage's caches fit before any is allocated; None where it cannot be read."""
        from tvmpipe.executor.kvpool import host_available

        return host_available()

    def bind_state(self, entry: int, array: np.ndarray) -> None:
        """Point `entry` at `array` (a sequence slot's state buffer) for the next runs: the kernels
        read and write it in place, so state is never copied (executor/stage.py SlotState)."""
        if entry not in self._bound:
            self._bound.add(entry)
            self._nop_copy = {i for i, s in enumerate(self.program.steps) if s.kind == NOP
                              and self._bound & (set(s.inputs) | set(s.outputs))}
        self.views[entry] = array

    def view(self, entry: int) -> np.ndarray:
        spec = self.program.entry_specs[entry]
        dt = np_dtype(spec.dtype)
        if entry in self.program.resident:  # no bytes of its own: bound to the stage's state before any run
            return np.broadcast_to(np.zeros((), dt), tuple(spec.shape))
        buf = self.slots[self.program.storage.entry_slot[entry]]
        return buf[:spec.nbytes].view(dt).reshape(spec.shape)

    def write(self, entry: int, value: np.ndarray) -> None:
        np.copyto(self.views[entry], value)

    def read(self, entry: int) -> np.ndarray:
        return self.views[entry].copy()

    def execute(self, profile: bool = False) -> list[StepTiming] | None:
        timings: list[StepTiming] = []
        for i, s in enumerate(self.program.steps):
            t0 = time.perf_counter()
            if s.kind == KERNELS:
                try:
                    outs = run_function(self.functions[s.func], [self.views[e] for e in s.inputs])
                except OpFailure as exc:
                    raise ExecutorError(f"node {s.node} '{s.name}' (function '{s.func}'): {exc}") from None
                for e, v in zip(s.outputs, outs):
                    if v.shape != self.views[e].shape or v.dtype != self.views[e].dtype:
                        raise ExecutorError(f"node {s.node} '{s.name}' (function '{s.func}') produced "
                                            f"{v.dtype}{list(v.shape)} for {self.program.describe(e)}")
                    if not _same_memory(v, self.views[e]):  # an in-place op returns its output's own bytes
                        np.copyto(self.views[e], v)
            elif s.kind == COPY:
                np.copyto(self.views[s.outputs[0]], self.views[s.inputs[0]].reshape(self.views[s.outputs[0]].shape))
            elif i in self._nop_copy:  # an alias of a bound state entry: no longer the same memory
                np.copyto(self.views[s.outputs[0]], self.views[s.inputs[0]].reshape(self.views[s.outputs[0]].shape))
            # NOP: the output is a view of the input's slot already
            if profile:
                timings.append(StepTiming(i, time.perf_counter() - t0))
        return timings if profile else None

    def close(self) -> None:
        self.slots, self.views = [], {}
