"""Drawing a token from logits: the maths of sampling, run where the logits are.

A pipeline's sampling stage (the one that computes the logits) draws each row's token with
`sample_token`, reading what to draw from the step tag (bundle.decode_layout). Greedy is the argmax of
the logits as processed. The processors, in vLLM's order: the logit bias and the min_tokens mask (the
stop ids ruled out while fewer than min_tokens were drawn), a grammar's mask (executor.grammar: the
tokens a response_format cannot take next ruled out), the penalties (repetition over the prompt and
the output, as transformers' RepetitionPenaltyLogitsProcessor; frequency and presence over the output,
as OpenAI's and vLLM's), then temperature, top_k, top_p and min_p (as transformers' MinPLogitsWarper:
tokens below min_p times the top token's probability are dropped), then a draw from a generator keyed
by (seed, key, token index): a draw is the same in any process, after any restart, in any row and
batch, however sequences interleave.

Log probabilities (a row's `logprobs` k >= 0) are taken from the model's raw logits, before any
processor: the log-softmax of the logits as computed, as vLLM returns them by default. The row's
scores hold the log probability of the token it drew (or of the tag's `target`, a prompt's next token)
and its k most likely tokens, ties broken by the lower id.

The penalties need the tokens a sequence holds so far. They live here, on the sampling stage, in
`SequenceStates`, keyed by the tag's `sequence`: each step's row says its position and, where the
driver knows it, its token; the draws the stage makes are appended as it makes them. A step at
position 0 starts the sequence's tokens afresh (a new sequence, or the scheduler rebuilding caches
after a stage restart, which feeds every token again); a row whose tokens are not all known here (this
stage restarted and lost them while the sequence went on) draws `STATE_LOST`, and the scheduler feeds
the sequence again from position 0, which rebuilds them. A retired sequence's state is dropped. What a
tag cannot carry at all (a logit bias map, the stop ids min_tokens masks: `SequenceExtras`) the
scheduler installs before the sequence's first step (Pipeline.install_sampling); a row whose extras
this stage does not hold (it restarted since) draws STATE_LOST too, and the scheduler installs them
again before it feeds the sequence again.

What one request asks can never fail the step it shares with others: a temperature below
`GREEDY_BELOW` (1e-5, vLLM's floor) draws greedily, since dividing by it would overflow the logits,
and a row whose logits are not finite (NaN or +inf: a model that overflowed on this sequence's
input) draws no token but `NOT_FINITE`, which the generation layer reads as that sequence's error.
Nothing is raised on a row's account: an exception would fail the whole step, which the driver
would take for a broken stage.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from tvmpipe.bundle.decode_layout import (EXTRAS, FED_TOKEN, FREQUENCY, HEAD, INDEX, KEY, LOGPROBS, MAX_LOGPROBS,
                                          MIN_P, MIN_TOKENS, POSITION, PRESENCE, REPETITION, RETIRED, ROW, SCORES,
                                          SEED, SEQUENCE, TARGET, TEMPERATURE, TOP_K, TOP_P, bits_float, float_bits)
from tvmpipe.core.errors import FieldError

GREEDY_BELOW = 1e-5  # a temperature below this draws greedily (vLLM's _SAMPLING_EPS)
NOT_FINITE = -1  # the draw of a row whose logits hold NaN or +inf: its sequence ends with an error
STATE_LOST = -2  # the draw of a row whose tokens this stage no longer holds: the scheduler feeds them again
GRAMMAR_ERROR = -3  # the draw of a row whose grammar allows no token: its sequence ends with an error
MAX_SEED = 2 ** 63
KEPT_SEQUENCES = 4096  # sequences whose tokens a sampling stage keeps at most (the least recent dropped)


@dataclass(frozen=True)
class Sampling:
    """How a sequence draws its tokens: greedy when `temperature` is 0."""

    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

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
        m = self.min_p
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not np.isfinite(m) or not 0 <= m <= 1:
            raise FieldError("min_p", f"must be a number in [0, 1], got {m!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or not -2 <= v <= 2:
                raise FieldError(name, f"must be a number in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not np.isfinite(r) or not 0 < r <= 100:
            raise FieldError("repetition_penalty", f"must be a number in (0, 100], got {r!r}")
        return self

    @property
    def penalized(self) -> bool:
        """Whether a draw depends on the tokens so far (kept on the sampling stage: SequenceStates)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        """Whether this draws the argmax: temperature 0, or one so small that dividing by it would
        overflow the logits (GREEDY_BELOW)."""
        return self.temperature < GREEDY_BELOW

    def tag_ints(self, sequence: int = -1, logprobs: int = -1, extras: bool = False, min_tokens: int = 0) -> list[int]:
        """This sampling as a step tag row's ints from `seed` on (decode_layout.SAMPLING_INTS), for
        sequence `sequence` asking `logprobs` (-1: none), with `extras` installed on the sampling
        stage; position, token and target are the step's (the scheduler sets them)."""
        return [self.seed, self.top_k, float_bits(float(self.temperature)), float_bits(float(self.top_p)), sequence,
                0, -1, -1, logprobs, float_bits(float(self.min_p)), float_bits(float(self.presence_penalty)),
                float_bits(float(self.frequency_penalty)), float_bits(float(self.repetition_penalty)), int(extras),
                min_tokens]

    @classmethod
    def from_row(cls, row: list[int]) -> "Sampling":
        """The sampling of one step tag row (ROW ints)."""
        return cls(bits_float(row[TEMPERATURE]), row[TOP_K], row[SEED], bits_float(row[TOP_P]), bits_float(row[MIN_P]),
                   bits_float(row[PRESENCE]), bits_float(row[FREQUENCY]), bits_float(row[REPETITION]) or 1.0)

    def penalize(self, logits: np.ndarray, seen: np.ndarray | None, output: np.ndarray | None) -> np.ndarray:
        """The logits after the penalties (float64): repetition over `seen` (prompt and output
        tokens), frequency and presence over `output` (the generated tokens)."""
        x = np.array(logits, dtype=np.float64).reshape(-1)
        if self.repetition_penalty != 1 and seen is not None and len(seen):
            ids = np.unique(seen)
            v = x[ids]
            x[ids] = np.where(v < 0, v * self.repetition_penalty, v / self.repetition_penalty)
        if (self.frequency_penalty or self.presence_penalty) and output is not None and len(output):
            counts = np.bincount(output, minlength=len(x))[:len(x)]
            x -= self.frequency_penalty * counts + self.presence_penalty * (counts > 0)
        return x

    def pick(self, logits: np.ndarray, key: int, token_index: int) -> int:
        """The `token_index`-th token of the sequence keyed `key`, from its (penalized) logits;
        NOT_FINITE when they hold NaN or +inf (-inf is a token ruled out, and fine while one token
        is not)."""
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
        if self.min_p > 0:
            p = np.where(p >= self.min_p * p.max(), p, 0.0)  # the top token always stays
            p /= p.sum()
        return int(np.random.default_rng([self.seed, key, token_index]).choice(len(p), p=p))


@dataclass(frozen=True)
class SequenceExtras:
    """What a sequence's draws need beyond its tag, installed on the sampling stage once: its logit
    bias (token ids and the values added to their logits), the stop ids that min_tokens rules out,
    and the grammar its output follows (llguidance's, executor.grammar; the stage's tokenizer for it
    is installed once, SequenceStates.set_tokenizer)."""

    bias_ids: tuple[int, ...] = ()
    bias: tuple[float, ...] = ()
    stop_ids: tuple[int, ...] = ()
    grammar: str | None = None

    def apply(self, logits: np.ndarray, token_index: int, min_tokens: int) -> np.ndarray:
        """The logits (float64, a copy) with the bias added and, below min_tokens, the stop ids ruled out."""
        x = np.array(logits, dtype=np.float64).reshape(-1)
        if self.bias_ids:
            np.add.at(x, list(self.bias_ids), self.bias)
        if token_index < min_tokens and self.stop_ids:
            x[list(self.stop_ids)] = -np.inf
        return x


class SequenceStates:
    """The tokens of each sequence that needs them for its penalties, on the sampling stage, keyed
    by the tag's `sequence` (module docstring): `tokens[s]` holds positions 0.. of sequence s as
    far as this stage knows them (a draw at token index i after n of them: the prompt is the first
    n - i). At most
    KEPT_SEQUENCES are kept (the least recently used dropped: one dropped while it runs draws
    STATE_LOST once and is fed again)."""

    def __init__(self, kept: int = KEPT_SEQUENCES):
        self.kept = kept
        self.tokens: OrderedDict[int, list[int]] = OrderedDict()
        self.extras: OrderedDict[int, SequenceExtras] = OrderedDict()
        self.constrained: dict[int, Any] = {}  # sequence -> its grammar's matcher (executor.grammar.Constrained)
        self.tokenizer: Any = None  # llguidance's, for grammars (set_tokenizer)

    def retire(self, sequence: int) -> None:
        self.tokens.pop(sequence, None)
        self.extras.pop(sequence, None)
        self.constrained.pop(sequence, None)

    def install(self, sequence: int, extras: SequenceExtras) -> bool:
        """Sequence `sequence`'s extras (from the control plane, before its first step); False,
        installing nothing, when they hold a grammar and this stage has no tokenizer for it yet."""
        if extras.grammar is not None and self.tokenizer is None:
            return False
        self.extras[sequence] = extras  # from the control thread: no iteration the compute thread could break
        self.constrained.pop(sequence, None)
        while len(self.extras) > self.kept:
            oldest, _ = self.extras.popitem(last=False)
            self.tokens.pop(oldest, None)
            self.constrained.pop(oldest, None)
        return True

    def set_tokenizer(self, tokenizer_json: str, vocab: int, eos: Sequence[int]) -> None:
        from tvmpipe.executor.grammar import make_tokenizer

        self.tokenizer = make_tokenizer(tokenizer_json, vocab, eos)

    def matcher(self, sequence: int, grammar: str) -> Any:
        c = self.constrained.get(sequence)
        if c is None:
            from tvmpipe.executor.grammar import Constrained

            c = self.constrained[sequence] = Constrained(self.tokenizer, grammar)
        return c

    def at(self, sequence: int, position: int, token: int) -> list[int] | None:
        """Sequence `sequence`'s tokens up to and including `position`, whose token is `token`
        (-1: one this stage drew); None when they are not all known here."""
        if position == 0:
            self.tokens.pop(sequence, None)
            if token < 0:
                return None
            held = self.tokens[sequence] = [token]
        else:
            held = self.tokens.get(sequence)
            if held is None or len(held) < position or (len(held) == position and token < 0):
                return None
            self.tokens.move_to_end(sequence)
            del held[position + 1:]  # drawn by a step that was lost: drawn again below
            if len(held) == position:
                held.append(token)
            elif token >= 0:
                held[position] = token
        while len(self.tokens) > self.kept:
            self.retire(next(iter(self.tokens)))
        return held

    def drew(self, sequence: int, token: int) -> None:
        """This stage drew `token`, the sequence's next one after the tokens it holds."""
        held = self.tokens.get(sequence)
        if held is not None:
            held.append(token)


def sample_token(logits: np.ndarray, tag: list[int] | None, vocab: int, batch: int = 1,
                 states: SequenceStates | None = None, scores: np.ndarray | None = None) -> np.ndarray:
    """The `__token__` a step sends: each row's draw from the last `vocab` logits of its row, or 0
    where nothing is drawn. `tag` is the step tag as plain ints (None: nothing drawn). `states`: the
    sampling stage's SequenceStates (the penalties' tokens); `scores` ([batch, SCORES], filled with
    NaN by the caller): where a row asks for log probabilities, they are written there. This runs
    on every step inside the sampling stage's compute, so a plain greedy row takes no detour."""
    out = np.zeros(batch, dtype=np.int64)
    if tag is None:
        return out
    if states is not None and tag[RETIRED] >= 0:
        states.retire(tag[RETIRED])
    rows = np.asarray(logits).reshape(batch, -1)
    for r in range(batch):
        at = HEAD + ROW * r
        index = tag[at + INDEX]
        want = tag[at + LOGPROBS]
        penalized = not (tag[at + PRESENCE] == 0 and tag[at + FREQUENCY] == 0 and tag[at + REPETITION] in (0, ONE_BITS))
        plain = not penalized and not tag[at + EXTRAS]
        held = None
        if not plain and states is not None and tag[at + SEQUENCE] >= 0:  # every step: the tokens so far
            held = states.at(tag[at + SEQUENCE], tag[at + POSITION], tag[at + FED_TOKEN])
        if index < 0:  # nothing drawn; a prompt step may score the prompt's next token
            if want >= 0 and tag[at + TARGET] >= 0 and scores is not None:
                score_into(scores[r], rows[r, -vocab:], tag[at + TARGET], want)
            continue
        row = rows[r, -vocab:]
        if plain and tag[at + TEMPERATURE] == 0:  # temperature 0.0 (its float64 bits): the argmax as computed
            out[r] = row.argmax() if finite_enough(row) else NOT_FINITE
        elif plain:
            out[r] = Sampling.from_row(tag[at:at + ROW]).pick(row, tag[at + KEY], index)
        else:
            extras = states.extras.get(tag[at + SEQUENCE]) if tag[at + EXTRAS] and states is not None else None
            grammar = extras.grammar if extras is not None else None
            if (held is None and (penalized or grammar is not None)) or (tag[at + EXTRAS] and extras is None):
                out[r] = STATE_LOST  # this stage lost what the row needs: the scheduler feeds it again
                continue
            sampling = Sampling.from_row(tag[at:at + ROW])
            x = extras.apply(row, index, tag[at + MIN_TOKENS]) if extras is not None else row
            constrained = None
            if grammar is not None:
                constrained = states.matcher(tag[at + SEQUENCE], grammar)
                allowed = constrained.allowed(len(x)) if constrained.sync(held[len(held) - index:]) else None
                if allowed is None or not allowed.any():
                    out[r] = GRAMMAR_ERROR
                    continue
                x = np.where(allowed, x, -np.inf)
            if penalized:
                tokens = np.asarray(held, dtype=np.int64)
                x = sampling.penalize(x, tokens, tokens[len(held) - index:])  # the output: after the prompt
            out[r] = sampling.pick(x, tag[at + KEY], index)
            if out[r] >= 0 and held is not None:
                states.drew(tag[at + SEQUENCE], int(out[r]))
                if constrained is not None:
                    constrained.take(int(out[r]))
        if want >= 0 and scores is not None and out[r] >= 0:
            score_into(scores[r], row, int(out[r]), want)
    return out


ONE_BITS = float_bits(1.0)


def score_into(dest: np.ndarray, logits: np.ndarray, token: int, k: int) -> None:
    """`dest` (SCORES floats) := the log probability of `token` and the `k` most likely tokens (ids,
    then their log probabilities; ties: the lower id first), from the raw log-softmax of `logits`;
    left NaN where the logits are not finite (their sequence ends with an error)."""
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    if not finite_enough(x) or not 0 <= token < len(x):
        return
    m = x.max()
    lp = x - (m + np.log(np.exp(x - m).sum()))
    dest[0] = lp[token]
    k = min(k, MAX_LOGPROBS, len(x))
    if k > 0:
        top = np.argpartition(-lp, k - 1)[:k] if k < len(x) else np.arange(len(x))
        top = top[np.lexsort((top, -lp[top]))]
        dest[1:1 + k] = top
        dest[1 + MAX_LOGPROBS:1 + MAX_LOGPROBS + k] = lp[top]


def no_scores(batch: int) -> np.ndarray:
    """The `__scores__` of a step before any row's are written: NaN everywhere."""
    return np.full((batch, SCORES), np.nan)


def finite_enough(x: np.ndarray) -> bool:
    """Logits a token can be drawn from: no NaN, no +inf, and not every one -inf."""
    top = x.max()  # NaN if any is NaN
    return bool(np.isfinite(top))
