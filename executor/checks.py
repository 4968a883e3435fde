"""The one check of arrays against what a graph or a stage takes.

Every door into a computation checks its arrays here before anything runs: `GraphRunner.set_input`,
`Stage.run` (`stage.check_feeds`), `Pipeline.check_inputs` and the inputs .npz of `tvmpipe run`.
The data plane's frame check (cluster.worker.Inbound) calls `matches` and `describe_value` and
raises its own FrameError. `matches` is the hot-path test: messages are built only on failure.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy as np

from tvmpipe.bundle.dtypes import np_dtype
from tvmpipe.executor.errors import InputError
from tvmpipe.executor.program import EntrySpec


def matches(value: Any, shape: tuple[int, ...], dtype: np.dtype) -> bool:
    """A numpy array of exactly this shape and dtype."""
    return isinstance(value, np.ndarray) and value.dtype == dtype and value.shape == shape


def describe_value(value: Any) -> str:
    """"float32[1, 4]" for an array, else its type's name."""
    return f"{value.dtype}{list(value.shape)}" if isinstance(value, np.ndarray) else type(value).__name__


def check_array(value: Any, spec: EntrySpec, what: str) -> np.ndarray:
    """`value` if it is a numpy array of exactly `spec`; else InputError starting with `what`."""
    if matches(value, tuple(spec.shape), np_dtype(spec.dtype)):
        return value
    kind = "" if isinstance(value, np.ndarray) else "a numpy array "
    raise InputError(f"{what}: expected {kind}{spec}, got {describe_value(value)}")


def expected_inputs(specs: Mapping[str, EntrySpec]) -> str:
    """"x: float32[1, 4], mask: bool[1, 4]": what a graph takes, for messages."""
    return ", ".join(f"{n}: {s}" for n, s in specs.items()) or "none"


def check_names(given: Iterable[str], specs: Mapping[str, EntrySpec], *, complete: bool = True,
                where: str = "") -> None:
    """Every name is a graph input and, if `complete`, every graph input is named; else one
    InputError listing the unknown and missing names and what the graph takes."""
    given = list(given)
    unknown = [k for k in given if k not in specs]
    missing = [k for k in specs if k not in given] if complete else []
    if not unknown and not missing:
        return
    parts = [f"{what} input{'s' if len(names) > 1 else ''} {', '.join(map(repr, names))}"
             for what, names in (("unknown", unknown), ("missing", missing)) if names]
    raise InputError(f"{where}{'; '.join(parts)}; the graph's inputs are: {expected_inputs(specs)}")


def check_inputs(inputs: Any, specs: Mapping[str, EntrySpec]) -> dict[str, np.ndarray]:
    """One micro-batch: a mapping of every graph input by name, each exactly of its spec."""
    if not isinstance(inputs, Mapping):
        raise InputError(f"a micro-batch is a dict of graph inputs by name ({expected_inputs(specs)}), "
                         f"got {type(inputs).__name__}")
    check_names(inputs, specs)
    return {name: check_array(inputs[name], spec, f"input '{name}'") for name, spec in specs.items()}
