"""Sampling where the logits are, and the step tag that says what each decode step feeds and samples.

A decode step's next token is sampled by the stage that computes the logits (the *sampling stage*)
and goes from there straight to the stage that reads the token input (the *token stage*) over the
pipeline's feedback edge, as vLLM's pipeline-parallel ranks do: a sequence's cycle is K stage times
plus K hops. Through the driver it was K + 1 hops plus the driver's turnaround, so that S = K
sequences could not keep K stages busy (docs/generation.md). The driver still gets every token
(for streaming, stop tokens and the results) but is off the token's path: it submits a sequence's
next step *before* its token is known, naming the micro-batch whose sample it is.

The step tag, the synthetic entry `__step__` (int64 [5 + 3 B] for a bundle of batch B: a
micro-batch is one decode step of a *static batch* of B sequences, one per row, all at the same
position), rides with every micro-batch to the token stage and the sampling stage:

    [from_seq, seed, top_k, temperature as float64 bits, feed_next,
     then for each row: seq_index, token_index, fed]

- `from_seq` >= 0: the rows marked `fed` take the tokens sampled from micro-batch `from_seq` (the
  same rows' previous step, fed back) in place of the driver's; -1: every row takes the token input
  the driver sent (a prompt token, a replayed one, or padding for a row that has finished).
- `token_index` >= 0: sample the row's sequence's `token_index`-th generated token. The generator
  is keyed by (seed, seq_index, token_index), not carried from draw to draw, so a draw does not
  depend on which process makes it, on a restart, on how sequences interleave, or on the row and
  batch a sequence runs in. -1: the row's next token is known (a prompt step, a step replayed to
  rebuild caches, a finished or empty row): nothing is drawn and 0 is sent.
- `feed_next` 1: send the draws on the feedback edge too, because the rows' next step may be
  submitted before this one completes (the driver decides when it submits this one). 0: the next
  step will be fed by the driver, and the feedback edge stays quiet (with 2K micro-batches in flight
  the window holds one step per batch, and a frame nobody takes would cost both ends a wake-up).

The sampled tokens travel as the synthetic entry `__token__` (int64 [B]) to the driver and on the
feedback edge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tvmpipe.core.errors import TvmpipeError
from tvmpipe.executor.program import EntrySpec

STEP_NAME = "__step__"
TOKEN_NAME = "__token__"
FROM, SEED, TOP_K, TEMPERATURE, FEED_NEXT = range(5)  # the step tag's head, then ROW ints per row
HEAD = 5
ROW = 3  # seq_index, token_index, fed
FED = slice(HEAD + 2, None, ROW)  # every row's `fed` flag, in a tag (array or list of ints)


def take_fed(driver_tokens: np.ndarray, fed, draws: np.ndarray, spec: EntrySpec) -> np.ndarray:
    """The token input of a step that takes fed-back draws (`spec`: [B, 1], or [B, C] for a step
    of up to C tokens a row): each row marked `fed` takes its draw as its first token (a fed row's
    only real one), the others keep the driver's. The token stage's merge, and the driver's before
    a replay."""
    if len(fed) == math.prod(spec.shape) and all(fed):  # one token a row, every row fed
        return draws.astype(spec.dtype).reshape(spec.shape)
    rows = np.array(driver_tokens, dtype=spec.dtype).reshape(len(fed), -1)  # a copy
    rows[:, 0] = np.where(np.asarray(fed, dtype=bool), draws, rows[:, 0])
    return rows.reshape(spec.shape)


def step_spec(batch: int) -> EntrySpec:
    """The `__step__` entry of a decode step of `batch` rows."""
    return EntrySpec((HEAD + ROW * batch,), "int64")


def token_spec(batch: int) -> EntrySpec:
    """The `__token__` entry: one draw per row."""
    return EntrySpec((batch,), "int64")


@dataclass(frozen=True)
class Sampling:
    """Greedy when `temperature` is 0; else softmax(logits / temperature) over the `top_k` largest
    (0: all), drawn from a generator keyed by (seed, sequence index, token index)."""

    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0

    def check(self, vocab: int) -> None:
        if not isinstance(self.temperature, (int, float)) or not np.isfinite(self.temperature) or self.temperature < 0:
            raise TvmpipeError(f"--temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise TvmpipeError(f"--top-k must be an integer >= 0, got {self.top_k!r}")
        if self.top_k > vocab:
            raise TvmpipeError(f"--top-k {self.top_k} is larger than the vocabulary ({vocab})")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 63:
            raise TvmpipeError(f"--seed must be an integer in 0..2^63-1, got {self.seed!r}")

    def pick(self, logits: np.ndarray, seq_index: int, token_index: int) -> int:
        """The `token_index`-th token of sequence `seq_index` from its logits (the last row)."""
        x = np.asarray(logits, dtype=np.float64).reshape(-1)
        if self.temperature == 0:
            return int(np.argmax(x))
        x = x / self.temperature
        if self.top_k:
            cut = np.partition(x, -self.top_k)[-self.top_k]
            x = np.where(x >= cut, x, -np.inf)
        p = np.exp(x - x.max())
        p /= p.sum()
        return int(np.random.default_rng([self.seed, seq_index, token_index]).choice(len(p), p=p))


@dataclass(frozen=True)
class RowTag:
    """One row of a step tag: whose token it draws (-1: none) and whether it takes a fed-back one."""

    seq_index: int = 0
    token_index: int = -1
    fed: bool = False


@dataclass(frozen=True)
class StepTag:
    """One micro-batch's `__step__` (see the module docstring)."""

    from_seq: int = -1
    sampling: Sampling = Sampling()
    rows: tuple[RowTag, ...] = (RowTag(),)
    feed_next: bool = False

    def encode(self) -> np.ndarray:
        return encode_step(self.from_seq, step_head(self.sampling), self.feed_next,
                           [v for r in self.rows for v in (r.seq_index, r.token_index, int(r.fed))])

    @classmethod
    def decode(cls, tag: np.ndarray) -> "StepTag":
        return cls.from_ints(np.asarray(tag, dtype=np.int64).reshape(-1).tolist())

    @classmethod
    def from_ints(cls, v: list[int]) -> "StepTag":
        """The tag from its plain ints (`encode().tolist()`, what the stages hold while they run)."""
        temperature = float(np.int64(v[TEMPERATURE]).view(np.float64)) if v[TEMPERATURE] else 0.0
        rows = tuple(RowTag(v[i], v[i + 1], bool(v[i + 2])) for i in range(HEAD, len(v), ROW))
        return cls(v[FROM], Sampling(temperature, v[TOP_K], v[SEED]), rows, bool(v[FEED_NEXT]))


def step_head(sampling: Sampling) -> tuple[int, int, int]:
    """The sampling part of a step tag's head: seed, top_k, temperature as its float64 bits."""
    temp = int(np.array([sampling.temperature], dtype=np.float64).view(np.int64)[0])
    return sampling.seed, sampling.top_k, temp


def encode_step(from_seq: int, head: tuple[int, int, int], feed_next: bool, rows: list[int]) -> np.ndarray:
    """A step tag's int64 entry from its parts (`rows`: ROW ints per row, flat); the generation
    loop builds one per step, so it takes the sampling head precomputed (step_head)."""
    return np.array([from_seq, head[0], head[1], head[2], int(feed_next), *rows], dtype=np.int64)


def no_step(batch: int) -> np.ndarray:
    """run() on a decode bundle: the driver's tokens in every row, nothing drawn."""
    return StepTag(rows=(RowTag(),) * batch).encode()


def sample_token(logits: np.ndarray, tag: list[int] | None, vocab: int, batch: int = 1) -> np.ndarray:
    """The `__token__` a step sends: each row's draw from the last `vocab` logits of its row, or 0
    where nothing is drawn. `tag` is the step tag as plain ints (`StepTag.encode().tolist()`; None:
    no tag, nothing drawn): this runs on every step, inside the sampling stage's compute, so greedy
    takes no detour."""
    out = np.zeros(batch, dtype=np.int64)
    if tag is None:
        return out
    rows = np.asarray(logits).reshape(batch, -1)
    picked = None
    for r in range(batch):
        index = tag[HEAD + ROW * r + 1]
        if index < 0:
            continue
        row = rows[r, -vocab:]
        if tag[TEMPERATURE] == 0:  # temperature 0.0 (its float64 bits): the argmax of the logits as computed
            out[r] = row.argmax()
        else:
            picked = picked or StepTag.from_ints(tag)
            out[r] = picked.sampling.pick(row, picked.rows[r].seq_index, index)
    return out
