"""generation/pages.py: the page pool's bookkeeping under random admissions, growth, confirmations,
frees and state losses (hypothesis), with a model of the pool's contents: every confirmed token is
written into the slot `positions` gives, and every live sequence must read back its own tokens
through `table`, so a page shared by prefix reuse that held other tokens, or a page written by one
sequence while another reads it, shows as a wrong token."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tvmpipe.generation.pages import ROOT, PagePool, PagePoolError, grow_all, page_key

P = 4  # tokens a page: small, so sequences span many pages
N = 24  # pages in the pool
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 50, 60, 70, 80], [7] * 12]  # shared system prompts


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = PagePool(N, P)
        self.slots: dict[int, int] = {}  # pool slot -> the token whose K/V is there (the model of the pages)
        self.want: dict[int, list[int]] = {}  # sequence -> its tokens (prompt, then generated)
        self.done: dict[int, int] = {}  # sequence -> tokens confirmed (written)
        self.reserved: dict[int, int] = {}  # sequence -> tokens its pages must hold
        self.next_id = 0
        self.hits = 0

    def write(self, seq: int, upto: int) -> None:
        """Confirm seq's tokens [done, upto): write them where the pool says, then tell the pool."""
        lo = self.done[seq]
        for slot, tok in zip(self.pool.positions(seq, lo, upto - lo), self.want[seq][lo:upto]):
            self.slots[slot] = tok
        self.pool.confirm(seq, self.want[seq][lo:upto])
        self.done[seq] = upto

    @rule(prefix=st.sampled_from(PREFIXES + [[]]), cut=st.integers(0, 12), tail=st.lists(st.integers(0, 3), max_size=9),
          new=st.integers(1, 10))
    def admit(self, prefix, cut, tail, new):
        prompt = prefix[:cut] + tail
        if not prompt:
            prompt = [0]
        tokens = len(prompt) + new
        can = self.pool.can_reserve(tokens, prompt)
        seq = self.next_id
        got = self.pool.reserve(seq, prompt, tokens)
        assert (got is not None) == can  # admission's answer is what reserve does
        if got is None:
            event("admission refused")
            return
        event("prefix hit" if got.hit_tokens else "prefix miss")
        self.next_id += 1
        assert len(got.pages) == -(-tokens // P) and got.hit_tokens % P == 0 and got.hit_tokens < len(prompt)
        self.hits += got.hit_tokens
        self.want[seq] = list(prompt)
        self.reserved[seq] = tokens
        self.done[seq] = got.hit_tokens  # the shared pages hold the prompt's first tokens already
        self.write(seq, len(prompt))  # the prefill of the rest

    @precondition(lambda self: self.want)
    @rule(data=st.data(), k=st.integers(1, 6))
    def generate(self, data, k):
        seq = data.draw(st.sampled_from(sorted(self.want)))
        target = self.done[seq] + k
        if target > self.reserved[seq]:
            if not self.pool.grow(seq, target):
                before = self.pool.pages(seq)
                assert self.pool.available < -(-target // P) - len(before)  # refused only when it cannot
                assert self.pool.pages(seq) == before
                event("growth refused")
                return
            self.reserved[seq] = target
        self.want[seq] += data.draw(st.lists(st.integers(0, 3), min_size=k, max_size=k))
        self.write(seq, target)

    @precondition(lambda self: self.want)
    @rule(data=st.data())
    def finish(self, data):
        seq = data.draw(st.sampled_from(sorted(self.want)))
        self.pool.free(seq)
        for d in (self.want, self.done, self.reserved):
            del d[seq]

    @rule()
    def lose_state(self):
        """A stage restarted: the pages' contents are gone; the scheduler replays every sequence."""
        self.pool.forget_cached()
        self.slots.clear()
        for seq in self.want:
            self.done[seq] = 0
            self.write(seq, len(self.want[seq]))

    @invariant()
    def pages_are_accounted_for(self):
        pool = self.pool
        holders: dict[int, list[int]] = {}
        for seq in self.want:
            pages = pool.pages(seq)
            assert len(set(pages)) == len(pages)
            assert len(pages) == -(-self.reserved[seq] // P)
            for i, p in enumerate(pages):
                holders.setdefault(p, []).append((seq, i))
        free, cached = set(pool._free), set(pool._cached)
        assert len(free) == len(pool._free) and not free & cached and not (free | cached) & holders.keys()
        assert len(free) + len(cached) + len(holders) == N  # free + held + cached = pool
        for p in range(N):
            assert pool._refs[p] == len(holders.get(p, []))  # refcounts equal holders
        for p, hs in holders.items():
            if len(hs) > 1:  # shared: only through the prefix cache, the same tokens at the same place
                (a, i), *rest = hs
                assert all(j == i for _, j in rest)
                assert all(self.want[b][i * P:(i + 1) * P] == self.want[a][i * P:(i + 1) * P] for b, _ in rest)
                assert all(self.done[s] >= (i + 1) * P for s, _ in hs)
        s = pool.stats()
        if s.kv_pages_shared:
            event("pages shared")
        assert s.kv_tokens_held == len(holders) * P and s.kv_tokens_total == N * P
        assert s.kv_pages_shared == sum(1 for hs in holders.values() if len(hs) > 1)
        assert s.kv_prefix_hit_tokens == self.hits

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        rows = [(seq, self.done[seq]) for seq in sorted(self.want)]
        t = self.pool.table(rows + [None])
        assert t.last_page_len[-1] == 0 and t.indptr[-1] == t.indptr[-2]
        for b, (seq, n) in enumerate(rows):
            pages = t.values[t.indptr[b]:t.indptr[b + 1]]
            got = [self.slots.get(pages[i // P] * P + i % P) for i in range(n)]
            assert got == self.want[seq][:n]
            assert n == 0 or (len(pages) - 1) * P + t.last_page_len[b] == n

    @invariant()
    def cached_keys_name_their_tokens(self):
        """A page offered for sharing holds the tokens its key chains: its slots, keyed from the root."""
        for p, key in self.pool._key_of.items():
            assert self.pool._page_of[key] == p
            toks = [self.slots.get(p * P + o) for o in range(P)]
            assert None not in toks
            # some chain of cached keys from ROOT ends at this key with these tokens
            assert any(page_key(parent, toks) == key for parent in [ROOT, *self.pool._key_of.values()])

    def teardown(self):
        for seq in list(self.want):
            self.pool.free(seq)
        s = self.pool.stats()
        assert s.kv_tokens_held == 0 and len(self.pool._free) + len(self.pool._cached) == N  # nothing leaks
        assert all(r == 0 for r in self.pool._refs)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None, derandomize=True,
                                    suppress_health_check=[HealthCheck.too_slow])


def test_a_prompt_shares_the_full_pages_of_a_freed_sequence_until_they_are_evicted():
    pool = PagePool(6, 4)
    a = list(range(10))
    assert pool.reserve("a", a, 12).hit_tokens == 0
    pool.confirm("a", a)
    pool.free("a")
    assert pool.stats().kv_tokens_cached == 8  # pages [0:4] and [4:8]; the third is partial: free
    b = pool.reserve("b", a[:9] + [99], 12)
    assert b.hit_tokens == 8 and pool.stats().kv_prefix_hit_tokens == 8
    c = pool.reserve("c", a[:4] + [5, 5, 5, 5, 5], 9)
    assert c.hit_tokens == 4 and c.pages[0] == b.pages[0] and pool.stats().kv_pages_shared == 1
    # a prompt of exactly two pages shares one: its last token must be computed
    pool.free("c")
    assert pool.reserve("d", a[:8], 8).hit_tokens == 4
    pool.free("b")
    pool.free("d")
    # fill the pool with unrelated tokens: the cached pages are evicted, least recently freed first
    assert pool.reserve("e", [50] * 24, 24).hit_tokens == 0
    assert not pool.can_reserve(1) and pool.reserve("f", [1], 1) is None
    pool.free("e")
    assert pool.reserve("g", a, 12).hit_tokens == 0


def test_admission_counts_the_cached_pages_a_prompt_shares_as_taken():
    pool = PagePool(3, 4)
    a = list(range(9))
    pool.reserve("a", a, 9)
    pool.confirm("a", a)
    pool.free("a")  # pages 0 and 1 cached, page 2 free: 3 available
    # shares 2 cached pages and needs 2 fresh ones: only 1 page is left once the shared ones are taken
    assert not pool.can_reserve(16, a) and pool.reserve("b", a, 16) is None
    assert pool.stats().kv_tokens_cached == 8 and pool.available == 3
    assert pool.can_reserve(12, a) and pool.reserve("b", a, 12).hit_tokens == 8


def test_misuse_is_refused_and_changes_nothing():
    pool = PagePool(2, 4)
    pool.reserve("a", [1, 2], 4)
    with pytest.raises(PagePoolError):
        pool.reserve("a", [1], 4)
    with pytest.raises(PagePoolError):
        pool.confirm("a", [1, 2, 3, 4, 5])
    with pytest.raises(PagePoolError):
        pool.positions("a", 2, 3)
    assert not pool.grow("a", 12) and pool.pages("a") == (0,)
    assert pool.grow("a", 8) and pool.pages("a") == (0, 1)
    with pytest.raises(PagePoolError):
        pool.free("b")


@settings(max_examples=200, deadline=None, derandomize=True)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8), shared=st.booleans(), data=st.data())
def test_grow_all_preempts_the_newest_until_the_oldest_fit(lengths, shared, data):
    pool = PagePool(10, 4)
    admitted = []
    for i, n in enumerate(lengths):  # admit while they fit, sharing a prompt's first page when asked
        prompt = ([9, 9, 9, 9] if shared else [i] * 4) + [i]
        got = pool.reserve(i, prompt, max(n, len(prompt)))
        if got is not None:
            pool.confirm(i, prompt[got.hit_tokens:])
            admitted.append(i)
    needs = [(s, data.draw(st.integers(1, 48))) for s in admitted]
    got = grow_all(pool, needs, admitted)
    gone = set(got.preempted) | set(got.unfit)
    event(f"preempted {min(len(got.preempted), 2)}+, unfit {bool(got.unfit)}")
    assert not set(got.preempted) & set(got.unfit)
    too_big = {s for s, t in needs if -(-t // 4) > 10}
    assert set(got.unfit) <= too_big <= gone  # unfit: more than the pool alone (unless preempted before)
    for s, t in needs:
        assert (s not in pool) == (s in gone)
        if s in pool:
            assert len(pool.pages(s)) >= -(-t // 4)
    running = [s for s in admitted if s in pool]
    assert not got.preempted or max(running, default=-1) < min(got.preempted)  # the newest went first
    assert list(got.preempted) == sorted(got.preempted, reverse=True)
    st_ = pool.stats()
    assert st_.kv_tokens_held + st_.kv_tokens_cached + 4 * len(pool._free) == 40
    for s in running:
        pool.free(s)
    assert pool.stats().kv_tokens_held == 0
