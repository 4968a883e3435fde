"""The decode step's layout: which inputs of a decode-step bundle play which part in generation, the
synthetic entries the runtime adds beside the graph's own, and the step tag's int64 format.

The topology (who sends what), the stage worker (its part in drawing and feeding back tokens), the
executor's Stage (the slot entry), the driver (replaying fed-back tokens) and the generation
scheduler (building each step's inputs) all read it from here: it is derived once per bundle by
`slot_layout` / `decode_layout`.

Synthetic entries, numbered after the graph's last entry (n = len(graph.entries)):

    n      __slot__   int64 [1 + B]          [slot, fresh row 0, .., fresh row B-1]: every stage that
                                             keeps state (any bundle with state pairs; B = 1 without
                                             a generation section)
    n + 1  __step__   int64 [HEAD + ROW B]   the step tag, to the token stage and the sampling stage
    n + 2  __token__  int64 [B]              each row's draw: sampling stage -> driver and token stage
    n + 3  __scores__ float64 [B, SCORES]     each row's log probabilities: sampling stage -> driver

The step tag is `[from_seq, feed_next, retired, then ROW ints per row]`, a row being
`[key, token_index, fed, seed, top_k, temperature bits, top_p bits, sequence, position, token, target,
logprobs, min_p bits, presence bits, frequency bits, repetition bits, extras, min_tokens]` (floats as
their float64 bits):

- `from_seq` >= 0: the rows marked `fed` take the tokens drawn by micro-batch `from_seq` (their own
  previous step, fed back over the pipeline's feedback edge) in place of the driver's; -1: every row
  takes the token input the driver sent.
- `feed_next` 1: the sampling stage also sends its draws on the feedback edge, because the rows' next
  step may be submitted before this one completes; 0: the driver feeds the next step.
- `token_index` >= 0: the row draws its sequence's `token_index`-th generated token, from a generator
  keyed by (seed, key, token_index) (executor.sampler), so that a draw depends neither on the process
  that makes it, nor on restarts, interleaving, or the row and batch the sequence runs in; -1: nothing
  is drawn (a prompt step, a replayed step, an empty row) and 0 is sent.
- Each row carries its own sampling parameters (temperature 0: greedy), so that sequences with
  different parameters share a static batch.
- `sequence` names the row's sequence on the sampling stage, which keeps per-sequence state there
  for the penalties (executor.sampler.SequenceStates): the tokens at positions 0.. so far. `position`
  is the position of the row's (first) token this step and `token` that token when the driver knows
  it (-1: the draw fed back, which the sampling stage made itself). `retired` (head, -1: none) is a
  sequence that ended: the sampling stage drops its state. `extras` 1: the sequence's logit bias and
  stop ids were installed on the sampling stage (Pipeline.install_sampling); `min_tokens`: its stop
  ids are ruled out while it draws a token_index below it.
- `logprobs` -1: no log probabilities; k in 0..MAX_LOGPROBS: the row's scores (`__scores__`) hold the
  log probability of the token it draws, or of `target` (>= 0: the prompt's next token, for a step
  that draws nothing), and its k most likely tokens, from the raw log-softmax of the logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from tvmpipe.bundle.graph import EntrySpec, Graph
from tvmpipe.bundle.state import row_resettable, token_layout

SLOT_NAME = "__slot__"
STEP_NAME = "__step__"
TOKEN_NAME = "__token__"
SCORES_NAME = "__scores__"

# the step tag: its head, then ROW ints per row
FROM, FEED_NEXT, RETIRED = range(3)
HEAD = 3
(KEY, INDEX, FED_AT, SEED, TOP_K, TEMPERATURE, TOP_P, SEQUENCE, POSITION, FED_TOKEN, TARGET, LOGPROBS, MIN_P,
 PRESENCE, FREQUENCY, REPETITION, EXTRAS, MIN_TOKENS) = range(18)  # offsets inside a row
ROW = 18
SAMPLING_INTS = ROW - SEED  # a row's sampling, from `seed` on (Sampling.tag_ints)
MAX_LOGPROBS = 20  # top log probabilities a row may ask for (OpenAI's bound)
SCORES = 1 + 2 * MAX_LOGPROBS  # a row's scores: the token's log probability, top ids, their log probabilities
FED = slice(HEAD + FED_AT, None, ROW)  # every row's `fed` flag, in a tag (array or list of ints)


def float_bits(x: float) -> int:
    """A float64 as the int64 with the same bits (how a tag carries temperature and top_p)."""
    return int(np.array([x], dtype=np.float64).view(np.int64)[0])


def bits_float(v: int) -> float:
    return float(np.array([v], dtype=np.int64).view(np.float64)[0]) if v else 0.0


def row_ints(key: int, token_index: int, fed: bool, sampling: Sequence[int]) -> list[int]:
    """One row of a step tag; `sampling` is the row's SAMPLING_INTS from `seed` on
    (executor.sampler.Sampling.tag_ints: computed once per sequence, then its step fields set)."""
    return [key, token_index, int(fed), *sampling]


NO_SAMPLING = (0, 0, 0, float_bits(1.0), -1, 0, -1, -1, -1, 0, 0, 0, float_bits(1.0), 0, 0)  # greedy, nothing else


def encode_step(from_seq: int, feed_next: bool, rows: Sequence[int], retired: int = -1) -> np.ndarray:
    """A step tag from its parts (`rows`: ROW ints per row, flat, from row_ints)."""
    return np.array([from_seq, int(feed_next), retired, *rows], dtype=np.int64)


def no_step(batch: int) -> np.ndarray:
    """The tag of a plain run() of a decode step: the driver's tokens in every row, nothing drawn."""
    return encode_step(-1, False, row_ints(0, -1, False, NO_SAMPLING) * batch)


@dataclass(frozen=True)
class RowTag:
    """One row of a step tag, readable: whose draw it is (`key`), which generated token it draws
    (-1: none), whether it takes a fed-back token, and how it draws (temperature 0: greedy)."""

    key: int = 0
    token_index: int = -1
    fed: bool = False
    seed: int = 0
    top_k: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    sequence: int = -1
    position: int = 0
    token: int = -1
    target: int = -1
    logprobs: int = -1
    min_p: float = 0.0
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    extras: bool = False
    min_tokens: int = 0

    def ints(self) -> list[int]:
        return row_ints(self.key, self.token_index, self.fed,
                        (self.seed, self.top_k, float_bits(self.temperature), float_bits(self.top_p), self.sequence,
                         self.position, self.token, self.target, self.logprobs, float_bits(self.min_p),
                         float_bits(self.presence), float_bits(self.frequency), float_bits(self.repetition),
                         int(self.extras), self.min_tokens))

    @classmethod
    def from_ints(cls, v: Sequence[int]) -> "RowTag":
        return cls(v[KEY], v[INDEX], bool(v[FED_AT]), v[SEED], v[TOP_K], bits_float(v[TEMPERATURE]),
                   bits_float(v[TOP_P]), v[SEQUENCE], v[POSITION], v[FED_TOKEN], v[TARGET], v[LOGPROBS],
                   bits_float(v[MIN_P]), bits_float(v[PRESENCE]), bits_float(v[FREQUENCY]), bits_float(v[REPETITION]),
                   bool(v[EXTRAS]), v[MIN_TOKENS])


@dataclass(frozen=True)
class StepTag:
    """A step tag, readable (the scheduler writes the ints directly: encode_step, row_ints)."""

    from_seq: int = -1
    rows: tuple[RowTag, ...] = (RowTag(),)
    feed_next: bool = False
    retired: int = -1

    def encode(self) -> np.ndarray:
        return encode_step(self.from_seq, self.feed_next, [v for r in self.rows for v in r.ints()], self.retired)

    @classmethod
    def decode(cls, tag: Sequence[int] | np.ndarray) -> "StepTag":
        v = np.asarray(tag, dtype=np.int64).reshape(-1).tolist()
        return cls(v[FROM], tuple(RowTag.from_ints(v[i:i + ROW]) for i in range(HEAD, len(v), ROW)), bool(v[FEED_NEXT]),
                   v[RETIRED])


def take_fed(driver_tokens: np.ndarray, fed: Sequence[int], draws: np.ndarray, spec: EntrySpec) -> np.ndarray:
    """The token input of a step that takes fed-back draws (`spec`: [B, 1], or [B, C] for a step of
    up to C tokens a row): each row marked `fed` takes its draw as its first token (a fed row's only
    real one), the others keep the driver's. The token stage's merge, and the driver's before a
    replay. A negative draw (a row that drew nothing: its logits were not finite, executor.sampler)
    is fed as token 0, so that the step never indexes an embedding out of its range; that row's
    sequence has ended, and its output is not read."""
    draws = np.maximum(draws, 0)
    if len(fed) == math.prod(spec.shape) and all(fed):  # one token a row, every row fed
        return draws.astype(spec.dtype).reshape(spec.shape)
    rows = np.array(driver_tokens, dtype=spec.dtype).reshape(len(fed), -1)  # a copy
    rows[:, 0] = np.where(np.asarray(fed, dtype=bool), draws, rows[:, 0])
    return rows.reshape(spec.shape)


@dataclass(frozen=True)
class SlotLayout:
    """The slot entry of a bundle with state pairs: `entry` carries [slot, fresh per row] to every
    stage that keeps state; `rows` is the decode step's batch (1 without a generation section);
    `row_reset`: one row of a slot can be reset alone (every state's leading axis is the rows)."""

    entry: int
    rows: int
    row_reset: bool

    @property
    def spec(self) -> EntrySpec:
        return EntrySpec((1 + self.rows,), "int64")


@dataclass(frozen=True)
class DecodeLayout:
    """A decode step's inputs and outputs by role, and its synthetic entries (module docstring).

    `token`, `position`, `count` (a chunked step's count of real tokens a row, or None) are the
    graph inputs' entry ids and `*_name` their names; `logits` is the logits head's entry id.
    `batch` rows of `chunk` tokens each a step (bundle.state.token_layout)."""

    slot: SlotLayout
    step: int
    drawn: int
    scores: int
    token: int
    position: int
    count: int | None
    logits: int
    token_name: str
    position_name: str
    count_name: str | None
    batch: int
    chunk: int
    vocab_size: int
    max_context: int
    token_readers: tuple[int, ...]  # op nodes that read the token input

    @property
    def step_spec(self) -> EntrySpec:
        return EntrySpec((HEAD + ROW * self.batch,), "int64")

    @property
    def drawn_spec(self) -> EntrySpec:
        return EntrySpec((self.batch,), "int64")

    @property
    def scores_spec(self) -> EntrySpec:
        return EntrySpec((self.batch, SCORES), "float64")

    def roles(self, graph: Graph, start: int, end: int) -> tuple[int | None, int | None]:
        """What node range [start, end) does in generation: the token input's entry if it holds
        every node that reads it (the *token stage*, which takes fed-back draws in place of the
        driver's tokens), and the logits head's entry if it computes it (the *sampling stage*)."""
        reads = bool(self.token_readers) and all(start <= n < end for n in self.token_readers)
        return (self.token if reads else None,
                self.logits if start <= graph.entries[self.logits].node < end else None)


def step_rows(bundle: Any) -> tuple[int, int]:
    """(rows, tokens a row) of a decode step: from its token input ([B, 1], or [B, C] for `--chunk
    C`), or for a chunked paged step, whose tokens are packed [B * C] row after row, from its
    `q_indptr` [B + 1] (docs/paged-kv.md)."""
    g, gen = bundle.graph, bundle.generation
    shape = g.entry_of(gen.token).shape
    paged = getattr(gen, "paged", None)
    if paged is not None and paged.q_indptr is not None:
        rows = g.entry_of(paged.q_indptr).shape[0] - 1
        return rows, max(1, math.prod(shape) // rows)
    return token_layout(shape)


def slot_layout(bundle: Any) -> SlotLayout | None:
    """The slot entry of a bundle with state pairs (None without): one past the graph's entries."""
    if not bundle.state:
        return None
    g = bundle.graph
    rows = step_rows(bundle)[0] if bundle.generation is not None else 1
    reset = rows > 1 and all(row_resettable(g.entry_of(p.input).shape, rows) for p in bundle.state)
    return SlotLayout(len(g.entries), rows, reset)


def decode_layout(bundle: Any) -> DecodeLayout | None:
    """The layout of a decode-step bundle (state pairs and a generation section), else None."""
    slot = slot_layout(bundle)
    gen = bundle.generation
    if slot is None or gen is None:
        return None
    g = bundle.graph
    token = g.entry_id(g.node_index[gen.token])
    rows, chunk = step_rows(bundle)
    readers = tuple(node.index for node in g.nodes if any(r.node == g.entries[token].node for r in node.inputs))
    return DecodeLayout(
        slot=slot, step=slot.entry + 1, drawn=slot.entry + 2, scores=slot.entry + 3, token=token,
        position=g.entry_id(g.node_index[gen.position]),
        count=g.entry_id(g.node_index[gen.count]) if gen.count is not None else None,
        logits=g.head_entries[gen.logits], token_name=gen.token, position_name=gen.position,
        count_name=gen.count, batch=rows, chunk=chunk, vocab_size=gen.vocab_size, max_context=gen.max_context,
        token_readers=readers)
