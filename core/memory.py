"""Fresh host memory for large buffers that are about to be filled whole.

NumPy's allocations of a few MiB and more come fresh from the kernel and are faulted in one page at
a time when first written; NumPy also asks for transparent huge pages on them, which with the
usual THP setting (defrag=madvise) can stall in memory compaction. A stage that reads gigabytes of
weights straight into its slots (pread) pays that on every page: measured on the 2-core dev VM,
reading 1.5 GiB into np.zeros buffers ran at 0.4-1.8 GB/s from the page cache, against 2.7 GB/s
into anonymous mappings populated in one call (MAP_POPULATE), consistently. The same holds for
received frames whose arrays are kept (cluster/wire/stream.py): ~5 ms per fresh 4 MB array against
~1 ms (docs/cluster.md)."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np

POPULATE_FROM = 1 << 20  # smaller buffers come from malloc, whose freed memory is reused cheaply


MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault every page in, writable, in one call
_libc = None


def _populate(m: mmap.mmap) -> bool:
    """Fault every page of `m` in with madvise(MADV_POPULATE_WRITE), called through ctypes so that
    the GIL is released meanwhile (Python's own mmap() with MAP_POPULATE holds it: a helper thread
    hashing weights, bundle/weights.BackgroundHash, then stalls for as long as the pages take).
    False where the kernel or platform has no such call."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        return _libc.madvise(addr, len(m), MADV_POPULATE_WRITE) == 0
    except (OSError, AttributeError, TypeError):
        return False


def populated_bytes(size: int) -> np.ndarray:
    """`size` zeroed bytes (uint8), page-aligned, every page already mapped (madvise
    MADV_POPULATE_WRITE, else MAP_POPULATE; elsewhere the pages are faulted in as they are
    written)."""
    m = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if not _populate(m):
        m.close()
        m = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
    return np.frombuffer(m, dtype=np.uint8)[:size]
