"""The step tag (bundle.decode_layout) and keyed draws (executor.sampler): what the driver tells the
token and sampling stages per micro-batch survives the wire exactly, and a draw depends only on (seed,
key, token index), the row's sampling and the logits, so any process, in any order, after any restart
draws the same token."""

from __future__ import annotations

import numpy as np
import pytest

from tvmpipe.bundle.decode_layout import HEAD, ROW, RowTag, StepTag, no_step, row_ints
from tvmpipe.core.errors import FieldError, TvmpipeError
from tvmpipe.executor.sampler import Sampling, sample_token


def hot(key: int, index: int, s: Sampling, fed: bool = False) -> RowTag:
    return RowTag.from_ints(row_ints(key, index, fed, s.tag_ints()))


def test_the_step_tag_round_trips_through_its_int64_entry():
    tag = StepTag(41, (hot(7, 3, Sampling(0.8, 10, 2 ** 62 + 5, 0.9), fed=True),), True)
    raw = tag.encode()
    assert raw.dtype == np.int64 and raw.shape == (HEAD + ROW,)
    assert StepTag.decode(raw.copy()) == tag
    assert tag.rows[0] == RowTag(7, 3, True, 2 ** 62 + 5, 10, 0.8, 0.9)
    assert StepTag.decode(no_step(1)) == StepTag() and StepTag().rows[0].token_index == -1 and not StepTag().feed_next
    rows = (hot(7, 3, Sampling(0.5, 0, 1), True), RowTag(), hot(9, 0, Sampling()))  # a static batch of three
    tag = StepTag(5, rows, False)
    assert tag.encode().shape == (HEAD + ROW * 3,) and StepTag.decode(tag.encode()) == tag
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
    greedy = StepTag(-1, (RowTag(0, 2),)).encode().tolist()
    assert sample_token(logits, greedy, 50).tolist() == [int(np.argmax(logits))]
    assert sample_token(logits, StepTag().encode().tolist(), 50).tolist() == [0]  # token_index -1: nothing drawn
    assert sample_token(logits, None, 50).tolist() == [0]  # no tag (a plain run)
    tag = StepTag(-1, (hot(3, 5, s),)).encode().tolist()
    assert sample_token(logits, tag, 50).tolist() == [draws[5]]  # what the stage draws is the keyed draw


def test_top_p_keeps_the_smallest_set_that_reaches_it():
    """Nucleus sampling: with probabilities 0.5, 0.3, 0.15, 0.05, top_p 0.7 draws only from the first
    two (0.5 < 0.7 <= 0.8), top_p 0.5 only the first, and 1 from all four."""
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    drawn = {p: {Sampling(1.0, 0, 4, p).pick(logits, 0, i) for i in range(300)} for p in (0.5, 0.7, 1.0)}
    assert drawn[0.5] == {0} and drawn[0.7] == {0, 1} and drawn[1.0] == {0, 1, 2, 3}


def test_each_row_of_a_static_batch_draws_its_own_sequences_token_with_its_own_sampling():
    """A step of three rows: each row draws from its own logits with its own key and sampling, a row
    that draws nothing sends 0, and a sequence's draw does not depend on the row it runs in."""
    logits = np.random.default_rng(1).standard_normal((3, 1, 50)).astype(np.float32)
    greedy = StepTag(-1, (RowTag(4, 0), RowTag(0, -1), RowTag(9, 6))).encode().tolist()
    assert sample_token(logits, greedy, 50, 3).tolist() == [int(np.argmax(logits[0])), 0, int(np.argmax(logits[2]))]
    s, t = Sampling(1.0, 0, 9), Sampling(0.7, 5, 3, 0.8)
    mixed = StepTag(-1, (hot(4, 0, s), RowTag(0, -1), hot(9, 6, t))).encode().tolist()
    want = [s.pick(logits[0, -1], 4, 0), 0, t.pick(logits[2, -1], 9, 6)]
    assert sample_token(logits, mixed, 50, 3).tolist() == want
    alone = StepTag(-1, (hot(9, 6, t),)).encode().tolist()
    assert sample_token(logits[2:], alone, 50).tolist() == [want[2]]  # the same sequence, batch 1
    assert sample_token(logits, None, 50, 3).tolist() == [0, 0, 0]


@pytest.mark.parametrize("bad", [-1, 2 ** 63, 1.5, True])
def test_a_bad_seed_is_a_one_line_error(bad):
    with pytest.raises(FieldError, match="^seed ") as exc:
        Sampling(0.5, 0, bad).check(10)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("field,value", [("top_p", 0.0), ("top_p", 1.5), ("temperature", -1.0), ("top_k", 11)])
def test_bad_sampling_is_a_one_line_error_naming_its_option(field, value):
    """A FieldError naming the field; each front end renders it with its own name (a flag, a parameter)."""
    with pytest.raises(FieldError, match=f"^{field} ") as exc:
        Sampling(**{field: value}).check(10)
    assert "\n" not in str(exc.value) and exc.value.field == field
    assert exc.value.render({field: f"--{field.replace('_', '-')}"}).startswith(f"--{field.replace('_', '-')} ")
