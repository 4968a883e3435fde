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
        e = g.entries[g.entry_id(g.node_index[name])]
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
