"""Page bookkeeping for a paged KV cache (issue 53): which pages of a stage's pool each sequence
holds, and which full pages a new sequence can share with an earlier one whose prompt began alike.

The pool is `num_pages` pages of `page_size` tokens, the same count on every stage (each stage's
pool holds its own layers' K/V for the same page ids), so one `PagePool` in the scheduler is the
page table of every stage. It decides and records; it does no I/O and knows nothing of the model.

Life of a sequence (the scheduler calls these; docs/paged-kv.md):
- `can_reserve(tokens, prompt)` at admission: a request waits while its pages cannot be reserved.
- `reserve(seq, prompt, tokens)`: its pages for `tokens` tokens. The prompt's leading full pages
  that are cached (held by a live sequence, or freed and not yet evicted) are shared instead of
  allocated: `Reservation.hit_tokens` of the prompt need no prefill. At most
  `(len(prompt) - 1) // page_size` pages are shared, so the prompt's last token is always computed
  (its logits are what the first sampled token is drawn from).
- `grow(seq, tokens)` before a step that takes the sequence past its pages; False when the pool
  has no page left (the caller's preemption policy decides; nothing changes).
- `confirm(seq, tokens)` once the step that wrote these tokens' K/V has come back: a page is
  offered for sharing only when every token of it is confirmed, so no one shares a page whose K/V a
  lost step never wrote.
- `free(seq)` on finish, cancel or failure: its pages lose a reference; a full confirmed page
  nobody holds stays cached (least recently freed evicted first when a fresh page is needed),
  any other goes back to the free list.
- `grow_all(pool, needs, admitted)` before a step when the pool may be full: the preemption policy
  (preempt by recompute, newest admitted first), below.
- `forget_cached()` after a stage lost its state: the cached pages' K/V are gone, so they leave
  the table; pages held by live sequences are rewritten by the scheduler's replay, at the same ids.
  `restart(seq)` when one sequence is fed again from its start (its K/V kept where they are).

A page's cache key chains its tokens with its prefix's key (SHA-256 of the parent's key and the
page's token ids), as vLLM's prefix caching does: equal keys mean equal tokens at equal positions
from the start of the sequence, hence equal K/V.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, Sequence

ROOT = b"tvmpipe-pages-v1"


class PagePoolError(ValueError):
    """A call that contradicts the pool's state (an unknown sequence, tokens past its pages)."""


@dataclass(frozen=True)
class PoolStats:
    """What /metrics and --json report for a stage's pool. Tokens are counted in page slots:
    `kv_tokens_held` is pages held x page size (the memory in use; a sequence's last page may be
    partly filled), `kv_pages_shared` the pages held by more than one sequence (counted once in
    `kv_tokens_held`), `kv_prefix_hit_tokens` a counter of prompt tokens served from the cache."""

    kv_tokens_total: int
    kv_tokens_held: int
    kv_tokens_cached: int
    kv_pages_shared: int
    kv_prefix_hit_tokens: int


@dataclass(frozen=True)
class Reservation:
    """A reserved sequence's pages, in token order, and how many prompt tokens it shares."""

    pages: tuple[int, ...]
    hit_tokens: int


@dataclass(frozen=True)
class PageTable:
    """A step's page table in CSR form (the paged kernels' inputs): row b's pages are
    `values[indptr[b]:indptr[b + 1]]`; `last_page_len[b]` tokens are in its last page (0 for a
    row without pages)."""

    indptr: tuple[int, ...]
    values: tuple[int, ...]
    last_page_len: tuple[int, ...]


@dataclass
class _Sequence:
    pages: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # confirmed tokens (K/V written)
    keys: list[bytes] = field(default_factory=list)  # cache key of each full confirmed page


def page_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The cache key of a page holding `tokens` after the prefix whose last page's key is `parent`."""
    return hashlib.sha256(parent + struct.pack(f"<{len(tokens)}q", *tokens)).digest()


class PagePool:
    """`num_pages` pages of `page_size` tokens shared by the sequences of one pipeline."""

    def __init__(self, num_pages: int, page_size: int, prefix_cache: bool = True) -> None:
        if num_pages < 1 or page_size < 1:
            raise PagePoolError(f"a pool of {num_pages} pages of {page_size} tokens")
        self.num_pages, self.page_size, self.prefix_cache = num_pages, page_size, prefix_cache
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() gives page 0 first
        self._refs = [0] * num_pages
        self._key_of: dict[int, bytes] = {}  # page -> its cache key (full, confirmed pages)
        self._page_of: dict[bytes, int] = {}  # cache key -> page
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced keyed pages, least recent first
        self._seqs: dict[Hashable, _Sequence] = {}
        self._hit_tokens = 0
        self._shared = 0  # pages held by more than one sequence (kept as refs change: stats() each step is O(1))

    # ---- queries -----------------------------------------------------------------------------------

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def pages(self, seq: Hashable) -> tuple[int, ...]:
        return tuple(self._get(seq).pages)

    def __contains__(self, seq: Hashable) -> bool:
        return seq in self._seqs

    @property
    def available(self) -> int:
        """Pages a reservation can take: free ones and cached ones nobody holds (evictable)."""
        return len(self._free) + len(self._cached)

    def _prefix_hits(self, prompt: Sequence[int]) -> list[int]:
        """The cached pages of the prompt's leading full pages (all but its last token)."""
        if not self.prefix_cache:
            return []
        hits, parent = [], ROOT
        for i in range((len(prompt) - 1) // self.page_size if prompt else 0):
            parent = page_key(parent, prompt[i * self.page_size:(i + 1) * self.page_size])
            page = self._page_of.get(parent)
            if page is None:
                break
            hits.append(page)
        return hits

    def can_reserve(self, tokens: int, prompt: Sequence[int] = ()) -> bool:
        """Whether `reserve(seq, prompt, tokens)` would succeed now."""
        hits = self._prefix_hits(prompt)
        fresh = self.pages_for(tokens) - len(hits)
        return fresh <= self.available - sum(1 for p in hits if p in self._cached)

    def stats(self) -> PoolStats:
        held = self.num_pages - len(self._free) - len(self._cached)
        return PoolStats(kv_tokens_total=self.num_pages * self.page_size, kv_tokens_held=held * self.page_size,
                         kv_tokens_cached=len(self._cached) * self.page_size,
                         kv_pages_shared=self._shared, kv_prefix_hit_tokens=self._hit_tokens)

    def table(self, rows: Sequence[tuple[Hashable, int] | None]) -> PageTable:
        """The CSR page table of a step whose row b is (sequence, tokens it attends to: its length
        after the step's append) or None (an idle row, no pages). A row's table lists only the pages
        its tokens fill, so the kernel reads exactly `tokens` of them."""
        indptr, values, last = [0], [], []
        for row in rows:
            if row is None or row[1] == 0:
                last.append(0)
            else:
                seq, n = row
                pages = self._get(seq).pages
                need = self.pages_for(n)
                if need > len(pages):
                    raise PagePoolError(f"sequence {seq!r}: {n} tokens in its {len(pages)} pages")
                values.extend(pages[:need])
                last.append(n - (need - 1) * self.page_size)
            indptr.append(len(values))
        return PageTable(tuple(indptr), tuple(values), tuple(last))

    def positions(self, seq: Hashable, start: int, count: int) -> list[int]:
        """Where tokens [start, start + count) of `seq` go in the pool: page * page_size + offset
        (the append's position map)."""
        pages = self._get(seq).pages
        if start < 0 or start + count > len(pages) * self.page_size:
            raise PagePoolError(f"sequence {seq!r}: tokens [{start}, {start + count}) past its {len(pages)} pages")
        return [pages[t // self.page_size] * self.page_size + t % self.page_size for t in range(start, start + count)]

    # ---- changes -----------------------------------------------------------------------------------

    def reserve(self, seq: Hashable, prompt: Sequence[int], tokens: int) -> Reservation | None:
        """Pages for `tokens` tokens of a new sequence whose prompt is `prompt`, sharing the prompt's
        cached leading pages; None (and nothing changes) when the pool cannot hold them."""
        if seq in self._seqs:
            raise PagePoolError(f"sequence {seq!r} already holds pages")
        if tokens < len(prompt):
            raise PagePoolError(f"{tokens} tokens reserved for a prompt of {len(prompt)}")
        if not self.can_reserve(tokens, prompt):
            return None
        hits = self._prefix_hits(prompt)
        s = _Sequence()
        for page in hits:
            self._take(page)
            s.pages.append(page)
            s.keys.append(self._key_of[page])
        n_hit = len(hits) * self.page_size
        s.tokens = list(prompt[:n_hit])
        s.pages.extend(self._fresh() for _ in range(self.pages_for(tokens) - len(hits)))
        self._seqs[seq] = s
        self._hit_tokens += n_hit
        return Reservation(tuple(s.pages), n_hit)

    def grow(self, seq: Hashable, tokens: int) -> bool:
        """Make `seq` hold pages for `tokens` tokens; False (nothing changes) if the pool cannot."""
        s = self._get(seq)
        more = self.pages_for(tokens) - len(s.pages)
        if more <= 0:
            return True
        if more > self.available:
            return False
        s.pages.extend(self._fresh() for _ in range(more))
        return True

    def confirm(self, seq: Hashable, tokens: Sequence[int]) -> None:
        """Tokens whose K/V the pipeline has written, following those confirmed before; each page
        they fill becomes shareable (unless an equal page is cached already)."""
        s = self._get(seq)
        if len(s.tokens) + len(tokens) > len(s.pages) * self.page_size:
            raise PagePoolError(f"sequence {seq!r}: {len(s.tokens) + len(tokens)} tokens confirmed in "
                                f"{len(s.pages)} pages")
        s.tokens.extend(tokens)
        while self.prefix_cache and len(s.keys) < len(s.tokens) // self.page_size:
            i = len(s.keys)
            key = page_key(s.keys[-1] if s.keys else ROOT, s.tokens[i * self.page_size:(i + 1) * self.page_size])
            s.keys.append(key)
            page = s.pages[i]
            if key not in self._page_of and page not in self._key_of:
                self._page_of[key] = page
                self._key_of[page] = key

    def free(self, seq: Hashable) -> None:
        """`seq` ends (finish, cancel, failure): its pages lose a reference."""
        s = self._seqs.pop(seq, None)
        if s is None:
            raise PagePoolError(f"sequence {seq!r} holds no pages")
        for page in reversed(s.pages):  # the tail first: a prefix's first pages stay cached longest
            self._refs[page] -= 1
            self._shared -= self._refs[page] == 1
            if self._refs[page] == 0:
                if page in self._key_of:
                    self._cached[page] = None
                else:
                    self._free.append(page)

    def restart(self, seq: Hashable) -> None:
        """`seq` is fed again from its first token into the pages it holds (the scheduler rebuilds
        it: the sampling stage lost its tokens): nothing of it is confirmed until the replay
        confirms it again. Its pages keep their cache keys (their K/V are unchanged: the replay
        writes the same values)."""
        s = self._get(seq)
        s.tokens.clear()
        s.keys.clear()

    def forget_cached(self) -> None:
        """Drop every cache key (a stage lost its pages' contents): unreferenced cached pages become
        free; pages that live sequences hold keep their holders, and their sequences re-key them as
        the replay confirms their tokens again."""
        for page in self._cached:
            self._free.append(page)
        self._cached.clear()
        self._key_of.clear()
        self._page_of.clear()
        for s in self._seqs.values():
            s.tokens.clear()
            s.keys.clear()

    # ---- internals ---------------------------------------------------------------------------------

    def _get(self, seq: Hashable) -> _Sequence:
        s = self._seqs.get(seq)
        if s is None:
            raise PagePoolError(f"sequence {seq!r} holds no pages")
        return s

    def _take(self, page: int) -> None:
        if self._refs[page] == 0:
            del self._cached[page]
        self._refs[page] += 1
        self._shared += self._refs[page] == 2

    def _fresh(self) -> int:
        """A page for new tokens: a free one, else the least recently freed cached one (evicted)."""
        if self._free:
            page = self._free.pop()
        else:
            page, _ = self._cached.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
        self._refs[page] = 1
        return page


@dataclass(frozen=True)
class Growth:
    """What `grow_all` did besides growing: `preempted` sequences were freed to make room (newest
    admitted first; the scheduler queues each again, at the head, with its prompt and the tokens
    generated so far as its new prompt: preempt by recompute), `unfit` ones were freed because
    they need more pages than the whole pool (the scheduler ends them with `context`). Neither
    takes part in the step."""

    preempted: tuple[Hashable, ...] = ()
    unfit: tuple[Hashable, ...] = ()


def grow_all(pool: PagePool, needs: Sequence[tuple[Hashable, int]], admitted: Sequence[Hashable]) -> Growth:
    """Grow each (sequence, tokens) of a step, in order; when the pool has no page left, free the
    most recently admitted sequence that still holds pages (`admitted` is the admission order,
    oldest first) and try again, the growing sequence itself included when it is the newest. So
    the oldest requests keep running, each preemption frees at least one page's holder, and the
    loop ends: no step waits on pages that cannot come and nothing is allocated past the pool."""
    preempted: list[Hashable] = []
    unfit: list[Hashable] = []
    order = [s for s in admitted if s in pool]
    if len(order) != len(pool._seqs):
        raise PagePoolError("grow_all: `admitted` must list every sequence that holds pages")
    for seq, tokens in needs:
        if seq not in pool:
            continue  # preempted earlier in this step
        if pool.pages_for(tokens) > pool.num_pages:
            pool.free(seq)
            unfit.append(seq)
            order.remove(seq)
            continue
        while not pool.grow(seq, tokens):
            victim = order.pop()  # the newest still holding pages: never empty while seq holds some
            pool.free(victim)
            preempted.append(victim)
            if victim == seq:
                break
    return Growth(tuple(preempted), tuple(unfit))


@dataclass(frozen=True)
class RowWrite:
    """What one row of a step does: writes `seq`'s tokens [start, start + count) and attends over
    its first start + count tokens (count <= the step's chunk)."""

    seq: Hashable
    start: int
    count: int


@dataclass(frozen=True)
class StepPages:
    """A step's paged inputs as the kernels take them (int32): the CSR page table (values padded to
    the step's static `capacity`), the position map of its token slots, and `q_indptr`, where row
    b's tokens sit in the step's token slots: packed in row order (row b's `count` tokens at
    q_indptr[b] .. q_indptr[b + 1] - 1), the slots past q_indptr[B] spare (position -1). At chunk
    1 every row has its own slot b whatever its count, so that the decode kernel's row b is slot b
    and q_indptr is not needed (it is still given: 0..B)."""

    page_table_indptr: tuple[int, ...]
    page_table_values: tuple[int, ...]
    last_page_len: tuple[int, ...]
    position_map: tuple[int, ...]
    q_indptr: tuple[int, ...]


def step_pages(pool: PagePool, rows: Sequence[RowWrite | None], chunk: int, capacity: int,
               written: set[int] | None = None) -> StepPages:
    """The paged inputs of a step of len(rows) rows of up to `chunk` tokens (None: an idle row).
    Every row's pages must already hold start + count tokens (`grow`). A position that another
    row of this step writes too (two sequences replaying a page they share, after a state loss)
    is written by the first row only: the others' slots get -1 (equal tokens at equal positions:
    equal K/V). `written` collects the positions written, for the caller's checks."""
    if chunk < 1:
        raise PagePoolError(f"a step of chunk {chunk}")
    table = pool.table([(r.seq, r.start + r.count) if r is not None else None for r in rows])
    if len(table.values) > capacity:
        raise PagePoolError(f"the step's rows hold {len(table.values)} pages, more than its table's {capacity}")
    slots = [-1] * (len(rows) * chunk)
    q_indptr = [0]
    seen: set[int] = set()
    for b, r in enumerate(rows):
        count = 0 if r is None else r.count
        if count > chunk:
            raise PagePoolError(f"row {b}: {count} tokens in a step of chunk {chunk}")
        first = b if chunk == 1 else q_indptr[-1]
        if r is not None and count:
            for j, p in enumerate(pool.positions(r.seq, r.start, count)):
                if p not in seen:
                    seen.add(p)
                    slots[first + j] = p
        q_indptr.append(b + 1 if chunk == 1 else q_indptr[-1] + count)
    if written is not None:
        written |= seen
    values = table.values + (0,) * (capacity - len(table.values))
    return StepPages(table.indptr, values, table.last_page_len, tuple(slots), tuple(q_indptr))
