"""Graph inputs: seeded random arrays of the right shapes, and the name -> entry id mapping.

`random_inputs` is what `tvmpipe profile` and the cluster's `tvmpipe run` feed when the user gives
no inputs, so both see the same arrays for the same seed.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Mapping

import numpy as np

from tvmpipe.bundle import Bundle
from tvmpipe.bundle.dtypes import np_dtype
from tvmpipe.executor.errors import InputError


def random_inputs(bundle: Bundle, seed: int = 0, int_high: int = 2) -> dict[str, np.ndarray]:
    """One array per graph input, keyed by name: standard normal floats, integers in [0, int_high)
    (valid token ids / masks for any vocabulary), random booleans. Each input's stream depends only
    on (seed, name), so adding an input never changes the others."""
    g = bundle.graph
    out = {}
    for name in bundle.input_names:
        e = g.entry_of(name)
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        dt = np_dtype(e.dtype)
        if dt.kind == "f":
            out[name] = rng.standard_normal(e.shape).astype(dt)
        elif dt.kind == "b":
            out[name] = rng.integers(0, 2, e.shape).astype(dt)
        else:
            out[name] = rng.integers(0, int_high, e.shape).astype(dt)
    return out


def input_entry_ids(bundle: Bundle) -> dict[str, int]:
    """Graph input name -> entry id of its null node (how `Stage.run` takes graph inputs)."""
    g = bundle.graph
    return {name: g.entry_id(g.node_index[name]) for name in bundle.input_names}


def feeds_by_entry(bundle: Bundle, named: Mapping[str, np.ndarray]) -> dict[int, np.ndarray]:
    ids = input_entry_ids(bundle)
    unknown = [n for n in named if n not in ids]
    if unknown:
        raise InputError(f"unknown graph input(s) {', '.join(map(repr, unknown))}; inputs are {', '.join(ids) or 'none'}")
    return {ids[n]: v for n, v in named.items()}


def load_inputs_npz(path: str | Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: cannot read inputs archive: {exc}") from None


Batch = dict[str, np.ndarray]


def random_micro_batches(bundle: Bundle, count: int, seed: int) -> list[Batch]:
    """Micro-batch i is `random_inputs(bundle, seed + i)`: any one of them can be regenerated alone."""
    if count < 1:
        raise InputError(f"the number of micro-batches must be >= 1, got {count}")
    return [random_inputs(bundle, seed + i) for i in range(count)]


def npz_micro_batches(bundle: Bundle, path: str | Path, count: int | None = None, cycle: bool = False) -> list[Batch]:
    """Split an .npz into micro-batches, checked before any worker or cluster resource is taken.

    The archive holds one array per graph input, keyed by name, either of exactly the input's shape
    (the same in every micro-batch) or with one extra leading axis (one row per micro-batch). With
    `count`, the file must hold that many rows, or with `cycle` its rows are repeated up to `count`.
    """
    arrays = load_inputs_npz(path)
    g = bundle.graph
    specs = {}
    for name in bundle.input_names:
        e = g.entry_of(name)
        specs[name] = (tuple(e.shape), np_dtype(e.dtype))
    unknown = sorted(set(arrays) - set(specs))
    missing = [n for n in specs if n not in arrays]
    if unknown or missing:
        expected = ", ".join(f"{n}: {dt}{list(s)}" for n, (s, dt) in specs.items()) or "none"
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
            raise InputError(f"{path}: '{name}' has shape {list(a.shape)}, expected {list(shape)} "
                             f"or [N, {', '.join(map(str, shape))}] for N micro-batches")
    counts = {r for r in rows.values() if r is not None}
    if len(counts) > 1:
        raise InputError(f"{path}: inputs disagree on the number of micro-batches: {rows}")
    n = counts.pop() if counts else 1
    if count is not None and count < 1:
        raise InputError(f"the number of micro-batches must be >= 1, got {count}")
    if count is not None and count != n and not cycle:
        raise InputError(f"{path} holds {n} micro-batch(es) but --micro-batches is {count}")
    return [{name: np.ascontiguousarray(arrays[name] if rows[name] is None else arrays[name][i % n])
             for name in specs} for i in range(count if count is not None else n)]
