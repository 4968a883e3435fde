"""The step tag and keyed draws (cluster/sampling.py): what the driver tells the token and sampling
stages per micro-batch survives the wire exactly, and a draw depends only on (seed, sequence, token
index) and the logits, so any process, in any order, after any restart draws the same token."""

from __future__ import annotations

import numpy as np
import pytest

from tvmpipe.cluster.sampling import RowTag, Sampling, StepTag, no_step, sample_token, step_spec
from tvmpipe.core.errors import TvmpipeError


def test_the_step_tag_round_trips_through_its_int64_entry():
    tag = StepTag(41, Sampling(0.8, 10, 2 ** 62 + 5), (RowTag(7, 3, True),), True)
    raw = tag.encode()
    assert raw.dtype == np.int64 and raw.shape == step_spec(1).shape
    assert StepTag.decode(raw.copy()) == tag
    assert StepTag.decode(no_step(1)) == StepTag() and StepTag().rows[0].token_index == -1 and not StepTag().feed_next
    rows = (RowTag(7, 3, True), RowTag(0, -1, False), RowTag(9, 0, False))  # a static batch of three
    tag = StepTag(5, Sampling(0.5, 0, 1), rows, False)
    assert tag.encode().shape == step_spec(3).shape and StepTag.decode(tag.encode()) == tag
    assert StepTag.decode(no_step(3)).rows == (RowTag(),) * 3


def test_draws_are_keyed_not_sequential():
    logits = np.random.default_rng(0).standard_normal((1, 1, 50)).astype(np.float32)
    s = Sampling(1.0, 0, 9)
    draws = [s.pick(logits[0, -1], 3, i) for i in range(40)]
    assert draws == [s.pick(logits[0, -1], 3, i) for i in range(40)]  # again, in the same order
    assert [s.pick(logits[0, -1], 3, i) for i in reversed(range(40))] == draws[::-1]  # in any order
    assert len(set(draws)) > 5  # a real distribution, not one token
    assert draws != [s.pick(logits[0, -1], 4, i) for i in range(40)]  # another sequence draws otherwise
    top = Sampling(1.0, 3, 9)
    assert {top.pick(logits[0, -1], 3, i) for i in range(40)} <= set(np.argsort(logits[0, -1])[-3:].tolist())
    greedy = StepTag(-1, Sampling(), (RowTag(0, 2),)).encode().tolist()
    assert sample_token(logits, greedy, 50).tolist() == [int(np.argmax(logits))]
    assert sample_token(logits, StepTag().encode().tolist(), 50).tolist() == [0]  # token_index -1: nothing drawn
    assert sample_token(logits, None, 50).tolist() == [0]  # no tag (a plain run)
    hot = StepTag(-1, s, (RowTag(3, 5),)).encode().tolist()
    assert sample_token(logits, hot, 50).tolist() == [draws[5]]  # what the stage draws is the keyed draw


def test_each_row_of_a_static_batch_draws_its_own_sequences_token():
    """A step of three rows: each row draws from its own logits with its own key, a row that draws
    nothing sends 0, and a sequence's draw does not depend on the row it runs in."""
    logits = np.random.default_rng(1).standard_normal((3, 1, 50)).astype(np.float32)
    rows = (RowTag(4, 0), RowTag(0, -1), RowTag(9, 6))
    greedy = StepTag(-1, Sampling(), rows).encode().tolist()
    assert sample_token(logits, greedy, 50, 3).tolist() == [int(np.argmax(logits[0])), 0, int(np.argmax(logits[2]))]
    s = Sampling(1.0, 0, 9)
    hot = StepTag(-1, s, rows).encode().tolist()
    want = [s.pick(logits[0, -1], 4, 0), 0, s.pick(logits[2, -1], 9, 6)]
    assert sample_token(logits, hot, 50, 3).tolist() == want
    alone = StepTag(-1, s, (RowTag(9, 6),)).encode().tolist()
    assert sample_token(logits[2:], alone, 50).tolist() == [want[2]]  # the same sequence, batch 1
    assert sample_token(logits, None, 50, 3).tolist() == [0, 0, 0]


@pytest.mark.parametrize("bad", [-1, 2 ** 63, 1.5, True])
def test_a_bad_seed_is_a_one_line_error(bad):
    with pytest.raises(TvmpipeError, match="--seed") as exc:
        Sampling(0.5, 0, bad).check(10)
    assert "\n" not in str(exc.value)
