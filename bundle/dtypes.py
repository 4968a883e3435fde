"""dtype names as TVM writes them, mapped to NumPy; the whitelist every layer checks against."""

from __future__ import annotations

import numpy as np

# TVM dltype strings we can hold in NumPy. bfloat16 comes from ml_dtypes (what JAX and TVM use):
# published LLM checkpoints are bf16, and a bf16 bundle must be stored and shipped at 2 bytes a
# value. NumPy holds it; the reference backend says how it computes with it (executor/reference_ops.py).
DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in (
        "float16", "float32", "float64",
        "int8", "int16", "int32", "int64",
        "uint8", "uint16", "uint32", "uint64",
        "bool",
    )
}
try:
    import ml_dtypes as _ml_dtypes

    DTYPES["bfloat16"] = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a runtime dependency
    pass

# NNVM-era `dtype` attribute codes (mshadow TypeFlag), written beside `dltype` in 2018-19 graphs.
NNVM_TYPE_CODES: dict[int, str] = {
    0: "float32", 1: "float64", 2: "float16", 3: "uint8", 4: "int32",
    5: "int8", 6: "int64", 7: "int16", 8: "uint16", 9: "uint32", 10: "uint64",
}


def np_dtype(name: str) -> np.dtype:
    """NumPy dtype for a TVM dltype; KeyError for anything outside the whitelist."""
    if name == "uint1" or name == "bool":
        return DTYPES["bool"]
    return DTYPES[name]


def is_float(name: str) -> bool:
    """Whether dtype `name` holds real numbers: float16/32/64 and bfloat16 (whose NumPy dtype, from
    ml_dtypes, has kind 'V', not 'f': ask this, not `np_dtype(name).kind`)."""
    return name.startswith(("float", "bfloat"))


def is_known(name: object) -> bool:
    return isinstance(name, str) and (name in DTYPES or name == "uint1")


def itemsize(name: str) -> int:
    return np_dtype(name).itemsize
