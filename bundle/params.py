"""Parameters: .npz archives, TVM's binary param dicts, and deterministic generated weights.

relay.build users hold `.params` files written by `relay.save_param_dict`; TVM is gone from their
stack, so this reads that binary format natively and checks every length against the file size
before allocating anything.
"""

from __future__ import annotations

import io
import math
import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np

from tvmpipe.bundle import dtypes
from tvmpipe.bundle.errors import BundleError, Problem
from tvmpipe.bundle.graph import Graph

PARAM_LIST_MAGIC = 0xF7E58D4F05049CB7
NDARRAY_MAGIC = 0xDD5E40F096B4A13F
# DLPack type codes
_DL_INT, _DL_UINT, _DL_FLOAT = 0, 1, 2


def _fail(file: str, where: str, msg: str) -> BundleError:
    return BundleError([Problem(file, where, "", msg)])


def load_npz(path: str | Path) -> dict[str, np.ndarray]:
    path = Path(path)
    try:
        z = np.load(path, allow_pickle=False)
        if not isinstance(z, np.lib.npyio.NpzFile):  # a bare .npy array loads as an ndarray
            raise ValueError("a single .npy array, not an archive of named arrays")
        with z:
            out = {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise _fail(str(path), "", "file not found") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error, NotImplementedError, MemoryError) as exc:
        # NotImplementedError: zipfile's answer to an unknown compression method in a damaged header;
        # MemoryError: numpy allocates what an .npy header claims before it reads the data
        raise _fail(str(path), "", f"not a readable .npz archive: {exc}") from None
    bad = [k for k, v in out.items() if not isinstance(v, np.ndarray)]  # np.load returns raw bytes for non-.npy members
    if bad:
        raise _fail(str(path), f"member '{bad[0]}'", "is not a .npy array")
    return out


def save_npz(path: str | Path, params: dict[str, np.ndarray]) -> None:
    with open(path, "wb") as f:
        np.savez(f, **params)


def _dl_to_numpy(code: int, bits: int, lanes: int) -> str | None:
    if lanes != 1:
        return None
    name = {(_DL_FLOAT, 16): "float16", (_DL_FLOAT, 32): "float32", (_DL_FLOAT, 64): "float64",
            (_DL_INT, 8): "int8", (_DL_INT, 16): "int16", (_DL_INT, 32): "int32", (_DL_INT, 64): "int64",
            (_DL_UINT, 8): "uint8", (_DL_UINT, 16): "uint16", (_DL_UINT, 32): "uint32", (_DL_UINT, 64): "uint64",
            (_DL_UINT, 1): "bool"}.get((code, bits))
    return name


def _numpy_to_dl(dt: np.dtype) -> tuple[int, int, int]:
    if dt == np.bool_:
        return _DL_UINT, 1, 1
    code = {"f": _DL_FLOAT, "i": _DL_INT, "u": _DL_UINT}[dt.kind]
    return code, dt.itemsize * 8, 1


def load_tvm_params(data: bytes, file: str = "params") -> dict[str, np.ndarray]:
    """Parse TVM's SaveParams binary format (see docs/bundle-format.md)."""
    buf = memoryview(data)
    pos = 0

    def take(n: int, what: str) -> memoryview:
        nonlocal pos
        if n < 0 or pos + n > len(buf):
            raise _fail(file, f"byte {pos}", f"truncated: {what} needs {n} bytes, {len(buf) - pos} left")
        out = buf[pos:pos + n]
        pos += n
        return out

    def u64(what: str) -> int:
        return struct.unpack("<Q", take(8, what))[0]

    if u64("header magic") != PARAM_LIST_MAGIC:
        raise _fail(file, "", "not a TVM param dict (bad magic number)")
    u64("reserved")
    n_names = u64("name count")
    if n_names > len(buf) // 8:
        raise _fail(file, "", f"claims {n_names} names, more than the file could hold")
    names = []
    for i in range(n_names):
        ln = u64(f"name {i} length")
        try:
            names.append(bytes(take(ln, f"name {i}")).decode("utf-8"))
        except UnicodeDecodeError:
            raise _fail(file, f"name {i}", "not valid UTF-8") from None
    n_arrays = u64("array count")
    if n_arrays != n_names:
        raise _fail(file, "", f"has {n_names} names but {n_arrays} arrays")
    out: dict[str, np.ndarray] = {}
    for name in names:
        if u64(f"array '{name}' magic") != NDARRAY_MAGIC:
            raise _fail(file, f"array '{name}'", "bad NDArray magic number")
        u64("reserved")
        take(8, "device")
        (ndim,) = struct.unpack("<i", take(4, "ndim"))
        code, bits, lanes = struct.unpack("<BBH", take(4, "dtype"))
        dt = _dl_to_numpy(code, bits, lanes)
        if dt is None:
            raise _fail(file, f"array '{name}'", f"unsupported dtype (code {code}, bits {bits}, lanes {lanes})")
        if not 0 <= ndim <= 32:
            raise _fail(file, f"array '{name}'", f"implausible ndim {ndim}")
        shape = struct.unpack(f"<{ndim}q", take(8 * ndim, "shape"))
        if any(d < 0 for d in shape):
            raise _fail(file, f"array '{name}'", f"negative dimension in shape {shape}")
        (nbytes,) = struct.unpack("<q", take(8, "data size"))
        item = 1 if dt == "bool" else np.dtype(dt).itemsize
        if nbytes != math.prod(shape) * item:
            raise _fail(file, f"array '{name}'", f"data size {nbytes} does not match shape {shape} x {dt}")
        raw = take(nbytes, f"array '{name}' data")
        out[name] = np.frombuffer(raw, dtype=np.dtype(dt)).reshape(shape).copy()
    if pos != len(buf):
        raise _fail(file, "", f"{len(buf) - pos} trailing bytes after the last array")
    return out


def save_tvm_params(params: dict[str, np.ndarray]) -> bytes:
    """Write the same binary format TVM's save_param_dict wrote (for tests and interop)."""
    f = io.BytesIO()
    f.write(struct.pack("<QQQ", PARAM_LIST_MAGIC, 0, len(params)))
    for name in params:
        b = name.encode("utf-8")
        f.write(struct.pack("<Q", len(b)) + b)
    f.write(struct.pack("<Q", len(params)))
    for arr in params.values():
        arr = np.require(arr, requirements="C")  # not ascontiguousarray: it turns a 0-d array into 1-d
        code, bits, lanes = _numpy_to_dl(arr.dtype)
        f.write(struct.pack("<QQiii", NDARRAY_MAGIC, 0, 1, 0, arr.ndim))
        f.write(struct.pack("<BBH", code, bits, lanes))
        f.write(struct.pack(f"<{arr.ndim}q", *arr.shape))
        f.write(struct.pack("<q", arr.nbytes) + arr.tobytes())
    return f.getvalue()


def load_params_file(path: str | Path) -> dict[str, np.ndarray]:
    path = Path(path)
    if path.suffix == ".npz":
        return load_npz(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise _fail(str(path), "", "file not found") from None
    return load_tvm_params(data, str(path))


def generate_params(graph: Graph, names: list[str], seed: int) -> dict[str, np.ndarray]:
    """Deterministic weights for bundles shipped without them.

    Each tensor's stream depends only on (seed, name), so adding a param never changes the others;
    the scale keeps activations O(1) through deep stacks, which keeps float32 comparisons meaningful.
    """
    out = {}
    for name in names:
        e = graph.entry_of(name)
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        dt = dtypes.np_dtype(e.dtype)
        if dtypes.is_float(e.dtype):
            shape = e.shape
            fan = max(shape[0], math.prod(shape[1:])) if len(shape) >= 2 else 0
            scale = 1.0 / math.sqrt(fan) if fan else 0.1
            out[name] = (rng.standard_normal(shape) * scale).astype(dt)
        else:
            out[name] = np.zeros(e.shape, dtype=dt)
    return out


def check_params(graph: Graph, params: dict[str, np.ndarray], names: list[str], file: str) -> list[Problem]:
    """Every expected param present, nothing extra, and each matching its null node's shape/dtype."""
    return check_param_specs(graph, {n: (str(a.dtype), tuple(a.shape)) for n, a in params.items()}, names, file)


def check_param_specs(graph: Graph, specs: dict[str, tuple[str, tuple[int, ...]]], names: list[str],
                      file: str) -> list[Problem]:
    """check_params on (dtype, shape) alone: a weights file's header is checked without its data."""
    problems = []
    for name in names:
        if name not in specs:
            problems.append(Problem(file, f"param '{name}'", "", "missing (graph.json has a null node for it)"))
            continue
        nid = graph.node_index[name]
        e = graph.entry_of(nid)
        dt, shape = specs[name]
        if tuple(shape) != e.shape or dtypes.np_dtype(dt) != dtypes.np_dtype(e.dtype):
            problems.append(Problem(file, f"param '{name}'", "",
                                    f"is {dt}{list(shape)} but node {nid} expects {e.dtype}{list(e.shape)}"))
    params = specs
    for name in params:
        if name not in names:
            problems.append(Problem(file, f"param '{name}'", "", "is not a param null node of graph.json"))
    return problems
