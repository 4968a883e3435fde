"""The job's micro-batches: seeded random inputs, or arrays from an .npz file.

An .npz holds one array per graph input, keyed by input name, either of exactly the input's shape
(the same in every micro-batch) or with one extra leading axis (one row per micro-batch). Everything is checked
here, before any cluster resource is taken, so a wrong file fails in seconds, not after placement.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tvmpipe.bundle import Bundle
from tvmpipe.bundle.dtypes import np_dtype
from tvmpipe.executor import random_inputs
from tvmpipe.executor.errors import InputError

Batch = dict[str, np.ndarray]


def random_batches(bundle: Bundle, count: int, seed: int) -> list[Batch]:
    """Micro-batch i is `random_inputs(bundle, seed + i)`: any one of them can be regenerated alone."""
    if count < 1:
        raise InputError(f"the number of micro-batches must be >= 1, got {count}")
    return [random_inputs(bundle, seed + i) for i in range(count)]


def _specs(bundle: Bundle) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    g = bundle.graph
    out = {}
    for name in bundle.input_names:
        e = g.entries[g.entry_id(g.node_index[name])]
        out[name] = (tuple(e.shape), np_dtype(e.dtype))
    return out


def npz_batches(bundle: Bundle, path: str | Path, count: int | None = None) -> list[Batch]:
    """Split an .npz into micro-batches; `count` (if given) must match the rows it holds."""
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: cannot read inputs archive: {exc}") from None
    specs = _specs(bundle)
    expected = ", ".join(f"{n}: {dt}{list(s)}" for n, (s, dt) in specs.items()) or "none"
    unknown = sorted(set(arrays) - set(specs))
    missing = [n for n in specs if n not in arrays]
    if unknown or missing:
        raise InputError(f"{path}: unknown {unknown}, missing {missing}; the graph takes: {expected}")
    rows: dict[str, int | None] = {}
    for name, (shape, dt) in specs.items():
        a = arrays[name]
        if a.dtype != dt:
            raise InputError(f"{path}: '{name}' is {a.dtype}, the graph takes {dt}")
        if a.shape == shape:
            rows[name] = None  # one micro-batch
        elif a.ndim == len(shape) + 1 and a.shape[1:] == shape and a.shape[0] >= 1:
            rows[name] = a.shape[0]
        else:
            raise InputError(f"{path}: '{name}' has shape {list(a.shape)}; expected {list(shape)} "
                             f"or [N, {', '.join(map(str, shape))}] for N micro-batches")
    counts = {r for r in rows.values() if r is not None}
    if len(counts) > 1:
        raise InputError(f"{path}: inputs disagree on the number of micro-batches: {rows}")
    n = counts.pop() if counts else 1
    if count is not None and count != n:
        raise InputError(f"{path} holds {n} micro-batch(es) but --micro-batches is {count}")
    return [{name: np.ascontiguousarray(arrays[name] if rows[name] is None else arrays[name][i])
             for name in specs} for i in range(n)]
