"""Drawing a token from logits: the maths of sampling, run where the logits are.

A pipeline's sampling stage (the one that computes the logits) draws each row's token with
`sample_token`, reading what to draw from the step tag (bundle.decode_layout). Greedy is the argmax of
the logits as computed. Otherwise softmax(logits / temperature) over the `top_k` largest (0: all),
then the smallest set of them whose probability reaches `top_p` (1: all), drawn from a generator keyed
by (seed, key, token index): a draw is the same in any process, after any restart, in any row and
batch, however sequences interleave.

What one request asks can never fail the step it shares with others: a temperature below
`GREEDY_BELOW` (1e-5, vLLM's floor) draws greedily, since dividing by it would overflow the logits,
and a row whose logits are not finite (NaN or +inf: a model that overflowed on this sequence's
input) draws no token but `NOT_FINITE`, which the generation layer reads as that sequence's error.
Nothing is raised on a row's account: an exception would fail the whole step, which the driver
would take for a broken stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tvmpipe.bundle.decode_layout import HEAD, INDEX, KEY, ROW, SEED, TEMPERATURE, TOP_K, TOP_P, bits_float, float_bits
from tvmpipe.core.errors import FieldError

GREEDY_BELOW = 1e-5  # a temperature below this draws greedily (vLLM's _SAMPLING_EPS)
NOT_FINITE = -1  # the draw of a row whose logits hold NaN or +inf: its sequence ends with an error
MAX_SEED = 2 ** 63


@dataclass(frozen=True)
class Sampling:
    """How a sequence draws its tokens: greedy when `temperature` is 0."""

    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0
    top_p: float = 1.0

    def check(self, vocab: int) -> "Sampling":
        """The one check of sampling parameters (a FieldError naming the field, which each front
        end renders as its own option or parameter name); returns self."""
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not np.isfinite(t) or t < 0:
            raise FieldError("temperature", f"must be a finite number >= 0, got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise FieldError("top_k", f"must be an integer >= 0, got {self.top_k!r}")
        if self.top_k > vocab:
            raise FieldError("top_k", f"{self.top_k} is larger than the vocabulary ({vocab})")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not np.isfinite(p) or not 0 < p <= 1:
            raise FieldError("top_p", f"must be a number in (0, 1], got {p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or not 0 <= self.seed < MAX_SEED:
            raise FieldError("seed", f"must be an integer in 0..2^63-1, got {self.seed!r}")
        return self

    @property
    def greedy(self) -> bool:
        """Whether this draws the argmax: temperature 0, or one so small that dividing by it would
        overflow the logits (GREEDY_BELOW)."""
        return self.temperature < GREEDY_BELOW

    def tag_ints(self) -> tuple[int, int, int, int]:
        """This sampling as a step tag row's (seed, top_k, temperature bits, top_p bits)."""
        return self.seed, self.top_k, float_bits(float(self.temperature)), float_bits(float(self.top_p))

    @classmethod
    def from_row(cls, row: list[int]) -> "Sampling":
        """The sampling of one step tag row (ROW ints)."""
        return cls(bits_float(row[TEMPERATURE]), row[TOP_K], row[SEED], bits_float(row[TOP_P]))

    def pick(self, logits: np.ndarray, key: int, token_index: int) -> int:
        """The `token_index`-th token of the sequence keyed `key`, from its logits; NOT_FINITE when
        they hold NaN or +inf (-inf is a token ruled out, and fine while one token is not)."""
        x = np.asarray(logits, dtype=np.float64).reshape(-1)
        if not finite_enough(x):
            return NOT_FINITE
        if self.greedy:
            return int(np.argmax(x))
        x = x / self.temperature  # >= GREEDY_BELOW: finite logits stay finite (float64)
        if self.top_k:
            cut = np.partition(x, -self.top_k)[-self.top_k]
            x = np.where(x >= cut, x, -np.inf)
        p = np.exp(x - x.max())
        p /= p.sum()
        if 0 < self.top_p < 1:
            order = np.argsort(-p, kind="stable")
            keep = np.cumsum(p[order]) - p[order] < self.top_p  # each token while the mass before it is short
            p = np.where(np.isin(np.arange(len(p)), order[keep]), p, 0.0)
            p /= p.sum()
        return int(np.random.default_rng([self.seed, key, token_index]).choice(len(p), p=p))


def sample_token(logits: np.ndarray, tag: list[int] | None, vocab: int, batch: int = 1) -> np.ndarray:
    """The `__token__` a step sends: each row's draw from the last `vocab` logits of its row, or 0
    where nothing is drawn. `tag` is the step tag as plain ints (None: nothing drawn). This runs on
    every step inside the sampling stage's compute, so a greedy row takes no detour."""
    out = np.zeros(batch, dtype=np.int64)
    if tag is None:
        return out
    rows = np.asarray(logits).reshape(batch, -1)
    for r in range(batch):
        at = HEAD + ROW * r
        index = tag[at + INDEX]
        if index < 0:
            continue
        row = rows[r, -vocab:]
        if tag[at + TEMPERATURE] == 0:  # temperature 0.0 (its float64 bits): the argmax of the logits as computed
            out[r] = row.argmax() if finite_enough(row) else NOT_FINITE
        else:
            out[r] = Sampling.from_row(tag[at:at + ROW]).pick(row, tag[at + KEY], index)
    return out


def finite_enough(x: np.ndarray) -> bool:
    """Logits a token can be drawn from: no NaN, no +inf, and not every one -inf."""
    top = x.max()  # NaN if any is NaN
    return bool(np.isfinite(top))
