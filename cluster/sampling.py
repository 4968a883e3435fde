"""Sampling where the logits are, and the step tag that says what each decode step feeds and samples.

A decode step's next token is sampled by the stage that computes the logits (the *sampling stage*)
and goes from there straight to the stage that reads the token input (the *token stage*) over the
pipeline's feedback edge, as vLLM's pipeline-parallel ranks do: a sequence's cycle is K stage times
plus K hops. Through the driver it was K + 1 hops plus the driver's turnaround, so that S = K
sequences could not keep K stages busy (docs/generation.md). The driver still gets every token
(for streaming, stop tokens and the results) but is off the token's path: it submits a sequence's
next step *before* its token is known, naming the micro-batch whose sample it is.

The step tag, the synthetic entry `__step__` (int64 [7]), rides with every micro-batch to the
token stage and the sampling stage:

    [from_seq, seed, seq_index, token_index, top_k, temperature as float64 bits, feed_next]

- `from_seq` >= 0: the step's token is the one sampled from micro-batch `from_seq` (an earlier
  micro-batch of the same sequence, fed back); -1: the token input the driver sent.
- `token_index` >= 0: sample the sequence's `token_index`-th generated token. The generator is
  keyed by (seed, seq_index, token_index), not carried from draw to draw, so a draw does not depend
  on which process makes it, on a restart, or on how sequences interleave. -1: the next token is
  known (a prompt step, or a step replayed to rebuild caches): nothing is drawn and 0 is sent.
- `feed_next` 1: send the draw on the feedback edge too, because the sequence's next step may be
  submitted before this one completes (the driver decides when it submits this one). 0: the next
  step will be fed by the driver, and the feedback edge stays quiet (with 2K sequences in flight the
  window holds one step per sequence, and a frame nobody takes would cost both ends a wake-up).

The sampled token travels as the synthetic entry `__token__` (int64 [1]) to the driver and on the
feedback edge.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tvmpipe.core.errors import TvmpipeError
from tvmpipe.executor.program import EntrySpec

STEP_NAME = "__step__"
STEP_SPEC = EntrySpec((7,), "int64")
TOKEN_NAME = "__token__"
TOKEN_SPEC = EntrySpec((1,), "int64")


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
class StepTag:
    """One micro-batch's `__step__` (see the module docstring)."""

    from_seq: int = -1
    sampling: Sampling = Sampling()
    seq_index: int = 0
    token_index: int = -1
    feed_next: bool = False

    def encode(self) -> np.ndarray:
        s = self.sampling
        temp = np.array([s.temperature], dtype=np.float64).view(np.int64)[0]
        return np.array([self.from_seq, s.seed, self.seq_index, self.token_index, s.top_k, temp,
                         int(self.feed_next)], dtype=np.int64)

    @classmethod
    def decode(cls, tag: np.ndarray) -> "StepTag":
        return cls.from_ints(np.asarray(tag, dtype=np.int64).reshape(-1).tolist())

    @classmethod
    def from_ints(cls, v: list[int]) -> "StepTag":
        """The tag from its plain ints (`encode().tolist()`, what the stages hold while they run)."""
        temperature = float(np.int64(v[5]).view(np.float64)) if v[5] else 0.0
        return cls(v[0], Sampling(temperature, v[4], v[1]), v[2], v[3], bool(v[6]))


NO_STEP = StepTag().encode()  # run() on a decode bundle: the driver's token, nothing drawn


def sample_token(logits: np.ndarray, tag: list[int] | None, vocab: int) -> np.ndarray:
    """The `__token__` a step sends: its draw from the last row of `logits`, or 0 when nothing is
    drawn. `tag` is the step tag as plain ints (`StepTag.encode().tolist()`; None: no tag): this
    runs on every step, inside the sampling stage's compute, so greedy takes no detour."""
    if tag is None or tag[3] < 0:
        return np.zeros(1, dtype=np.int64)
    row = np.asarray(logits).reshape(-1)[-vocab:]
    if tag[5] == 0:  # temperature 0.0 (its float64 bits): the argmax of the logits as computed
        return np.array([row.argmax()], dtype=np.int64)
    t = StepTag.from_ints(tag)
    return np.array([t.sampling.pick(row, t.seq_index, t.token_index)], dtype=np.int64)
