"""Graph inputs: their specs by name, seeded random arrays of the right shapes, and .npz files.

`random_array` is the one generator of made-up inputs: `random_inputs` (what `tvmpipe profile`,
`tvmpipe run` and `tvmpipe sweep` feed when the user gives no inputs, so all see the same arrays
for the same seed) and `random_feed` (what a stage worker warms up on) both draw from it.
"""

from __future__ import annotations

import zipfile
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import numpy as np

from tvmpipe.bundle import Bundle
from tvmpipe.bundle.dtypes import is_float, np_dtype
from tvmpipe.executor.checks import check_names
from tvmpipe.executor.errors import InputError
from tvmpipe.executor.program import EntrySpec

if TYPE_CHECKING:
    from tvmpipe.executor.program import StageProgram


def input_specs(bundle: Bundle) -> dict[str, EntrySpec]:
    """Graph input name -> shape and dtype, in the graph's input order."""
    g = bundle.graph
    out = {}
    for name in bundle.input_names:
        e = g.entry_of(name)
        out[name] = EntrySpec(tuple(e.shape), e.dtype)
    return out


def random_array(spec: EntrySpec, seed: int, key: str, int_high: int = 2) -> np.ndarray:
    """Standard normal floats, integers in [0, int_high) (valid token ids / masks for any
    vocabulary; 1 gives zeros, valid indices into anything), random booleans. The stream depends
    only on (seed, key), so adding an input never changes the others."""
    rng = np.random.default_rng([seed, zlib.crc32(key.encode())])
    dt = np_dtype(spec.dtype)
    if is_float(spec.dtype):
        return rng.standard_normal(spec.shape).astype(dt)
    if dt.kind == "b":
        return rng.integers(0, 2, spec.shape).astype(dt)
    return rng.integers(0, int_high, spec.shape).astype(dt)


def random_inputs(bundle: Bundle, seed: int = 0, int_high: int = 2) -> dict[str, np.ndarray]:
    """One array per graph input, keyed by name (see `random_array`)."""
    return {name: random_array(spec, seed, name, int_high) for name, spec in input_specs(bundle).items()}


def random_feed(program: StageProgram, seed: int) -> dict[int, np.ndarray]:
    """Seeded arrays for every entry a stage is fed, keyed by entry id: a warm-up micro-batch.
    Integers are zeros: a received entry may index anything, and zero is always in range."""
    return {e: random_array(program.entry_specs[e], seed, program.entry_names[e], int_high=1)
            for e in program.feed_entries}


def input_entry_ids(bundle: Bundle) -> dict[str, int]:
    """Graph input name -> entry id of its null node (how `Stage.run` takes graph inputs)."""
    g = bundle.graph
    return {name: g.entry_id(g.node_index[name]) for name in bundle.input_names}


def feeds_by_entry(bundle: Bundle, named: Mapping[str, np.ndarray]) -> dict[int, np.ndarray]:
    """Graph inputs by name -> by the entry id of their null node (how `Stage.run` takes them)."""
    check_names(named, input_specs(bundle), complete=False)
    ids = input_entry_ids(bundle)
    return {ids[n]: v for n, v in named.items()}


def load_inputs_npz(path: str | Path) -> dict[str, np.ndarray]:
    """Every array of an .npz file; a missing, truncated, corrupt or pickle-holding file is one
    InputError naming it (never a traceback, never advice to load pickles)."""
    try:
        z = np.load(path, allow_pickle=False)
        if not isinstance(z, np.lib.npyio.NpzFile):
            raise InputError(f"{path}: a single .npy array, not an .npz archive of inputs by name (np.savez)")
        with z:
            return {k: z[k] for k in z.files}
    except InputError:
        raise
    except OSError as exc:
        raise InputError(f"{path}: cannot read inputs archive: {exc.strerror or exc}") from None
    except ValueError as exc:
        if "allow_pickle" in str(exc):  # numpy's text advises allow_pickle=True: loading it could run code
            raise InputError(f"{path}: not an .npz archive of arrays (object arrays or random bytes); "
                             "inputs must be numeric arrays saved with np.savez") from None
        raise InputError(f"{path}: not a readable .npz archive: {exc}") from None
    except (zipfile.BadZipFile, EOFError, KeyError, zlib.error) as exc:
        raise InputError(f"{path}: not a readable .npz archive (truncated or corrupt: {exc})") from None


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
    check_names(arrays, input_specs(bundle), where=f"{path}: ")
    specs = {name: (tuple(spec.shape), np_dtype(spec.dtype)) for name, spec in input_specs(bundle).items()}
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
