"""Stage: one node range of a bundle on one backend. What a pipeline worker holds.

The stage is only "what runs and its buffers": it takes entries by id and returns entries by id.
Scheduling, queues and transport belong to the cluster layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from tvmpipe.bundle import Bundle, load_bundle
from tvmpipe.bundle.dtypes import np_dtype
from tvmpipe.executor.backend import StepTiming, make_backend
from tvmpipe.executor.checks import check_array, matches
from tvmpipe.executor.errors import InputError
from tvmpipe.executor.program import StageProgram, build_stage_program


def as_bundle(bundle: Bundle | str | Path) -> Bundle:
    return bundle if isinstance(bundle, Bundle) else load_bundle(bundle)


class Stage:
    """Graph nodes [start, end) of `bundle`, built on `backend` with backend options `opts`."""

    def __init__(self, bundle: Bundle | str | Path, start: int, end: int, backend: str = "reference", **opts: Any):
        self.bundle = as_bundle(bundle)
        self.program: StageProgram = build_stage_program(self.bundle, start, end)
        self.backend = make_backend(backend, self.bundle, self.program, **opts)
        self.backend_name = backend
        self._layout = feed_layout(self.program)

    def run(self, inputs: Mapping[int, np.ndarray], device: list[Any] | None = None) -> dict[int, np.ndarray]:
        """Run the stage on its fed entries (graph inputs by their null node's entry id, and entries
        received from earlier stages); return the entries it sends, by entry id. `device`: feeds of
        entries that come device to device (cluster/cudaipc.py, cuda backend only), not in `inputs`."""
        return self._run(inputs, profile=False, device=device)[0]

    def _placeholder(self, e: int) -> np.ndarray:
        """What check_feeds sees for an entry fed on the device: its shape and dtype, no memory."""
        spec = self.program.entry_specs[e]
        return np.broadcast_to(np.zeros((), np_dtype(spec.dtype)), tuple(spec.shape))

    def send_pointers(self) -> dict[int, int]:
        """Device pointers of the entries this stage sends (cuda backend), valid until its next run."""
        return {e: self.backend.ptr[e] for e in self.program.send_entries}

    def run_profiled(self, inputs: Mapping[int, np.ndarray]) -> tuple[dict[int, np.ndarray], list[StepTiming]]:
        """`run`, plus the backend's per-step timings (wall, CUDA-event or modelled)."""
        return self._run(inputs, profile=True)

    def _run(self, inputs: Mapping[int, np.ndarray], profile: bool,
             device: list[Any] | None = None) -> tuple[dict[int, np.ndarray], list[StepTiming]]:
        if device or getattr(self.backend, "device_fed", None):  # a run without feeds resets them
            self.backend.feed_device(device or [])
            if device:
                inputs = {**inputs, **{e: self._placeholder(e) for f in device for e in f.entries}}
        feeds = check_feeds(self.program, inputs, self._layout)
        for e, v in feeds.items():
            self.backend.write(e, v)
        timings = self.backend.execute(profile=profile) or []
        return {e: self.backend.read(e) for e in self.program.send_entries}, timings

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
    want = program.feed_entries
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
