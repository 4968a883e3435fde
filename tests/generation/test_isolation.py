"""Failure isolation in the engine: what one request causes ends that request alone.

On the zoo's GPT-2 decode step (max context 20) as 2 stages. Stage workers run in this process
(ThreadLauncher) where a fault is injected at the lowest boundary it would come from: the sampler
given NaN logits for one row, a stage's computation raising on one request's token. Each time the
other requests' tokens equal an offline run, the pipeline restarts nothing, and the poisoned
request ends with FinishReason.ERROR saying why.

Then a seeded random schedule over the synchronous Engine: requests with stop strings and stop
tokens added at random moments, cancels at random moments (queued, mid-prompt, mid-generation,
just finished), extreme sampling values; every request ends exactly once, greedy ones with the
offline tokens (a prefix when cut), the scheduler never stalls, and the pipeline ends idle.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from tests.support.pipeline_harness import ThreadLauncher
from tvmpipe.bundle.decode_layout import HEAD, ROW, SEED
from tvmpipe.cluster.driver import Pipeline
from tvmpipe.core.errors import FieldError
from tvmpipe.executor.sampler import Sampling
from tvmpipe.generation import Engine, Generator, Request, layout_of
from tvmpipe.generation.requests import FinishReason

pytest.importorskip("tvm")
pytestmark = [pytest.mark.tvm]

PROMPTS = [[5, 17, 3], [60], [1, 2, 3, 4], [9, 9], [33, 0, 12]]
POISON_SEED = 6666  # the row whose logits the injected sampler fault turns to NaN
POISON_TOKEN = 123  # the token whose step the injected stage fault makes raise


@pytest.fixture(scope="module")
def gpt2(zoo_decoder):
    return zoo_decoder("gpt2")[0]


@pytest.fixture(scope="module")
def chat_codec(tmp_path_factory):
    from tests.serve.harness import build_tokenizer
    from tvmpipe.generation.text import load_text_codec

    return load_text_codec(build_tokenizer(tmp_path_factory.mktemp("tok") / "t"))


def offline(bundle, prompts, n):
    with Pipeline(bundle, 2, launcher="process", logits=False) as pipe:
        layout = layout_of(pipe.bundle)
        return [r.tokens for r in Generator(pipe).generate_all([Request.checked(p, n, layout, key=0) for p in prompts])]


def test_sampling_values_are_checked_and_safe():
    """Out-of-range values are refused where they enter, naming the field; a temperature too small
    to divide by draws greedily (it would overflow the logits to NaN); NaN or +inf logits draw
    NOT_FINITE instead of raising."""
    from tvmpipe.executor.sampler import NOT_FINITE, sample_token

    for kw, field in (({"temperature": -1.0}, "temperature"), ({"temperature": float("nan")}, "temperature"),
                      ({"temperature": float("inf")}, "temperature"), ({"top_p": 0.0}, "top_p"),
                      ({"top_p": float("nan")}, "top_p"), ({"top_k": -5}, "top_k"), ({"seed": 2 ** 64}, "seed")):
        with pytest.raises(FieldError) as exc:
            Sampling(**kw).check(128)
        assert exc.value.field == field
    logits = np.random.default_rng(0).standard_normal(128).astype(np.float32)
    assert Sampling(1e-308, 0, 3, 1.0).pick(logits, 0, 0) == int(np.argmax(logits))
    assert Sampling(1e-6, 0, 3, 1.0).greedy and not Sampling(1e-5, 0, 3, 1.0).greedy
    assert 0 <= Sampling(1e308, 0, 3, 1e-300).pick(logits, 0, 0) < 128
    bad = logits.copy()
    bad[7] = np.nan
    assert Sampling(0.7, 0, 3, 1.0).pick(bad, 0, 0) == NOT_FINITE
    bad[7] = np.inf
    assert Sampling().pick(bad, 0, 0) == NOT_FINITE
    from tvmpipe.bundle.decode_layout import encode_step, row_ints

    tag = encode_step(-1, False, row_ints(0, 0, False, Sampling().tag_ints()) + row_ints(0, 0, False, Sampling().tag_ints()))
    two = np.stack([logits, bad]).reshape(-1)
    assert sample_token(two, tag.tolist(), 128, 2).tolist() == [int(np.argmax(logits)), NOT_FINITE]


def _poisoned_sampler(monkeypatch):
    """The sampling stage sees NaN logits in every row whose tag carries POISON_SEED."""
    import tvmpipe.cluster.worker as worker

    real = worker.sample_token

    def sample_token(logits, tag, vocab, batch=1, states=None, scores=None):
        if tag is not None:
            rows = np.array(logits, dtype=np.float32).reshape(batch, -1)
            for r in range(batch):
                if tag[HEAD + ROW * r + SEED] == POISON_SEED:
                    rows[r] = np.nan
            logits = rows.reshape(np.shape(logits))
        return real(logits, tag, vocab, batch, states, scores)

    monkeypatch.setattr(worker, "sample_token", sample_token)


def test_nan_logits_end_their_request_alone(gpt2, monkeypatch):
    """One request's logits turn NaN: it ends with ERROR naming the cause, with no token drawn from
    them; the other requests, before and after it in the same rows, give the offline tokens; no
    stage restarts and no step fails."""
    want = offline(gpt2, PROMPTS, 8)
    _poisoned_sampler(monkeypatch)
    with Pipeline(gpt2, 2, launcher=ThreadLauncher(), logits=False, max_restarts=0) as pipe:
        layout = layout_of(pipe.bundle)
        reqs = [Request.checked(p, 8, layout, key=0) for p in PROMPTS]
        poison = Request.checked([5, 17, 3], 8, layout, key=0, sampling=Sampling(0.9, 0, POISON_SEED, 1.0))
        engine = Engine(pipe)
        outs = list(engine.generate(reqs[:2] + [poison] + reqs[2:]))
        results = {o.index: o.result for o in outs if o.result is not None}
        assert pipe.restarts == [0, 0] and pipe.step_errors == []
    assert results[2].finish == FinishReason.ERROR and results[2].tokens == []
    assert "not finite" in results[2].error
    got = [results[i].tokens for i in (0, 1, 3, 4, 5)]
    assert got == want and all(results[i].finish == FinishReason.LENGTH for i in (0, 1, 3, 4, 5))


def _poisoned_stage(monkeypatch, times: int | None):
    """Stage 0 raises on a step that feeds POISON_TOKEN (`times` times, None: always)."""
    from tvmpipe.executor.stage import Stage

    real = Stage.run
    left = {"n": times}

    def run(self, feed, *a, **kw):
        toks = [v for e, v in feed.items() if getattr(v, "dtype", None) == np.int64 and v.size and
                e in self.program.input_entries.values() and POISON_TOKEN in np.asarray(v).reshape(-1)]
        if toks and self.program.start == 0 and (left["n"] is None or left["n"] > 0):
            if left["n"] is not None:
                left["n"] -= 1
            raise ValueError(f"injected fault on token {POISON_TOKEN}")
        return real(self, feed, *a, **kw)

    monkeypatch.setattr(Stage, "run", run)


def test_a_step_that_fails_twice_ends_its_request_and_nothing_restarts(gpt2, monkeypatch):
    """Stage 0 raises on every step that feeds one request's prompt token (a poison request). The
    step is delivered failed, retried once, fails again: that request ends with ERROR carrying the
    stage's error, the stage is re-wired but never restarted, and the other requests (in flight at
    the same time) give the offline tokens."""
    want = offline(gpt2, PROMPTS, 8)
    _poisoned_stage(monkeypatch, None)
    with Pipeline(gpt2, 2, launcher=ThreadLauncher(), logits=False, max_restarts=0) as pipe:
        layout = layout_of(pipe.bundle)
        reqs = [Request.checked(p, 8, layout, key=0) for p in PROMPTS]
        poison = Request.checked([7, POISON_TOKEN, 2], 8, layout, key=0)
        outs = list(Engine(pipe).generate(reqs[:2] + [poison] + reqs[2:]))
        results = {o.index: o.result for o in outs if o.result is not None}
        # the step, its retry, and any step of that request submitted before the failure came back
        assert pipe.restarts == [0, 0] and len(pipe.step_errors) >= 2
        assert all("injected fault" in e for e in pipe.step_errors)
    assert results[2].finish == FinishReason.ERROR and "injected fault" in results[2].error
    assert [results[i].tokens for i in (0, 1, 3, 4, 5)] == want


def test_a_step_that_fails_once_is_retried_and_changes_nothing(gpt2, monkeypatch):
    """The same fault, once only (transient): the step is retried and every request, the one it hit
    included, gives the offline tokens."""
    prompts = PROMPTS + [[7, POISON_TOKEN, 2]]
    want = offline(gpt2, prompts, 8)
    _poisoned_stage(monkeypatch, 1)
    with Pipeline(gpt2, 2, launcher=ThreadLauncher(), logits=False, max_restarts=0) as pipe:
        layout = layout_of(pipe.bundle)
        res = Generator(pipe).generate_all([Request.checked(p, 8, layout, key=0) for p in prompts])
        assert pipe.restarts == [0, 0] and len(pipe.step_errors) == 1
    assert [r.tokens for r in res] == want and all(r.finish == FinishReason.LENGTH for r in res)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_adds_cancels_and_stops_keep_every_invariant(gpt2, chat_codec, seed):
    """A seeded random schedule over the synchronous Engine (with a tokenizer): greedy and sampled
    requests with stop strings and stop tokens join between any two steps, cancels hit queued,
    running and ended requests. Every request ends exactly once; a greedy one's tokens are a prefix
    of its offline tokens (all of them when it ended by length), cut right after the token that
    completed a stop string or at its stop token; the scheduler never stalls; the pipeline ends
    with nothing in flight."""
    rnd = random.Random(seed)
    prompts = [[rnd.randrange(4, 120) for _ in range(rnd.randint(1, 6))] for _ in range(24)]
    n = 10
    want = offline(gpt2, prompts, n)
    with Pipeline(gpt2, 2, launcher="process", logits=False) as pipe:
        layout = layout_of(pipe.bundle)
        engine = Engine(pipe, chat_codec)
        ends: dict[int, list] = {}
        todo = list(range(len(prompts)))
        kinds, stop_of = {}, {}
        steps = 0
        while todo or engine.has_work:
            for _ in range(rnd.choice([0, 0, 1, 2, 3])):
                if not todo:
                    break
                i = todo.pop(0)
                kind = rnd.choice(["greedy", "stop", "stoptok", "sampled", "extreme"])
                kinds[i] = kind
                stop = [rnd.choice(["e", " ", "o", "th"])] if kind == "stop" else []
                stop_of[i] = stop
                stops = [want[i][rnd.randrange(n)]] if kind == "stoptok" else []
                sampling = (Sampling(0.8, 20, seed, 0.9) if kind == "sampled" else
                            Sampling(1e-308, 0, 2 ** 63 - 1, 1e-300) if kind == "extreme" else Sampling())
                engine.add(Request.checked(prompts[i], n, layout, key=0, stop=stop, stop_tokens=stops,
                                           sampling=sampling), i)
            if rnd.random() < 0.15 and (kinds or todo):
                engine.cancel(rnd.choice(list(kinds) or [0]))
            for out in (engine.step() if engine.has_work else engine.collect()):
                if out.result is not None:
                    ends.setdefault(out.index, []).append(out.result)
            steps += 1
            assert steps < 5000
        assert engine.core.stalls == 0 and pipe.in_flight == 0
        assert pipe.restarts == [0, 0] and pipe.step_errors == []
    assert sorted(ends) == sorted(kinds) and all(len(v) == 1 for v in ends.values())
    for i, (r,) in ends.items():
        if kinds[i] in ("sampled",):
            continue
        assert r.tokens == want[i][:len(r.tokens)], (i, kinds[i], r)
        if r.finish == FinishReason.LENGTH:
            assert r.tokens == want[i]
        elif r.finish == FinishReason.STOP and kinds[i] == "stoptok":
            assert len(r.tokens) == want[i].index(r.tokens[-1]) + 1
        elif r.finish == FinishReason.STOP:  # a stop string: completed by the last token, not before
            (stop,) = stop_of[i]
            assert stop in chat_codec.decode(r.tokens) and stop not in chat_codec.decode(r.tokens[:-1])
            assert r.text is not None and stop not in r.text
        else:
            assert r.finish == FinishReason.CANCELLED, r
