"""Device and link figures the analytic cost model needs, and parsers for the CLI's unit strings.

Peaks are vendor datasheet numbers; `efficiency` scales them to what untuned TVM kernels reach,
so analytic estimates land near measured ones rather than at the roofline. These are estimates
for ranking plans; a measured profile (`--profile`) replaces them where accuracy matters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial

import numpy as np

from tvmpipe.core.units import format_bytes as _format_bytes
from tvmpipe.partition.errors import PartitionError

# Partition tables show two decimals: memory caps are compared against these numbers.
format_bytes = partial(_format_bytes, decimals=2)


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    fp32_flops: float  # peak FLOP/s without tensor cores
    fp16_flops: float  # peak FLOP/s for float16 matmul/conv (tensor cores where present)
    mem_bandwidth: float  # device memory bytes/s
    memory: int  # device memory bytes (default per-device memory cap)
    launch_us: float = 4.0  # per kernel launch overhead
    compute_efficiency: float = 0.35
    bandwidth_efficiency: float = 0.7

    def peak_flops(self, dtype: str) -> float:
        return self.fp16_flops if dtype in ("float16", "bfloat16") else self.fp32_flops


GB = 1e9
GiB = 1 << 30
DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec("h100", 67e12, 989e12, 3.35e12, 80 * GiB),
    "h200": DeviceSpec("h200", 67e12, 989e12, 4.8e12, 141 * GiB),
    "a100": DeviceSpec("a100", 19.5e12, 312e12, 2.0e12, 80 * GiB),
    "l4": DeviceSpec("l4", 30.3e12, 121e12, 300e9, 24 * GiB),
    "t4": DeviceSpec("t4", 8.1e12, 65e12, 320e9, 16 * GiB),
    "cpu": DeviceSpec("cpu", 1e12, 1e12, 100e9, 64 * GiB, launch_us=1.0, compute_efficiency=0.2,
                      bandwidth_efficiency=0.5),
}


def get_device(name: str) -> DeviceSpec:
    try:
        return DEVICES[name.lower()]
    except KeyError:
        raise PartitionError(f"unknown device {name!r} (known: {', '.join(DEVICES)})") from None


@dataclass(frozen=True)
class Link:
    """The path a frame takes between stages (and from the driver): bytes/s plus a fixed cost per frame."""

    bandwidth: float = 25 * GB
    latency_us: float = 0.0

    def transfer_us(self, nbytes: np.ndarray | float) -> np.ndarray | float:
        """Time of a frame of `nbytes` (0 when nothing is sent); vectorised over a table of byte counts."""
        b = np.asarray(nbytes, dtype=np.float64)
        t = np.where(b > 0, self.latency_us + b / self.bandwidth * 1e6, 0.0)
        return t if t.ndim else float(t)


_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_NUM = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """'8GiB', '8GB', '512MiB', '1e9' -> bytes (GB = 1e9, GiB = 2**30)."""
    m = _NUM.match(str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise PartitionError(f"cannot read {text!r} as a size: use e.g. 8GiB, 16GB, 512MiB or a byte count")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_bandwidth(text: str) -> float:
    """'25GB/s', '100Gbit/s', '12.5e9' -> bytes/s."""
    s = str(text).strip()
    bits = re.search(r"(bit|bps)(/s)?$", s, re.IGNORECASE)
    if bits:
        s = s[: bits.start()] + "b"
    elif s.lower().endswith("/s"):
        s = s[:-2]
    value = parse_bytes(s) if not bits else parse_bytes(s) / 8
    if value <= 0:
        raise PartitionError(f"bandwidth must be positive, got {text!r}")
    return float(value)


def parse_duration_us(text: str) -> float:
    """'20us', '0.5ms', '1e-5s', '20' (microseconds) -> microseconds."""
    m = re.match(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(us|ms|s|ns)?\s*$", str(text))
    if not m:
        raise PartitionError(f"cannot read {text!r} as a duration: use e.g. 20us, 0.5ms")
    scale = {"ns": 1e-3, "us": 1.0, None: 1.0, "ms": 1e3, "s": 1e6}[m.group(2)]
    return float(m.group(1)) * scale
