"""The scheduler drives a paged decode step (docs/paged-kv.md, issue 53): one PagePool for the
pipeline, pages reserved at admission (a prompt's cached leading pages shared), grown before each
step, confirmed when it comes back, freed at the end; the page table travels with each step. On
the zoo's GPT-2 compiled static and paged from the same weights, on process pipelines: the paged
runs' tokens equal the static ones at K = 1 and 2, greedy and seeded, with more requests than
rows; a pool too small for every row preempts the newest sequences and recomputes them (tokens
unchanged); a shared prompt prefix is computed once; a cancel frees its pages; a stage SIGKILLed mid-way is rebuilt by replay into the held pages."""

from __future__ import annotations

import pytest

pytest.importorskip("tvm")
pytestmark = [pytest.mark.tvm, pytest.mark.slow]

T, B, P = 32, 2, 4
PROMPTS = [[5, 17, 3, 60, 9, 11, 12, 13, 14], [5, 17, 3, 60, 9, 11, 12, 13, 20], [7, 8], [1, 2, 3],
           [40, 41, 42, 43, 44], [5, 17, 3, 60, 9, 11, 12, 13, 14, 15]]
NEW = 12


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """gpt2 --decode at max context 32, batch 2, seed 1: static, and paged with pages of 4 in pools
    of 40 (room for every row) and 9 (less than two rows' worth: preemption; the compiler refuses
    a pool smaller than one row at the max context)."""
    from tvmpipe.compiler.decoders import KvOptions
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress

    out = {}
    for name, kv in [("static", None), (40, KvOptions("paged", page_size=P, pages=40)),
                     (9, KvOptions("paged", page_size=P, pages=9))]:
        path = tmp_path_factory.mktemp(f"gpt2-{name}") / "b"
        export("gpt2", progress=Progress(stream=None), decode=T, batch=B, seed=1, kv=kv).write(path)
        out[name] = path
    return out


@pytest.fixture(scope="module")
def static_tokens(bundles):
    from tvmpipe.cluster import Pipeline
    from tvmpipe.generation import Generator

    with Pipeline(bundles["static"], 1, launcher="process") as pipe:
        greedy = [r.tokens for r in Generator(pipe).generate_all(PROMPTS, NEW)]
        seeded = [r.tokens for r in Generator(pipe).generate_all(PROMPTS, NEW, temperature=0.8, top_k=20, seed=3)]
    return greedy, seeded


def generate(pipe, **kw):
    from tvmpipe.generation import Generator

    g = Generator(pipe)
    results = g.generate_all(PROMPTS, NEW, **kw)
    return [r.tokens for r in results], results, g.scheduler


@pytest.mark.parametrize("stages", [1, 2])
def test_paged_steps_give_the_static_tokens(bundles, static_tokens, stages):
    """Six requests over 2 rows a slot, greedy and seeded: the paged step's tokens equal the
    static step's; at the end no page is held (the full pages stay cached for later prompts)."""
    from tvmpipe.cluster import Pipeline

    with Pipeline(bundles[40], stages, launcher="process", kv_tokens=None) as pipe:
        greedy, results, sched = generate(pipe)
        assert sched.pool is not None and sched.pool.num_pages == 40
        seeded, _, sched2 = generate(pipe, temperature=0.8, top_k=20, seed=3)
    assert (greedy, seeded) == static_tokens
    assert all(len(t) == NEW for t in greedy) and all(r.replays == 0 for r in results)
    for s in (sched, sched2):
        st = s.pool.stats()
        assert st.kv_tokens_held == 0 and st.kv_tokens_cached > 0 and st.kv_tokens_total == 40 * P


def test_a_full_pool_preempts_the_newest_and_recomputes_it(bundles, static_tokens):
    """A pool of 9 pages of 4 cannot hold two rows of 21 tokens: the newest sequence is preempted
    (its pages freed, queued again at the head) and recomputed from its tokens so far when pages
    free; every sequence still gets exactly the static step's tokens."""
    from tvmpipe.cluster import Pipeline

    with Pipeline(bundles[9], 2, launcher="process", kv_tokens=None) as pipe:
        greedy, results, sched = generate(pipe)
    assert greedy == static_tokens[0]
    assert sum(r.replays for r in results) >= 1, "the pool never filled: the test proves nothing"
    assert sched.pool.stats().kv_tokens_held == 0 and not sched._order


def test_a_shared_prompt_prefix_is_computed_once(bundles, static_tokens):
    """A finished sequence's two full prompt pages stay cached: two later requests whose prompts
    begin with the same 8 tokens share them (held by both at once, counted once), start their
    prefill after them, and still give the static tokens."""
    from tvmpipe.cluster import Pipeline
    from tvmpipe.generation import Request, layout_of
    from tvmpipe.generation.core import EngineCore

    with Pipeline(bundles[40], 2, launcher="process", kv_tokens=None) as pipe:
        layout = layout_of(pipe.bundle)
        core = EngineCore(pipe, results={})
        core.add(Request.checked(PROMPTS[0], NEW, layout), 0)
        while core.has_work:
            core.step()
        pool = core.scheduler.pool
        assert pool.stats().kv_prefix_hit_tokens == 0
        core.add(Request.checked(PROMPTS[1], NEW, layout), 1)
        core.add(Request.checked(PROMPTS[5], NEW, layout), 5)
        core.step()
        assert pool.stats().kv_prefix_hit_tokens == 16 and pool.stats().kv_pages_shared == 2
        assert pool.pages(1)[:2] == pool.pages(5)[:2]
        while core.has_work:
            core.step()
        results = core.scheduler.results
    assert [results[i].tokens for i in (0, 1, 5)] == [static_tokens[0][i] for i in (0, 1, 5)]


def test_a_cancel_frees_its_pages(bundles, static_tokens):
    from tvmpipe.cluster import Pipeline
    from tvmpipe.generation import FinishReason, Request, layout_of
    from tvmpipe.generation.core import EngineCore

    with Pipeline(bundles[40], 2, launcher="process", kv_tokens=None) as pipe:
        layout = layout_of(pipe.bundle)
        core = EngineCore(pipe, results={})
        for i in (2, 3, 4):
            core.add(Request.checked(PROMPTS[i], NEW, layout), i)
        for _ in range(4):
            core.step()
        pool = core.scheduler.pool
        assert 3 in pool
        core.cancel(3)
        assert 3 not in pool
        while core.has_work:
            core.step()
        results = core.scheduler.results
        assert pool.stats().kv_tokens_held == 0
    assert results[3].finish == FinishReason.CANCELLED and len(results[3].tokens) < NEW
    assert [results[i].tokens for i in (2, 4)] == [static_tokens[0][i] for i in (2, 4)]


def test_a_stage_killed_mid_way_is_rebuilt_into_the_held_pages(bundles, static_tokens):
    """Stage 1 of 2 (it holds pools) SIGKILLed after a few tokens: the restarted stage's pools are
    empty, the cached pages are forgotten, every running sequence is fed again from position 0
    into the pages it holds; the tokens equal the static run's."""
    from tvmpipe.cluster import Pipeline, Timeouts
    from tvmpipe.generation import Generator

    with Pipeline(bundles[40], 2, launcher="process", timeouts=Timeouts(progress=20), kv_tokens=None) as pipe:
        results = {}
        for n, _ in enumerate(Generator(pipe).generate(PROMPTS, NEW, results=results)):
            if n == 8:
                pipe.launcher.kill(1)
        assert pipe.restarts == [0, 1] and pipe.state_losses == 1
    assert [results[i].tokens for i in range(len(PROMPTS))] == static_tokens[0]
    assert sum(r.replays for r in results.values()) >= 1


@pytest.mark.parametrize("seed", [0, 1])
def test_seeded_mixes_of_prefixes_cancels_preemption_and_a_kill(bundles, seed):
    """A seeded random workload on the 9-page pool at K = 2: 10 requests (prompts drawn from a few
    shared prefixes, 4-14 tokens to generate) added at random steps, some cancelled at random
    steps, stage 1 SIGKILLed at a random step. Every request that was not cancelled gives the
    static step's tokens; a cancelled one a prefix of them; no page is held at the end; something
    was replayed (a preemption or the kill)."""
    import random

    from tvmpipe.cluster import Pipeline, Timeouts
    from tvmpipe.generation import FinishReason, Request, layout_of
    from tvmpipe.generation.core import EngineCore

    rng = random.Random(seed)
    stems = [[5, 17, 3, 60, 9, 11, 12, 13], [7, 8, 9, 10], [40, 41, 42]]
    prompts = [rng.choice(stems)[:rng.randint(2, 8)] + [rng.randrange(4, 120) for _ in range(rng.randint(1, 6))]
               for _ in range(10)]
    news = [rng.randint(4, 14) for _ in prompts]
    arrive = sorted(rng.randint(0, 30) for _ in prompts)
    cancel_at = {i: rng.randint(arrive[i] + 1, arrive[i] + 20) for i in rng.sample(range(len(prompts)), 3)}
    kill_at = rng.randint(5, 40)
    with Pipeline(bundles["static"], 1, launcher="process") as pipe:
        from tvmpipe.generation import Generator

        layout = layout_of(pipe.bundle)
        want = [r.tokens for r in Generator(pipe).generate_all(
            [Request.checked(p, n, layout, key=i) for i, (p, n) in enumerate(zip(prompts, news))])]
    with Pipeline(bundles[9], 2, launcher="process", timeouts=Timeouts(progress=20), kv_tokens=None) as pipe:
        core = EngineCore(pipe, results={})
        step = 0
        while step < 200 and (core.has_work or any(a >= step for a in arrive)):
            for i, a in enumerate(arrive):
                if a == step:
                    core.add(Request.checked(prompts[i], news[i], layout, key=i), i)
            for i, c in cancel_at.items():
                if c == step:
                    core.cancel(i)
            if step == kill_at:
                pipe.launcher.kill(1)
            core.step()
            step += 1
        results = core.scheduler.results
        pool = core.scheduler.pool
        assert not core.has_work and pool.stats().kv_tokens_held == 0
        assert step > kill_at and pipe.restarts == [0, 1]  # the kill came mid-way
    assert sum(r.replays for r in results.values()) >= 1
    for i, w in enumerate(want):
        r = results[i]
        if r.finish == FinishReason.CANCELLED:
            assert i in cancel_at and r.tokens == w[:len(r.tokens)], i
        else:
            assert r.tokens == w, (i, r.finish, r.error)
