"""NumPy paged attention: the oracle that paged decode steps are checked against.

A stage's paged KV cache is one pool of pages, `pages[num_pages, 2, num_kv_heads, page_size,
head_dim]` (index 0 of the second axis is K, 1 is V), the layout of TVM's paged kernels
(compiler/pagedkv.py). A row reads its tokens through a CSR page table: its pages are
`page_table_values[page_table_indptr[b]:page_table_indptr[b + 1]]`, in token order, every one full
but the last, which holds `last_page_len[b]` tokens; so its length is
`(pages - 1) * page_size + last_page_len[b]`. A new token is written at `position_map[t]` =
`page * page_size + offset` (-1: not written).

Like the other reference ops (executor/reference_ops.py) this shares no code with TVM and keeps to
plain formulas: gather a row's K/V in token order, then ordinary softmax attention in float32 (the
kernels accumulate in float32 too), cast to the query's dtype. Query head `h` reads KV head
`h // (num_qo_heads // num_kv_heads)` (grouped-query attention). No rotary: the decode step applies
it to Q and K before the append, so the pages hold rotated keys.
"""

from __future__ import annotations

import numpy as np

# A row without pages: the kernels' initial running max, with a denominator of 1 (log2 1 = 0)
EMPTY_LSE = -5e4


class PageTableError(ValueError):
    """A page table, position map or pool whose fields contradict each other."""


def row_pages(indptr: np.ndarray, values: np.ndarray, b: int) -> np.ndarray:
    """Row `b`'s page ids, in token order."""
    lo, hi = int(indptr[b]), int(indptr[b + 1])
    if not 0 <= lo <= hi <= len(values):
        raise PageTableError(f"row {b}: page_table_indptr [{lo}, {hi}) outside the {len(values)} values")
    return values[lo:hi]


def row_length(indptr: np.ndarray, last_page_len: np.ndarray, page_size: int, b: int) -> int:
    """Tokens held by row `b`: every page full but the last."""
    n = int(indptr[b + 1]) - int(indptr[b])
    if n == 0:
        return 0
    last = int(last_page_len[b])
    if not 1 <= last <= page_size:
        raise PageTableError(f"row {b}: last page holds {last} tokens, not 1..{page_size}")
    return (n - 1) * page_size + last


def gather_kv(pages: np.ndarray, ids: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """A row's K and V, [length, num_kv_heads, head_dim] each, in token order."""
    num_pages, two, hkv, page_size, d = pages.shape
    if two != 2:
        raise PageTableError(f"pages of shape {pages.shape}: the second axis must be 2 (K, V)")
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= num_pages):
        raise PageTableError(f"page ids {ids.tolist()} outside the pool of {num_pages}")
    if length > ids.size * page_size:
        raise PageTableError(f"{length} tokens in {ids.size} pages of {page_size}")
    kv = pages[ids]  # [n, 2, hkv, P, d]
    kv = kv.transpose(1, 0, 3, 2, 4).reshape(2, ids.size * page_size, hkv, d)[:, :length]
    return kv[0], kv[1]


def dense_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, sm_scale: float | None = None
                    ) -> tuple[np.ndarray, float | np.ndarray]:
    """One query token against `length` keys: q [Hq, D], k/v [length, Hkv, D] -> (out [Hq, D] in
    float32, lse [Hq] in log2 units). Empty k: zeros and EMPTY_LSE."""
    hq, d = q.shape
    hkv = k.shape[1]
    if hq % hkv:
        raise PageTableError(f"{hq} query heads over {hkv} KV heads")
    scale = 1.0 / np.sqrt(d) if sm_scale is None else sm_scale
    if k.shape[0] == 0:
        return np.zeros((hq, d), np.float32), np.full(hq, EMPTY_LSE, np.float32)
    group = hq // hkv
    kh = np.repeat(k.astype(np.float32), group, axis=1)  # [L, Hq, D]: query head h reads KV head h // group
    vh = np.repeat(v.astype(np.float32), group, axis=1)
    s = np.einsum("hd,lhd->hl", q.astype(np.float32), kh) * np.float32(scale)
    m = s.max(axis=1, keepdims=True)
    e = np.exp(s - m)
    den = e.sum(axis=1, keepdims=True)
    out = np.einsum("hl,lhd->hd", e / den, vh)
    lse = (m[:, 0] + np.log(den[:, 0])) / np.log(2.0)
    return out.astype(np.float32), lse.astype(np.float32)


def decode(q: np.ndarray, pages: np.ndarray, page_table_indptr: np.ndarray, page_table_values: np.ndarray,
           last_page_len: np.ndarray, sm_scale: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Decode attention of each row's one query over its pages: q [B, Hq, D] -> (output [B, Hq, D]
    in q's dtype, lse [B, Hq] float32, log2 of the softmax denominator as the kernel reports it).
    A row without pages attends to nothing: zeros (a batch's idle rows)."""
    b_rows, hq, d = q.shape
    page_size = pages.shape[3]
    if pages.shape[4] != d or hq % pages.shape[2]:
        raise PageTableError(f"q {q.shape} against pages {pages.shape}")
    if len(page_table_indptr) != b_rows + 1 or len(last_page_len) < b_rows:
        raise PageTableError(f"{b_rows} rows, page_table_indptr of {len(page_table_indptr)}, "
                             f"last_page_len of {len(last_page_len)}")
    out = np.zeros((b_rows, hq, d), np.float32)
    lse = np.zeros((b_rows, hq), np.float32)
    for b in range(b_rows):
        ids = row_pages(page_table_indptr, page_table_values, b)
        k, v = gather_kv(pages, ids, row_length(page_table_indptr, last_page_len, page_size, b))
        out[b], lse[b] = dense_attention(q[b], k, v, sm_scale)
    return out.astype(q.dtype), lse


def prefill(q: np.ndarray, q_indptr: np.ndarray, pages: np.ndarray, page_table_indptr: np.ndarray,
            page_table_values: np.ndarray, last_page_len: np.ndarray, causal: bool = True,
            sm_scale: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A chunked step's attention: row b's queries q[q_indptr[b]:q_indptr[b + 1]] ([T, Hq, D],
    packed) are its last n tokens (already appended), so with `causal` its query j sees the first
    `length - n + j + 1` tokens; without, all `length`. Returns (output [T, Hq, D] in q's dtype,
    lse [T, Hq] float32, log2 units); query slots past q_indptr[B] are zeros."""
    total, hq, d = q.shape
    b_rows = len(q_indptr) - 1
    page_size = pages.shape[3]
    if len(page_table_indptr) != b_rows + 1 or not 0 <= q_indptr[0] <= q_indptr[-1] <= total:
        raise PageTableError(f"{b_rows} rows of queries against page_table_indptr of {len(page_table_indptr)}, "
                             f"q_indptr ending at {q_indptr[-1]} of {total} queries")
    out = np.zeros((total, hq, d), np.float32)
    lse = np.zeros((total, hq), np.float32)
    for b in range(b_rows):
        lo, hi = int(q_indptr[b]), int(q_indptr[b + 1])
        length = row_length(page_table_indptr, last_page_len, page_size, b)
        if hi - lo > length:
            raise PageTableError(f"row {b}: {hi - lo} queries but {length} tokens in its pages")
        k, v = gather_kv(pages, row_pages(page_table_indptr, page_table_values, b), length)
        for j in range(hi - lo):
            seen = length - (hi - lo) + j + 1 if causal else length
            out[lo + j], lse[lo + j] = dense_attention(q[lo + j], k[:seen], v[:seen], sm_scale)
    return out.astype(q.dtype), lse


def append(pages: np.ndarray, k: np.ndarray, v: np.ndarray, position_map: np.ndarray) -> None:
    """Write token t's K and V ([T, Hkv, D] each) at `position_map[t]` (page * page_size + offset)
    in place; -1 skips the token. Two tokens at one position is an error (the kernel's result
    would depend on thread order)."""
    num_pages, _, hkv, page_size, d = pages.shape
    if k.shape != v.shape or k.shape[1:] != (hkv, d) or len(position_map) != k.shape[0]:
        raise PageTableError(f"k {k.shape}, v {v.shape}, position_map {len(position_map)} against pages {pages.shape}")
    pos = np.asarray(position_map, dtype=np.int64)
    live = np.flatnonzero(pos != -1)
    at = pos[live]
    if at.size and (at.min() < 0 or at.max() >= num_pages * page_size):
        raise PageTableError(f"positions {at.tolist()} outside the pool of {num_pages} x {page_size}")
    if len(np.unique(at)) != at.size:
        raise PageTableError(f"position_map writes one position twice: {at.tolist()}")
    page, off = at // page_size, at % page_size
    pages[page, 0, :, off, :] = k[live]
    pages[page, 1, :, off, :] = v[live]


def position_map(indptr: np.ndarray, values: np.ndarray, page_size: int, b: int, start: int, count: int
                 ) -> np.ndarray:
    """Positions in the pool of row `b`'s tokens [start, start + count), through its page table."""
    ids = row_pages(indptr, values, b)
    t = np.arange(start, start + count)
    if count and t[-1] >= ids.size * page_size:
        raise PageTableError(f"row {b}: token {t[-1]} past its {ids.size} pages of {page_size}")
    return (ids[t // page_size].astype(np.int64) * page_size + t % page_size).astype(np.int32)
