"""Stage: one node range of a bundle on one backend. What a pipeline worker holds.

The stage is only "what runs and its buffers": it takes entries by id and returns entries by id.
Scheduling, queues and transport belong to the cluster layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from tvmpipe.bundle import Bundle, load_bundle
from tvmpipe.bundle.decode_layout import slot_layout
from tvmpipe.bundle.dtypes import np_dtype
from tvmpipe.bundle.state import row_resettable
from tvmpipe.core.units import format_bytes
from tvmpipe.executor.backend import StepTiming, make_backend
from tvmpipe.executor.checks import check_array, matches
from tvmpipe.executor.errors import InputError
from tvmpipe.executor.program import StageProgram, build_stage_program


def as_bundle(bundle: Bundle | str | Path) -> Bundle:
    return bundle if isinstance(bundle, Bundle) else load_bundle(bundle)


class Stage:
    """Graph nodes [start, end) of `bundle`, built on `backend` with backend options `opts`.

    With `state_slots` > 0 the stage keeps the declared state (bundle.json `state`) of its node
    range resident, one set per sequence slot (see `SlotState`): state inputs are then not fed and
    state outputs not sent, and every run names its slot in the synthetic entry `slot_entry`
    ([slot, fresh row 0, ...]: a 1 resets that row of the slot's state to the declared fill first,
    ones in every row the whole slot; SlotState.enter). With 0 (the default) a
    state pair is an ordinary input and output, as in a single-process loop that feeds its caches."""

    def __init__(self, bundle: Bundle | str | Path, start: int, end: int, backend: str = "reference",
                 state_slots: int = 0, **opts: Any):
        self.bundle = as_bundle(bundle)
        # state held by SlotState (static caches, a paged step's pools) gets no storage slot: one copy of it
        self.program: StageProgram = build_stage_program(self.bundle, start, end, resident_state=state_slots > 0)
        self.backend = make_backend(backend, self.bundle, self.program, **opts)
        self.backend_name = backend
        self.state = SlotState(self.bundle, self.program, self.backend, state_slots) if state_slots else None
        if self.state is not None and not self.state.pairs:
            self.state = None  # no state in this node range: a plain stage
        skip = self.state.inputs if self.state else set()
        self._layout = tuple(x for x in feed_layout(self.program) if x[0] not in skip)
        self._send = [e for e in self.program.send_entries if not self.state or e not in self.state.private]
        self.slot_entry = slot_layout(self.bundle).entry if self.state else None  # bundle.decode_layout

    def run(self, inputs: Mapping[int, np.ndarray], device: list[Any] | None = None) -> dict[int, np.ndarray]:
        """Run the stage on its fed entries (graph inputs by their null node's entry id, and entries
        received from earlier stages); return the entries it sends, by entry id. `device`: feeds of
        entries that come device to device (cluster/wire/cudaipc.py, cuda backend only), not in `inputs`."""
        return self._run(inputs, profile=False, device=device)[0]

    def compute(self, inputs: Mapping[int, np.ndarray]) -> None:
        """`run` without reading the sent entries back: each is copied out by `read` when asked for,
        until the next run (GraphRunner.get_output copies only the outputs a caller takes)."""
        self._run(inputs, profile=False, read=False)

    def read(self, entry: int) -> np.ndarray:
        """A copy of sent entry `entry` as the last run left it."""
        return self.backend.read(entry)

    def input_buffer(self, entry: int) -> np.ndarray | None:
        """The backend's own host buffer that fed entry `entry` is copied in from at every run (the
        cuda backend's page-locked one), or None. Filling it in place and passing it as the feed
        saves the copy: GraphRunner.set_input copies a user's input there once, as TVM's did into
        the device tensor, and run() copies nothing more."""
        own = getattr(self.backend, "input_buffer", None)
        return own(entry) if own is not None else None

    def _placeholder(self, e: int) -> np.ndarray:
        """What check_feeds sees for an entry fed on the device: its shape and dtype, no memory."""
        spec = self.program.entry_specs[e]
        return np.broadcast_to(np.zeros((), np_dtype(spec.dtype)), tuple(spec.shape))

    def send_pointers(self) -> dict[int, int]:
        """Device pointers of the entries this stage sends (cuda backend), valid until its next run."""
        return {e: self.backend.ptr[e] for e in self._send}

    def run_profiled(self, inputs: Mapping[int, np.ndarray]) -> tuple[dict[int, np.ndarray], list[StepTiming]]:
        """`run`, plus the backend's per-step timings (wall, CUDA-event or modelled)."""
        return self._run(inputs, profile=True)

    def _run(self, inputs: Mapping[int, np.ndarray], profile: bool, device: list[Any] | None = None,
             read: bool = True) -> tuple[dict[int, np.ndarray], list[StepTiming]]:
        if device or getattr(self.backend, "device_fed", None):  # a run without feeds resets them
            self.backend.feed_device(device or [])
            if device:
                inputs = {**inputs, **{e: self._placeholder(e) for f in device for e in f.entries}}
        slot = None
        if self.state is not None:
            inputs = dict(inputs)
            tag = inputs.pop(self.slot_entry, None)
            if tag is None or np.ndim(tag) != 1 or len(tag) < 2:
                raise InputError(f"stage [{self.program.start}, {self.program.end}) keeps state: every run needs "
                                 f"its [slot, fresh per row] in entry {self.slot_entry}")
            slot = self.state.enter(int(tag[0]), [int(f) != 0 for f in tag[1:]])
        feeds = check_feeds(self.program, inputs, self._layout)
        for e, v in feeds.items():
            self.backend.write(e, v)
        timings = self.backend.execute(profile=profile) or []
        out = {e: self.backend.read(e) for e in self._send} if read else {}
        if slot is not None:
            self.state.leave(slot)
        return out, timings

    def set_param(self, name: str, value: np.ndarray) -> None:
        """Overwrite one param this stage loaded (shape and dtype must match)."""
        e = self.program.param_entries.get(name)
        if e is None:
            raise InputError(f"'{name}' is not a param of nodes [{self.program.start}, {self.program.end}) "
                             f"(params: {', '.join(self.program.param_names) or 'none'})")
        self.backend.write(e, check_array(value, self.program.entry_specs[e], f"param '{name}'"))

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> "Stage":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def feed_layout(program: StageProgram) -> tuple[tuple[int, tuple[int, ...], np.dtype], ...]:
    """(entry, shape, dtype) of every fed entry, in feed order: what `check_feeds` compares against."""
    return tuple((e, tuple(program.entry_specs[e].shape), np_dtype(program.entry_specs[e].dtype))
                 for e in program.feed_entries)


def check_feeds(program: StageProgram, inputs: Mapping[int, Any],
                layout: tuple[tuple[int, tuple[int, ...], np.dtype], ...] | None = None) -> dict[int, np.ndarray]:
    """Every fed entry present, nothing else, each of the right shape and dtype; else InputError
    listing what the stage expects. Runs before anything touches the device. This is on every
    micro-batch's path, so pass the stage's `feed_layout`; messages are built only on failure."""
    layout = layout if layout is not None else feed_layout(program)
    if len(inputs) == len(layout):
        feeds = {}
        for e, shape, dt in layout:
            value = inputs.get(e)
            if not matches(value, shape, dt):
                break
            feeds[e] = value
        else:
            return feeds
    want = [e for e, _, _ in layout]
    unknown = [k for k in inputs if k not in want]
    if unknown:
        expected = "; ".join(program.describe(e) for e in want) or "no inputs"
        raise InputError(f"stage [{program.start}, {program.end}) does not take entr{'y' if len(unknown) == 1 else 'ies'} "
                         f"{', '.join(map(repr, unknown))}; it expects: {expected}")
    missing = [e for e in want if e not in inputs]
    if missing:
        raise InputError(f"stage [{program.start}, {program.end}) is missing "
                         f"{'; '.join(program.describe(e) for e in missing)}")
    return {e: check_array(inputs[e], program.entry_specs[e], program.label(e)) for e in want}


SLOT_HEADROOM = 64 << 20  # memory a new slot leaves free, so that its stage is not the one the OOM killer takes


class SlotState:
    """The state of one stage's node range, resident, one set per sequence slot.

    Per slot and state pair there are two buffers: the step reads the current one as the pair's
    input and writes the other as its output, then they swap, so the next step reads the new value
    without a copy. A pair whose update may be written over its current value (Bundle.state_buffers:
    a decode step's cache update) has one buffer, its input and its output both: half the memory,
    still no copy. Backends that can point an entry at a buffer (`bind_state`) never copy state:
    the reference backend's buffers are NumPy arrays; the cuda backend's are device allocations
    (`alloc_state`) that its kernels are pointed at (a launch plan per binding), so state stays on
    the GPU and never passes through the host. Others get the current buffer written in and the
    output read back (the simulated backend: nothing to hold).
    Slots are allocated when first used; `slots` bounds them. A "stage"-scoped pair (a paged KV
    pool, docs/paged-kv.md) has one set of buffers for the stage, used by every slot and never reset
    by a fresh slot or row: its rows reach their own pages through the page table each step carries."""

    def __init__(self, bundle: Bundle, program: StageProgram, backend: Any, slots: int):
        g = bundle.graph
        self.program, self.backend, self.max_slots = program, backend, slots
        inputs = program.input_entries
        self.pairs = []  # (pair, input entry, output entry)
        for p in bundle.state:
            e_in = inputs.get(p.input)
            e_out = g.head_entries[p.output]
            made_here = e_out in program.entry_specs and g.entries[e_out].node in range(program.start, program.end)
            if e_in is None and not made_here:
                continue
            if e_in is None or not made_here:
                raise InputError(f"stage [{program.start}, {program.end}) splits state pair '{p.name}': "
                                 f"it {'reads' if e_in is not None else 'produces'} only one side of it")
            self.pairs.append((p, e_in, e_out))
        self.inputs = {e for _, e, _ in self.pairs}
        buffers = bundle.state_buffers
        self.copies = [buffers[p.name] for p, _, _ in self.pairs]  # buffers per slot: 1 (in place) or 2
        held = bundle.state_held_bytes
        # "stage"-scoped pairs (a paged KV pool) are one value for the stage, whichever slot runs
        self.shared_pairs = [i for i, (p, _, _) in enumerate(self.pairs) if p.scope == "stage"]
        self.slot_bytes = sum(held[p.name] for p, _, _ in self.pairs if p.scope != "stage")  # one slot's state
        self.stage_bytes = sum(held[p.name] for p, _, _ in self.pairs if p.scope == "stage")  # held once
        self.shared: dict[int, list[Any]] | None = None  # pair index -> its buffers, made at the first enter
        # state outputs nobody after this stage reads: they stay here
        self.private = {o for _, _, o in self.pairs if not any(c >= program.end for c in g.consumers[o])}
        self.hollow = getattr(backend, "name", "") == "simulated"  # computes nothing: no state to hold
        self.bind = getattr(backend, "bind_state", None)
        self.alloc = getattr(backend, "alloc_state", None)
        self.check_fits()
        self.buffers: dict[int, list[list[Any]]] = {}  # slot -> per pair [current, next]
        if self.alloc is not None and hasattr(backend, "resident"):
            backend.resident(self.inputs | self.private)

    def _free(self) -> int | None:
        """Memory the backend has free now (host or device), None where it cannot say."""
        free = getattr(self.backend, "free_memory", None)
        return free() if free is not None and not self.hollow else None

    def check_fits(self) -> None:
        """Refuse, in one line and before any slot is allocated, more slots than the memory the
        backend has free could hold (host memory for the reference backend, the device's for cuda):
        slots are allocated as sequences first use them, and running out then would be an OOM in
        the middle of a run. Each stage checks its own; stages sharing a host or device each see
        all of what is free."""
        have = self._free()
        need = self.max_slots * self.slot_bytes + self.stage_bytes
        if have is None or need <= have:
            return
        where = f"{format_bytes(have)} of {'device' if self.alloc is not None else 'host'} memory free"
        if not self.slot_bytes:  # only a paged step's pools, one per layer, sized by the run (executor/kvpool.py)
            raise InputError(f"stage [{self.program.start}, {self.program.end}): its KV page pools take "
                             f"{format_bytes(self.stage_bytes)}, more than the {where}; give a smaller pool "
                             "(--kv-tokens) or use more stages")
        raise InputError(f"stage [{self.program.start}, {self.program.end}): {self.max_slots} state slot(s) x "
                         f"{format_bytes(self.slot_bytes)} of caches = {format_bytes(need)}, more than the {where}; "
                         + (f"use at most {have // self.slot_bytes} slots (--slots)" if have >= self.slot_bytes
                            else "not one slot fits: use more stages or a shorter context"))

    @property
    def resident_bytes(self) -> int:
        """The state this stage holds now: per slot used so far, each pair's buffers (one where it
        is updated in place, else two); slots are allocated when first used, and the simulated
        backend holds none."""
        if self.hollow:
            return 0
        return len(self.buffers) * self.slot_bytes + (self.stage_bytes if self.shared is not None else 0)

    def _new(self, e: int, fill: float) -> Any:
        if self.hollow:
            return None
        spec = self.program.entry_specs[e]
        if self.alloc is not None:
            return self.alloc(e, fill)
        return np.full(spec.shape, fill, dtype=np_dtype(spec.dtype))

    def _fill(self, buf: Any, fill: float, rows: list[int] | None = None, of: int = 1) -> None:
        """Set `buf` to `fill`: all of it, or only `rows` of its `of` (along its leading axis)."""
        if isinstance(buf, np.ndarray):
            if rows is None:
                buf.fill(fill)
            else:
                buf[rows] = fill
        elif buf is not None:
            self.backend.fill_state(buf, fill, rows, of)

    def _check_rows(self, rows: int) -> None:
        """A row of every pair can be reset alone: its leading axis is the step's `rows`."""
        for p, e, _ in self.pairs:
            if p.scope == "stage":  # never reset by a slot's rows
                continue
            shape = tuple(self.program.entry_specs[e].shape)
            if not row_resettable(shape, rows):
                raise InputError(f"stage [{self.program.start}, {self.program.end}): state pair '{p.name}' "
                                 f"{list(shape)} has no leading axis of the {rows} rows the step resets one "
                                 "of; reset the whole slot (every row fresh)")

    def enter(self, slot: int, fresh: bool | list[bool]) -> int:
        """Make `slot`'s state the stage's input. `fresh`: reset it to the fill first, as a whole
        (True, or True in every row), or only the rows marked (one per row of a static batch: a
        sequence that takes a row of a group still running, docs/generation.md)."""
        if not 0 <= slot < self.max_slots:
            raise InputError(f"slot {slot} is outside this stage's {self.max_slots} state slot(s)")
        rows, of = None, 1
        if not isinstance(fresh, bool):
            of = len(fresh)
            marked = [i for i, f in enumerate(fresh) if f]
            if marked and len(marked) < len(fresh):
                self._check_rows(of)
                rows = marked
            fresh = bool(marked)
        bufs = self.buffers.get(slot)
        if bufs is None:
            have = self._free()  # stages sharing the memory may have taken what check_fits saw free
            pools = self.stage_bytes if self.shared is None else 0  # a paged step's pools come with the first slot
            if have is not None and have < self.slot_bytes + pools + SLOT_HEADROOM:
                raise InputError(f"stage [{self.program.start}, {self.program.end}): no memory for slot {slot}'s "
                                 f"caches ({format_bytes(self.slot_bytes + pools)}, {format_bytes(have)} free, "
                                 f"{format_bytes(SLOT_HEADROOM)} kept spare); use "
                                 + ("a smaller pool (--kv-tokens)" if pools else "fewer --slots") + " or more memory")
            if self.shared is None:  # the stage-scoped pairs' buffers, one list each, shared by every slot
                self.shared = {i: [self._new(self.pairs[i][1], self.pairs[i][0].fill) for _ in range(self.copies[i])]
                               for i in self.shared_pairs}
            bufs = self.buffers[slot] = [self.shared[i] if i in self.shared else [self._new(e, p.fill) for _ in range(n)]
                                         for i, ((p, e, _), n) in enumerate(zip(self.pairs, self.copies))]
        elif fresh:
            for (p, _, _), pair in zip(self.pairs, bufs):
                if p.scope != "stage":  # a pool is the stage's: rows reach their own pages by the page table
                    self._fill(pair[0], p.fill, rows, of)
        if self.hollow:
            return slot
        for (_, e_in, e_out), pair in zip(self.pairs, bufs):
            if self.bind is not None:
                self.bind(e_in, pair[0])
                self.bind(e_out, pair[-1])  # the same buffer for a pair updated in place
            else:
                self.backend.write(e_in, pair[0])
        return slot

    def leave(self, slot: int) -> None:
        """The step ran: its outputs become the slot's current state (a swap, or a read back)."""
        if self.hollow:
            return
        for (_, _, e_out), pair in zip(self.pairs, self.buffers[slot]):
            if self.bind is None:
                np.copyto(pair[-1], self.backend.read(e_out))
            pair.reverse()  # a swap; nothing for a pair updated in place (a shared pair's list: every slot's)
