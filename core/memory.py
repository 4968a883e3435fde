"""Fresh host memory for large buffers that are about to be filled whole.

NumPy's allocations of a few MiB and more come fresh from the kernel and are faulted in one page at
a time when first written; NumPy also asks for transparent huge pages on them, which with the
usual THP setting (defrag=madvise) can stall in memory compaction. A stage that reads gigabytes of
weights straight into its slots (pread) pays that on every page: measured on the 2-core dev VM,
reading 1.5 GiB into np.zeros buffers ran at 0.4-1.8 GB/s from the page cache, against 2.7 GB/s
into anonymous mappings populated in one call (MAP_POPULATE), consistently. The same holds for
received frames whose arrays are kept (cluster/stream.py): ~5 ms per fresh 4 MB array against
~1 ms (docs/cluster.md)."""

from __future__ import annotations

import mmap

import numpy as np

POPULATE_FROM = 1 << 20  # smaller buffers come from malloc, whose freed memory is reused cheaply


def populated_bytes(size: int) -> np.ndarray:
    """`size` zeroed bytes (uint8), page-aligned, every page already mapped (Linux MAP_POPULATE;
    elsewhere the pages are faulted in as they are written)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return np.frombuffer(mmap.mmap(-1, max(size, 1), flags=flags), dtype=np.uint8)[:size]
