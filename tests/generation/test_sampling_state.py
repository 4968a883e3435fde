"""What the sampling stage keeps and returns beside its draws (issue 51): each row's log
probabilities from the raw log-softmax, and the tokens a penalized sequence holds so far
(executor.sampler.SequenceStates), which must survive every fault the scheduler recovers from:
a restarted stage that lost its caches (every sequence fed again from position 0), and a restarted
sampling stage that held no cache (the rows it cannot penalize draw STATE_LOST, and the scheduler
feeds them again from position 0)."""

from __future__ import annotations

import numpy as np
import pytest

from tvmpipe.bundle.decode_layout import MAX_LOGPROBS, SCORES, RowTag, StepTag
from tvmpipe.executor.sampler import STATE_LOST, Sampling, SequenceStates, no_scores, sample_token, score_into

VOCAB = 50


def lsm(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x - np.log(np.exp(x - x.max()).sum()) - x.max()


def test_scores_are_the_raw_log_softmax_and_its_top_k():
    logits = np.random.default_rng(1).standard_normal(VOCAB).astype(np.float32)
    logits[[7, 9]] = 3.0  # a tie: the lower id first
    dest = np.full(SCORES, np.nan)
    score_into(dest, logits, 4, 3)
    want = lsm(logits)
    assert dest[0] == pytest.approx(want[4], abs=1e-12)
    assert dest[1:4].tolist() == [7, 9, int(np.argsort(-want, kind="stable")[2])]
    assert np.allclose(dest[1 + MAX_LOGPROBS:4 + MAX_LOGPROBS], want[dest[1:4].astype(int)])
    assert np.isnan(dest[4:1 + MAX_LOGPROBS]).all()
    bad = logits.copy()
    bad[3] = np.nan
    dest = np.full(SCORES, np.nan)
    score_into(dest, bad, 4, 3)  # not finite: left NaN (the scheduler ends that sequence alone)
    assert np.isnan(dest).all()


def row(seq: int, pos: int, token: int, index: int, s: Sampling, **kw) -> RowTag:
    return RowTag(key=0, token_index=index, seed=s.seed, top_k=s.top_k, temperature=s.temperature, top_p=s.top_p,
                  sequence=seq, position=pos, token=token, repetition=s.repetition_penalty,
                  presence=s.presence_penalty, frequency=s.frequency_penalty, min_p=s.min_p, **kw)


def test_extras_bias_and_mask_and_are_asked_for():
    """A row with extras draws from its logits biased and, below min_tokens, with the stop ids ruled
    out; a row whose extras this stage does not hold draws STATE_LOST; the scores stay raw."""
    from tvmpipe.executor.sampler import SequenceExtras

    logits = np.zeros(VOCAB)
    logits[[5, 6]] = [2.0, 1.0]
    st = SequenceStates()
    st.install(2, SequenceExtras((6, 9), (0.5, 3.0), (9,)))

    def draw(index, min_tokens, states=st):
        scores = no_scores(1)
        tag = StepTag(-1, (RowTag(token_index=index, sequence=2, extras=True, min_tokens=min_tokens, logprobs=0),))
        return int(sample_token(logits, tag.encode().tolist(), VOCAB, 1, states, scores)[0]), scores[0, 0]

    assert draw(0, 2) == (5, pytest.approx(lsm(logits)[5]))  # 9 (biased to 3.0) ruled out below min_tokens
    assert draw(2, 2)[0] == 9  # from then on the bias wins
    assert draw(0, 0, SequenceStates())[0] == STATE_LOST


def test_the_stage_keeps_a_penalized_sequences_tokens_by_position():
    """A penalized row draws from its logits penalized over the tokens at positions 0..p (kept from
    the tags and from its own draws); a roll-back truncates what lost steps drew; a gap (a stage
    that lost them) draws STATE_LOST; a retired sequence is dropped; a draw of a greedy row with
    the logits favouring a seen token avoids it as the penalty says; logprobs come unpenalized."""
    s = Sampling(repetition_penalty=4.0)
    logits = np.zeros(VOCAB)
    logits[[5, 6, 8]] = [2.0, 1.9, 1.0]
    st = SequenceStates()

    def step(pos, token, index, want_lp=-1):
        scores = no_scores(1)
        tag = StepTag(-1, (row(3, pos, token, index, s, logprobs=want_lp),)).encode().tolist()
        return int(sample_token(logits, tag, VOCAB, 1, st, scores)[0]), scores[0]

    assert step(0, 5, -1)[0] == 0  # a prompt step draws nothing
    drawn, scores = step(1, 9, 0, want_lp=2)  # tokens 5, 9 seen: 5 penalized (2.0 / 4), 6 wins
    assert drawn == 6 and st.tokens[3] == [5, 9, 6]
    assert scores[0] == pytest.approx(lsm(logits)[6]) and scores[1:3].tolist() == [5, 6]  # raw, not penalized
    assert step(2, -1, 1)[0] == 8  # the fed-back 6 is its own draw: 5 and 6 penalized
    assert st.tokens[3] == [5, 9, 6, 8]
    assert step(2, -1, 1)[0] == 8 and st.tokens[3] == [5, 9, 6, 8]  # the step again (a roll-back): same draw
    assert step(1, 9, 0)[0] == 6 and st.tokens[3] == [5, 9, 6]  # further back: what was drawn after is dropped
    fresh = SequenceStates()
    tag = StepTag(-1, (row(3, 4, 7, 2, s),)).encode().tolist()
    assert sample_token(logits, tag, VOCAB, 1, fresh, no_scores(1)).tolist() == [STATE_LOST]
    retire = StepTag(-1, (RowTag(),), retired=3).encode().tolist()
    sample_token(logits, retire, VOCAB, 1, st, no_scores(1))
    assert 3 not in st.tokens
    plain = StepTag(-1, (row(4, 7, 1, 0, Sampling()),)).encode().tolist()  # no penalty: nothing kept
    assert sample_token(logits, plain, VOCAB, 1, st, no_scores(1)).tolist() == [5] and 4 not in st.tokens


PROMPTS = [[5, 17, 3], [60], [1, 2, 3, 4, 5, 6], [9, 9], [33, 0, 12]]
NEW = 8
PENALIZED = [Sampling(0.9, 10, 3, 1.0, 0.0, 0.5, 0.3, 1.3), Sampling(repetition_penalty=1.5),
             Sampling(0.7, 0, 5, 0.95, 0.1, -0.4, 0.6, 1.0), Sampling(), Sampling(1.0, 0, 9)]


EXTRAS = {3: {"logit_bias": {7: 4.0, 11: -2.5}}, 4: {"min_tokens": 4, "stop_tokens": [1, 2, 3, 4, 5, 6, 7, 8]},
          0: {"logit_bias": {2: 1.5}}}  # installed on the sampling stage (Pipeline.install_sampling)


def requests(layout):
    from tvmpipe.generation import Request

    return [Request.checked(p, NEW, layout, sampling=s, key=i, logprobs=2, **EXTRAS.get(i, {}))
            for i, (p, s) in enumerate(zip(PROMPTS, PENALIZED))]


def run(pipe, kill: int | None = None, at: int = 6):
    from tvmpipe.generation import Generator, layout_of

    results = {}
    events = []
    for n, ev in enumerate(Generator(pipe).generate(requests(layout_of(pipe.bundle)), results=results)):
        events.append(ev)
        if n == at and kill is not None:
            pipe.launcher.kill(kill)
    logprobs = {i: [e.logprob for e in events if e.seq == i] for i in results}
    return [results[i].tokens for i in range(len(PROMPTS))], logprobs, results


def test_penalized_streams_and_logprobs_survive_a_killed_sampling_stage(decode_bundle):
    """Penalized, seeded sequences with logprobs (some with a logit bias or min_tokens), stage 1 of 2
    (the sampling stage, which holds caches) SIGKILLed mid-way: every sequence is fed again from
    position 0, the stage's tokens rebuilt on the way, its extras installed again; the streams and
    their log probabilities equal a run without the fault."""
    from tvmpipe.cluster import Pipeline, Timeouts

    with Pipeline(decode_bundle, 2, launcher="process", slots=3, timeouts=Timeouts(progress=20)) as pipe:
        clean, clean_lp, _ = run(pipe)
        faulted, lp, results = run(pipe, kill=1)
        assert pipe.restarts == [0, 1] and pipe.state_losses == 1
    assert faulted == clean and lp == clean_lp
    assert all(len(t) == NEW for i, t in enumerate(clean) if i != 4) and sum(r.replays for r in results.values()) >= 1
    with Pipeline(decode_bundle, 2, launcher="process", slots=3) as pipe:
        from tvmpipe.generation import Generator

        plain = [r.tokens for r in Generator(pipe).generate_all(PROMPTS, NEW, temperature=0.0)]
    assert clean[1] != plain[1]  # the repetition penalty of the greedy sequence changed it
    assert clean[3] != plain[3] and 7 in clean[3]  # so did the logit bias
    assert len(clean[4]) >= 5 and not set(clean[4][:4]) & set(range(1, 9))  # no stop token before min_tokens


def test_a_sampling_stage_without_caches_rebuilds_what_it_lost(decode_bundle):
    """A plan whose last stage holds the head and no cache: killing it loses no cache (the scheduler
    only rolls back), but it loses the penalized sequences' tokens; their rows draw STATE_LOST and
    are fed again from position 0; the streams equal a run without the fault."""
    from tvmpipe.bundle import load_bundle
    from tvmpipe.cluster import Pipeline, Timeouts
    from tvmpipe.bundle.state import state_spans
    from tvmpipe.partition import Plan

    b = load_bundle(decode_bundle)
    last = max(hi for _, hi in state_spans(b.graph, b.state).values())
    ops = b.graph.op_nodes
    cut = next(c for c in range(1, len(ops)) if ops[c - 1] + 1 > last)  # every cache in stage 0
    plan = Plan.from_cuts(b.graph, [cut])
    with Pipeline(decode_bundle, plan, launcher="process", slots=3, timeouts=Timeouts(progress=20)) as pipe:
        assert pipe.topology.sampler == 1 and 1 not in pipe.topology.stateful
        clean, clean_lp, _ = run(pipe)
        faulted, lp, results = run(pipe, kill=1, at=10)
        assert pipe.restarts == [0, 1] and pipe.state_losses == 0
    assert faulted == clean and lp == clean_lp
    assert sum(r.replays for r in results.values()) >= 1  # STATE_LOST made some group start again
