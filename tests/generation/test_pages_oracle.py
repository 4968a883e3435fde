"""The page pool (generation/pages.py) driving the NumPy paged attention (executor/paged_attention.py)
through whole generations: every query of every step equals ordinary attention over its sequence's
own tokens, with chunked prefill, prefix reuse, growth, preemption when the pool fills, frees, and a
stage's state loss replayed into the pages the sequences hold.

A token's K/V is a function of its sequence's tokens up to it (as in a real model, which is what makes
sharing a prefix's pages sound), drawn from a generator seeded by that prefix; the expected output of
a query is `dense_attention` over the K/V of the sequence's tokens, computed without any page.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from tvmpipe.executor import paged_attention as pa
from tvmpipe.generation.pages import PagePool, RowWrite, grow_all, step_pages

P, N, ROWS, CHUNK, HKV, HQ, D = 4, 10, 4, 3, 2, 4, 8
CAPACITY = ROWS * 8
PREFIXES = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 1, 2], [3] * 9]


def kv_of(prefix: list[int]) -> tuple[np.ndarray, np.ndarray]:
    seed = int.from_bytes(hashlib.sha256(repr(prefix).encode()).digest()[:8], "little")
    g = np.random.default_rng(seed)
    return g.standard_normal((HKV, D)).astype(np.float32), g.standard_normal((HKV, D)).astype(np.float32)


def dense(q: np.ndarray, tokens: list[int]) -> np.ndarray:
    kv = [kv_of(tokens[:t + 1]) for t in range(len(tokens))]
    return pa.dense_attention(q, np.stack([k for k, _ in kv]), np.stack([v for _, v in kv]))[0]


@pytest.mark.parametrize("seed", range(6))
def test_generations_through_the_pool_equal_ordinary_attention(seed):
    rng = np.random.default_rng(seed)
    pool = PagePool(N, P)
    pages = rng.standard_normal((N, 2, HKV, P, D)).astype(np.float32)  # garbage
    queue = []  # (prompt, the length at which it finishes)
    for _ in range(14):
        prompt = list(PREFIXES[rng.integers(3)][:rng.integers(2, 8)]) + [int(t) for t in rng.integers(0, 4, rng.integers(0, 4))]
        queue.append((prompt, len(prompt) + int(rng.integers(1, 14))))
    goal = {}  # sequence -> the length at which it finishes
    want, done, admitted, next_id = {}, {}, [], 0
    checked = hits = preemptions = losses = 0
    for step in range(80):
        # admit while a row is free and the pool can take the prompt and one token
        while queue and len(admitted) < ROWS and pool.can_reserve(len(queue[0][0]) + 1, queue[0][0]):
            prompt, goal[next_id] = queue.pop(0)
            got = pool.reserve(next_id, prompt, len(prompt) + 1)
            want[next_id], done[next_id] = list(prompt), got.hit_tokens
            hits += got.hit_tokens
            admitted.append(next_id)
            next_id += 1
        if not admitted:
            break
        if step == 10:  # a stage restarts: its pages are gone; every sequence replays from 0
            pool.forget_cached()
            pages[...] = rng.standard_normal(pages.shape)
            done = {s: 0 for s in done}
            losses += 1
        # each row writes its next tokens: the rest of its prompt C at a time, or one generated token
        for s in admitted:
            if done[s] == len(want[s]):
                want[s].append(int(rng.integers(0, 4)))
        writes = [RowWrite(s, done[s], min(CHUNK, len(want[s]) - done[s])) for s in admitted]
        growth = grow_all(pool, [(w.seq, w.start + w.count) for w in writes], admitted)
        for s in growth.preempted:  # preempt by recompute: back to the queue's head, tokens so far as prompt
            preemptions += 1
            admitted.remove(s)
            queue.insert(0, (want[s][:max(done[s], 1)], goal[s]))
            del want[s], done[s]
        assert not growth.unfit  # N * P = 40 tokens: every sequence here fits alone
        writes = [w for w in writes if w.seq in pool]
        rows = writes + [None] * (ROWS - len(writes))
        sp = step_pages(pool, rows, CHUNK, CAPACITY)
        # the step: K/V of every token slot written, then every slot's query attends (causal chunk)
        k = np.zeros((ROWS * CHUNK, HKV, D), np.float32)
        v = np.zeros_like(k)
        q = rng.standard_normal((ROWS * CHUNK, HQ, D)).astype(np.float32)
        slot_of = {}
        for b, w in enumerate(writes):
            for j in range(w.count):
                slot = sp.q_indptr[b] + j
                k[slot], v[slot] = kv_of(want[w.seq][:w.start + j + 1])
                slot_of[slot] = (w.seq, w.start + j)
        assert all(p == -1 for i, p in enumerate(sp.position_map) if i not in slot_of)
        pa.append(pages, k, v, np.array(sp.position_map, np.int32))
        out, _ = pa.prefill(q, np.array(sp.q_indptr), pages, np.array(sp.page_table_indptr),
                            np.array(sp.page_table_values), np.array(sp.last_page_len))
        for slot, (s, t) in slot_of.items():
            np.testing.assert_allclose(out[slot], dense(q[slot], want[s][:t + 1]), rtol=1e-5, atol=1e-5)
            checked += 1
        for w in writes:
            pool.confirm(w.seq, want[w.seq][w.start:w.start + w.count])
            done[w.seq] += w.count
            if done[w.seq] >= goal[w.seq] and done[w.seq] == len(want[w.seq]):
                pool.free(w.seq)  # finished
                admitted.remove(w.seq)
                del want[w.seq], done[w.seq]
    assert not queue and not admitted  # every request finished: none waited forever
    assert pool.stats().kv_tokens_held == 0
    # the scenario exercises what it claims: 200-280 queries checked, shared prefixes, preemptions
    assert checked > 150 and hits > 0 and preemptions > 0 and losses == 1


def test_a_chunk_1_step_keeps_each_row_in_its_slot_and_idle_rows_write_nothing():
    pool = PagePool(4, 4)
    pool.reserve("a", [1, 2, 3], 4)
    pool.reserve("b", [7], 2)
    sp = step_pages(pool, [None, RowWrite("a", 3, 1), RowWrite("b", 1, 1)], 1, 6)
    assert sp.q_indptr == (0, 1, 2, 3)
    assert sp.position_map == (-1, pool.pages("a")[0] * 4 + 3, pool.pages("b")[0] * 4 + 1)
    assert sp.page_table_indptr == (0, 0, 1, 2) and sp.last_page_len == (0, 4, 2)
    assert sp.page_table_values[2:] == (0,) * 4  # padded to the capacity
