"""Byte counts for people: one formatter, so inspect, partition and run tables agree on units."""

from __future__ import annotations


def format_bytes(n: float, decimals: int = 1) -> str:
    """Binary units (KiB = 1024 B), as memory sizes and caps are usually given."""
    value, unit = float(n), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{int(n)} B" if unit == "B" else f"{value:.{decimals}f} {unit}"
