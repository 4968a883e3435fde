"""The scheduler: continuous batching of sequences over a pipeline whose stages keep their KV caches.

It sits above the driver and talks to it only through `Pipeline`'s public verbs: `submit` a step,
`receive` the next completed one with its draws, `in_flight` / `window` for room, `state_losses` to
learn that a stage holding caches restarted. Each step's inputs follow the decode-step layout
(bundle.decode_layout); the driver holds no generation state.

Each micro-batch is one decode step of a *group*: one sequence, or for a bundle compiled with
`--batch B` a static batch of B sequences, one per row, each at its own position, in one slot. The
driver feeds the step's positions, the slot ([slot, fresh per row]) and the step tag; the stages read
and write that slot's caches where they are, and only hidden states cross stages. The stage that
computes the logits draws the next tokens and sends them straight to the stage that reads tokens
(the feedback edge), so the scheduler submits a group's next step as soon as the previous one is in
flight, naming the micro-batch whose draws it takes. The driver also gets every draw, for streaming
and stopping; a step submitted after a sequence stopped is wasted for that row.

- Prompts go in token by token, or up to C tokens a step for a step compiled with `--chunk C`
  (chunked prefill), and a prompt's steps do not wait for each other: every stage runs micro-batches
  in submission order, so step p + 1 of a slot always sees step p's cache.
- Several groups are in flight (up to `in_flight` sequences, rounded up to whole groups, at most the
  pipeline's slots): while one waits for its draws, the others keep every stage busy. When a row's
  sequence finishes, the next queued request takes that row at position 0 in the group's next step,
  which resets that row of the slot's caches only (per-row admission, where every cache has the rows
  as its leading axis; SlotLayout.row_reset); otherwise the row idles until the whole group ends and
  the next requests take its slot.
- Requests arrive at any time (`add`) and can be given up (`cancel`): the row is freed at the next
  step, and the steps of that row still in flight are ignored.
- The scheduler decides and the engine core does the I/O: `schedule(next_seq, room)` returns the
  steps to submit (a list of `PlannedStep`: each step's inputs and the sequence number it will get), and
  `update(result)` takes the oldest step's `StepResult` back and returns the tokens it drew.
- Faults. The pipeline replays nothing of a decode step (replay="none"): a step cut off by a fault
  comes back `lost`. The scheduler owns every sequence's tokens (prompt + generated, its `hist`),
  so it is the one that feeds them again: a group whose step was lost rolls each row back to the
  position after its last step that came back, and feeds from there (the caches up to that point
  are intact; what the lost steps wrote is written again with the same values). When a stage
  holding caches restarted (`state_losses` moves), every group rebuilds its caches from position 0.
  Tokens already generated are kept, not drawn again, so the streams equal those of a run without
  the fault. Results of steps submitted before a group rolled back are ignored (its `epoch`).
- A paged step (bundle `generation.paged`, docs/paged-kv.md): one PagePool (generation.pages) is
  every stage's page table. A queued request takes a row only when the pool can hold its tokens
  so far and the next (else it waits at the head of the queue), sharing the cached pages of its
  prompt's leading full pages (its first step starts after them; not for a row the sampling stage
  sees a token at a time); before a step each row's pages grow to what the step writes, and when
  the pool runs out the most recently admitted sequences are preempted: freed, queued again at
  the head, and recomputed from their tokens so far (vLLM V1's default; nothing is drawn twice).
  Each step carries its table, position map and row lengths (step_pages); a step that comes back
  confirms its tokens (full pages become shareable), a sequence that ends frees its pages (full
  ones stay cached, least recently freed evicted first), a restarted stage's cached pages are
  forgotten and the held ones rewritten by the replay. Rows are admitted one at a time (nothing
  to reset: rows reach their own pages).
- Failure isolation. A row whose logits were not finite (its draw is executor.sampler.NOT_FINITE)
  ends alone with FinishReason.ERROR. A step that raised comes back with its `error`: the group
  rolls back and tries once more; an error that comes back on that retry belongs to the group's
  sequences, which end with ERROR, and every other sequence runs on.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tvmpipe.bundle.decode_layout import (FED_TOKEN, LOGPROBS, MAX_LOGPROBS, NO_SAMPLING, POSITION, SEED, SLOT_NAME,
                                          STEP_NAME, TARGET, encode_step, row_ints)
from tvmpipe.core.errors import FieldError, TvmpipeError
from tvmpipe.executor.sampler import GRAMMAR_ERROR, NOT_FINITE, STATE_LOST, SequenceExtras
from tvmpipe.generation.pages import PagePool, RowWrite, grow_all, step_pages
from tvmpipe.generation.requests import FinishReason, Logprob, Request, SequenceResult, TokenEvent, layout_of

if TYPE_CHECKING:
    from tvmpipe.cluster.driver import Pipeline, StepResult

EMPTY_ROW = row_ints(0, -1, False, NO_SAMPLING)  # padding at position 0: nothing fed back or drawn
_POS, _TOK, _TARGET, _LP = POSITION - SEED, FED_TOKEN - SEED, TARGET - SEED, LOGPROBS - SEED  # in _Row.sampling
FED_FROM_KEPT = 4096  # steps whose fed-back source is remembered for the timeline (fed_from)


@dataclass(frozen=True)
class PlannedStep:
    """One micro-batch to submit: the sequence number the pipeline gives it (steps are submitted in
    plan order) and its inputs by name."""

    seq: int
    inputs: dict[str, np.ndarray]


class _Row:
    """One sequence of a group: its request and result, every token fed or to feed (prompt, then
    generated), the position its next step feeds, and the position after its last step that came
    back (where it rolls back to when later steps are lost)."""

    def __init__(self, index: int, request: Request, now: float):
        self.request = request
        self.r = SequenceResult(index, list(request.prompt))
        self.hist = list(request.prompt)
        self.pos = 0
        self.confirmed = 0
        self.admitted = now
        # the step tag's per-row sampling, made once (each step sets its position, token, target)
        # what its tag cannot carry: installed on the sampling stage before its first step
        self.extras = (SequenceExtras(tuple(t for t, _ in request.logit_bias), tuple(v for _, v in request.logit_bias),
                                      tuple(sorted(request.stop_tokens)) if request.min_tokens else (), request.grammar)
                       if request.logit_bias or request.min_tokens or request.grammar is not None else None)
        self.sampling = request.sampling.tag_ints(index, -1 if request.logprobs is None else request.logprobs,
                                                  self.extras is not None, request.min_tokens)
        self.stateful = request.sampling.penalized or self.extras is not None  # state on the sampling stage
        self.scores_prompt = request.prompt_logprobs is not None
        if self.scores_prompt:
            self.r.prompt_logprobs = [None] * len(request.prompt)
        # one token a step: the sampling stage sees each position (penalties) or scores each (echo)
        self.narrow = self.stateful or self.scores_prompt


class _Group:
    """The sequences of one static batch, one per row (None: an empty row), in one slot; every step
    of the group is one micro-batch that advances each running row by its own width."""

    def __init__(self, rows: list[_Row | None], slot: int, losses: int):
        self.rows = rows
        self.key = next(x.r.index for x in rows if x is not None)  # its first sequence's index
        self.slot = slot
        self.losses = losses  # the pipeline's state_losses when its caches were (re)started
        self.epoch = 0  # moves when it rolls back or rebuilds: results of older steps are ignored
        self.outstanding = 0  # its steps in flight
        self.queued = False  # in the scheduler's ready queue
        self.last: tuple[int, int, bool] | None = None  # (micro-batch, epoch, draws fed back) of its latest step
        self.running = [(i, x) for i, x in enumerate(rows) if x is not None]  # (row, sequence) not finished
        self.strikes = 0  # failed steps not yet passed by a step that came back
        self.failed_at = -1  # the furthest position of the step that failed


class _Step:
    """A submitted micro-batch: its group, per running row (row, sequence, the position after the
    step's last token), the group's epoch it was submitted in, and the pipeline's state_losses when
    it was planned."""

    __slots__ = ("group", "carried", "epoch", "seq", "losses")

    def __init__(self, group: _Group, carried: list[tuple[int, _Row, int]], epoch: int, seq: int, losses: int):
        self.group, self.carried, self.epoch, self.seq, self.losses = group, carried, epoch, seq, losses


class Scheduler:
    """Continuous batching over `pipe` (a Pipeline of a decode-step bundle, replay="none").

        s = Scheduler(pipe)
        s.add(request)                                  # any time; returns the sequence's index
        for step in s.schedule(pipe.submitted, pipe.window - pipe.in_flight):
            pipe.submit(step.inputs)                    # the engine core does the pipeline's I/O
        events = s.update(pipe.receive())               # the oldest step in flight
        s.cancel(index)                                 # any time: ends a sequence early

    (generation.core.EngineCore is that loop.) `in_flight`: sequences in flight (default: all the
    slots hold); `row_admission`: a queued request takes a finished sequence's row at once where the
    caches reset a row at a time (False: a group's rows are admitted together); `logits_log`: per
    sequence, the logits of each step by position (needs a pipeline built with logits=True).
    Finished sequences go into `finished` (a queue the caller empties) and, if given, `results`
    (index -> SequenceResult).
    """

    def __init__(self, pipe: "Pipeline", *, in_flight: int | None = None, row_admission: bool = True,
                 logits_log: dict | None = None, results: dict | None = None):
        self.pipe = pipe
        self.layout = layout_of(pipe.bundle)
        if getattr(pipe, "replay", "none") != "none":
            raise TvmpipeError(f"generation needs a pipeline built with replay='none' (its default for a decode "
                               f"step), not {pipe.replay!r}: the scheduler feeds lost steps again itself")
        self.batch = self.layout.batch
        self.chunk = self.layout.chunk
        if in_flight is None:
            in_flight = pipe.slots * self.batch
        if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 1:
            raise FieldError("in_flight", f"must be an integer >= 1, got {in_flight!r}")
        self.groups = min(-(-in_flight // self.batch), pipe.slots)  # slots in use, at most
        self.paged = getattr(pipe.bundle.generation, "paged", None)
        # a paged step's pool (docs/paged-kv.md): one page table for every stage, the scheduler's
        self.pool = PagePool(self.paged.pages, self.paged.page_size) if self.paged is not None else None
        self._order: dict[int, None] = {}  # sequences holding pages, oldest admitted first (preemption)
        fed = (self.layout.token_name, self.layout.position_name, self.layout.count_name, SLOT_NAME, STEP_NAME,
               *(self.paged.inputs if self.paged is not None else ()))
        other = [n for n in pipe.topology.inputs if n not in fed]
        if other:
            raise TvmpipeError(f"the decode step also takes {', '.join(other)}, which generation does not feed")
        if logits_log is not None and pipe.topology.dropped_heads:
            raise TvmpipeError("logits_log needs the logits at the driver: this pipeline was built with logits=False")
        self.logits_log = logits_log
        self.scored = pipe.topology.sends_scores  # log probabilities come back (Pipeline(scores=True))
        self.results = results  # index -> SequenceResult of every finished sequence, if given
        self.finished: deque[SequenceResult] = deque()  # finished since the caller last took them
        # a paged step's rows reach their own pages through the table: a row is taken alone, nothing reset
        self.per_row = row_admission and (pipe.topology.row_reset or self.pool is not None)
        self.fed_back = pipe.topology.feedback is not None
        self.num_stages = pipe.topology.num_stages
        self.window = pipe.window
        specs = pipe.topology.specs
        self._tok_spec, self._pos_spec = specs[self.layout.token], specs[self.layout.position]
        if self.paged is not None:  # the table's length: entries past a step's rows' pages are never read
            self._table_specs = {n: specs[pipe.topology.inputs[n]] for n in self.paged.inputs}
            self._table_capacity = int(np.prod(self._table_specs[self.paged.values].shape))
        self._count_spec = specs[self.layout.count] if self.layout.count is not None else None
        self.queue: deque[_Row] = deque()  # admitted to the scheduler, waiting for a row
        self.active: dict[int, _Group] = {}  # by group key
        self.free = list(range(self.groups))[::-1]  # slots no group holds
        self.steps: deque[_Step] = deque()  # micro-batches in flight, in submission order
        # Groups with a step to submit (known tokens not yet fed, draws in flight to feed forward, or
        # caches to rebuild), round robin: each step costs O(1) however many groups are in flight
        self.ready: deque[_Group] = deque()
        self.fed_from: dict[int, int] = {}  # step -> the micro-batch whose draws it took (timeline)
        self._rows: dict[int, tuple[_Group | None, _Row]] = {}  # index -> where the sequence is, until it ends
        self.retired: deque[int] = deque()  # ended sequences whose state the sampling stage may hold
        self.installs: deque[tuple[int, SequenceExtras]] = deque()  # to install before the next steps (EngineCore)
        self._next_index = 0
        self._seen_losses = pipe.state_losses

    # ---- the caller's verbs ------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Whether any sequence is queued or running."""
        return bool(self.queue or self.active)

    @property
    def running(self) -> int:
        """Sequences in a row of the pipeline now."""
        return sum(len(g.running) for g in self.active.values())

    def add(self, request: Request, index: int | None = None) -> int:
        """Queue a checked request (requests.Request); returns its sequence index (`index`, or the
        next free one)."""
        index = self._next_index if index is None else index
        if (request.logprobs is not None or request.prompt_logprobs is not None) and not self.scored:
            raise TvmpipeError("log probabilities need a pipeline whose sampling stage sends them: this one was built "
                               "with scores=False")
        if index in self._rows:
            raise TvmpipeError(f"sequence {index} is already queued or running")
        self._next_index = max(self._next_index, index + 1)
        row = _Row(index, request, time.time())
        if row.extras is not None:
            self.installs.append((index, row.extras))
        self.queue.append(row)
        self._rows[index] = (None, row)
        return index

    def cancel(self, index: int, why: FinishReason = FinishReason.CANCELLED,
               error: str | None = None) -> SequenceResult | None:
        """End sequence `index` now (its result keeps the tokens so far): a queued one leaves the
        queue, a running one frees its row at the group's next step. Its result; None if unknown or
        finished already."""
        where = self._rows.get(index)
        if where is None:
            return None
        g, x = where
        if g is None:
            self.queue.remove(x)
            self._end(x, why, error)
        else:
            i = next(i for i, y in g.running if y is x)
            self._finish(g, i, x, why, time.time(), error)
        return x.r

    def cancel_all(self, why: FinishReason = FinishReason.CANCELLED, error: str | None = None) -> None:
        """End every queued and running sequence (a drain that timed out, a failed pipeline)."""
        for index in list(self._rows):
            self.cancel(index, why, error)

    def schedule(self, next_seq: int, room: int) -> list[PlannedStep]:
        """Admit queued requests into free slots, then plan up to `room` steps, the first of which
        the pipeline will number `next_seq` (the engine submits them in this order)."""
        self._admit()
        self._notice_restarts()
        return self._plan(next_seq, room)

    def update(self, result: "StepResult") -> list[TokenEvent]:
        """The oldest step in flight came back: the tokens it drew (its rows' sequences that ended
        go into `finished`)."""
        step = self.steps.popleft()
        if step.seq != result.seq:
            raise TvmpipeError(f"the pipeline returned micro-batch {result.seq} where the scheduler expected {step.seq}")
        g = step.group
        g.outstanding -= 1
        if self.active.get(g.key) is not g:  # finished while a stale or wasted step was in flight
            if g.outstanding == 0:
                self.free.append(g.slot)
            return []
        if step.epoch != g.epoch:
            return []  # submitted before the group rolled back or rebuilt
        if step.losses != self.pipe.state_losses:  # planned before a stage lost its caches: it may have been
            self._want(g)                           # computed on the fresh stage's empty ones; the group rebuilds
            return []
        if result.lost:
            self._lost(g, step, result.error)
            return []
        return self._receive(g, step, result)

    # ---- admission ----------------------------------------------------------------------------------
    def _admit(self) -> None:
        """Queued requests take free slots, up to B rows a group; with a paged step, first the empty
        rows of running groups (rows preempted or left empty while the pool was full), and only
        as far as the pool can hold each one's tokens so far (it waits at the head of the queue)."""
        if self.pool is not None and self.per_row:
            now = time.time()
            for g in list(self.active.values()):
                for i, y in enumerate(g.rows):
                    if y is None and self._next_fits():
                        self._place(g, i, now)
        while self.queue and self.free and self._next_fits():
            now = time.time()
            rows: list[_Row | None] = []
            while len(rows) < self.batch and self.queue and self._next_fits():
                rows.append(self.queue.popleft())
                if self.pool is not None:
                    self._reserve(rows[-1])
            g = _Group(rows + [None] * (self.batch - len(rows)), self.free.pop(), self.pipe.state_losses)
            for x in rows:
                x.admitted = now
                self._rows[x.r.index] = (g, x)
            self.active[g.key] = g
            self._want(g)

    def _next_fits(self) -> bool:
        """Whether the queue's head can take a row now: always with static caches; with a paged
        step, when the pool can hold its tokens so far and the next (else it waits for pages to
        free: a valid bundle's pool holds a row at the max context, so it never waits for ever)."""
        if not self.queue:
            return False
        if self.pool is None:
            return True
        x = self.queue[0]
        return self.pool.can_reserve(min(len(x.hist) + 1, self.layout.max_context), self._shareable(x))

    def _shareable(self, x: _Row) -> list[int]:
        """The tokens whose cached pages `x` may share: its prompt (and tokens generated before a
        preemption); none for a row the sampling stage sees a token at a time (it scores or
        penalizes each position, so every position is fed)."""
        return [] if x.narrow else x.hist

    def _reserve(self, x: _Row) -> None:
        """x's pages for its tokens so far, sharing the cached pages of their leading full pages:
        its first step starts after them."""
        res = self.pool.reserve(x.r.index, self._shareable(x), len(x.hist))
        if res is None:  # _next_fits said it fits: cannot happen
            raise TvmpipeError(f"sequence {x.r.index}: its KV pages could not be reserved")
        self._order[x.r.index] = None
        x.pos = x.confirmed = res.hit_tokens

    def _place(self, g: _Group, i: int, now: float) -> None:
        """The queue's head takes g's empty row i (its pages reserved first, for a paged step)."""
        y = self.queue.popleft()
        if self.pool is not None:
            self._reserve(y)
        g.rows[i] = y
        y.admitted = now
        self._rows[y.r.index] = (g, y)
        g.running.append((i, y))
        self._want(g)

    def _notice_restarts(self) -> None:
        """A stage holding caches restarted: every group rebuilds its own (_plan); a paged step's
        cached pages held nobody's K/V any more."""
        losses = self.pipe.state_losses
        if losses != self._seen_losses:
            self._seen_losses = losses
            if self.pool is not None:
                self.pool.forget_cached()
            for g in self.active.values():
                self._want(g)

    def _want(self, g: _Group) -> None:
        if not g.queued:
            g.queued = True
            self.ready.append(g)

    # ---- planning steps -----------------------------------------------------------------------------
    def _plan(self, seq: int, room: int) -> list[PlannedStep]:
        """Plan every step whose tokens are known or in flight, round robin over groups, while
        there is room. The token stage runs steps in submission order, so a step that takes the
        draws of the step just before it would hold that stage up for a whole trip round the ring:
        such a step waits until as many other steps as there are stages (or groups, if fewer) were
        submitted after its predecessor."""
        losses = self.pipe.state_losses
        spacing = min(len(self.active), self.num_stages)
        deferred, plan = [], []
        while room > 0 and self.ready:
            g = self.ready.popleft()
            g.queued = False
            if self.active.get(g.key) is not g:
                continue  # finished since it was queued
            if g.losses != losses:  # its caches were lost: rebuild them from position 0
                g.losses, g.last = losses, None
                g.epoch += 1
                for _, x in g.running:
                    x.pos = x.confirmed = 0
                    x.r.replays += 1  # (a paged step's pool forgot every sequence's K/V: _notice_restarts)
            src = self._source(g)
            if src is None:
                continue  # nothing to feed yet (queued again when its step comes back)
            if src >= 0 and seq - src < spacing:
                deferred.append(g)
                continue
            ns = self._widths(g)
            if self.pool is not None and not self._grow(g, ns):
                self._want(g)  # rows of its own were preempted or ended: planned again with the rest
                continue
            ds = self._draws(g, ns)
            fwd = self._forward(g, ns, ds)
            plan.append(PlannedStep(seq, self._feed(g, src, ns, ds, fwd)))
            if src >= 0:
                self.fed_from[seq] = src
                self.fed_from.pop(seq - FED_FROM_KEPT, None)
            self.steps.append(_Step(g, [(i, x, x.pos + ns[i]) for i, x in g.running], g.epoch, seq, losses))
            g.last = (seq, g.epoch, fwd)
            for i, x in g.running:
                x.pos += ns[i]
            g.outstanding += 1
            seq += 1
            room -= 1
            if self._source(g) is not None:
                self._want(g)  # more to feed (prompts, history, or the tokens this step draws): back of the queue
        for g in deferred:
            self._want(g)
        return plan

    def _source(self, g: _Group) -> int | None:
        """Where the tokens of g's next step come from: -1, every running row's is known; m, the
        draws of micro-batch m (g's latest step, still in flight, whose draws are fed back; a stop
        token it may draw makes the step a wasted one for that row); None: nothing to submit yet. A
        running row was in each of g's steps since it was admitted, so a row whose next token is not
        known yet draws it in g's latest step."""
        fed = False
        for _, x in g.running:
            n = len(x.hist)
            if x.pos > n:
                return None
            fed = fed or x.pos == n
        if not fed:
            return -1
        if g.last is not None and g.last[1:] == (g.epoch, True):
            return g.last[0]
        return None

    def _widths(self, g: _Group) -> list[int]:
        """Tokens each row's next step feeds: up to `chunk` of those known (a prompt goes in a chunk
        at a time, and a replayed history), else one (the draw fed back to it); 1 in a finished or
        empty row."""
        ns = [1] * self.batch
        if self.chunk > 1:
            for i, x in g.running:
                if not x.narrow:  # a row scored or penalized goes one token a step (the sampler sees each)
                    ns[i] = max(1, min(self.chunk, len(x.hist) - x.pos))
        return ns

    def _draws(self, g: _Group, ns: list[int]) -> list[int]:
        """Which generated token each row's next step draws (from its last token's logits): -1 where
        the token after the step's is known (and in a finished or empty row)."""
        ds = [-1] * self.batch
        for i, x in g.running:
            if x.pos + ns[i] >= len(x.hist) and x.request.max_new_tokens > 0:
                ds[i] = x.pos + ns[i] - len(x.r.prompt)
        return ds

    def _forward(self, g: _Group, ns: list[int], ds: list[int]) -> bool:
        """Whether g's next step, drawing `ds` (per row, -1: none), feeds its draws forward: the
        pipeline has a token stage to feed (the feedback edge), a row draws a token that cannot end
        its sequence by length or context, and the window holds two steps of every group in flight
        (with fewer, the next step could not be submitted before this one completes anyway)."""
        if self.pool is not None and self.chunk > 1:
            return False  # its tokens are packed by q_indptr: a fed-back draw's slot is not the row's own
        return (self.fed_back and 2 * len(self.active) <= self.window
                and any(0 <= ds[i] and ds[i] + 1 < x.request.max_new_tokens and x.pos + ns[i] < self.layout.max_context
                        for i, x in g.running))

    def _feed(self, g: _Group, src: int, ns: list[int], ds: list[int], fwd: bool) -> dict:
        """The step's inputs: per row its tokens (or the fed-back draw), its position, whether it
        starts a sequence (a row reset, or the whole slot's when every row starts), and its tag.
        Finished and empty rows get padding at position 0 and draw nothing."""
        batch, chunk = self.batch, self.chunk
        toks, poss, fresh, rows = [0] * (batch * chunk), [0] * batch, [0] * batch, EMPTY_ROW * batch
        width = len(EMPTY_ROW)
        packed = None
        if self.pool is not None:  # the step's pages first: a chunked paged step packs its tokens by q_indptr
            writes: list[RowWrite | None] = [None] * batch
            for i, x in g.running:
                writes[i] = RowWrite(x.r.index, x.pos, ns[i])
            pages = step_pages(self.pool, writes, chunk, self._table_capacity)
            packed = pages.q_indptr if chunk > 1 else None
        for i, x in g.running:
            n, p = len(x.hist), x.pos
            if p < n:
                at = i * chunk if packed is None else packed[i]
                toks[at:at + ns[i]] = x.hist[p:p + ns[i]]
            poss[i] = p
            fresh[i] = 1 if p == 0 else 0
            sampling = x.sampling
            if x.narrow:
                sampling[_POS] = p
                sampling[_TOK] = x.hist[p] if p < n else -1
                scored = x.scores_prompt and p + 1 < len(x.r.prompt)  # scores the prompt's next token
                sampling[_TARGET] = x.hist[p + 1] if scored else -1
                sampling[_LP] = (x.request.prompt_logprobs if scored
                                 else -1 if x.request.logprobs is None else x.request.logprobs)
            rows[width * i:width * (i + 1)] = row_ints(x.request.key, ds[i], src >= 0 and p >= n, sampling)
        if all(poss[i] == 0 for i, _ in g.running):
            fresh = [1] * batch  # the group (re)starts: the whole slot
        tok, pos, layout = self._tok_spec, self._pos_spec, self.layout
        out = {layout.token_name: np.array(toks, dtype=tok.dtype).reshape(tok.shape),
               layout.position_name: np.array(poss, dtype=pos.dtype).reshape(pos.shape),
               SLOT_NAME: np.array([g.slot] + fresh, dtype=np.int64),
               STEP_NAME: encode_step(src, fwd, rows, self.retired.popleft() if self.retired else -1)}
        if self._count_spec is not None:
            out[layout.count_name] = np.array(ns, dtype=self._count_spec.dtype).reshape(self._count_spec.shape)
        if self.pool is not None:
            for name, values in zip(self.paged.inputs, (pages.page_table_indptr, pages.page_table_values,
                                                        pages.last_page_len, pages.position_map, pages.q_indptr)):
                spec = self._table_specs[name]
                out[name] = np.array(values, dtype=spec.dtype).reshape(spec.shape)
        return out

    def _grow(self, g: _Group, ns: list[int]) -> bool:
        """Pages for every running row of g's next step (`ns` tokens each); when the pool runs out,
        the most recently admitted sequences are preempted (freed, and queued again at the head to
        be recomputed: generation.pages.grow_all). No row is unfit: a step writes at most the max
        context, which a valid bundle's pool holds (bundle.state.check_state). Whether g's rows are
        as planned (False: some of its own were preempted)."""
        growth = grow_all(self.pool, [(x.r.index, x.pos + ns[i]) for i, x in g.running], list(self._order))
        mine = {x.r.index for _, x in g.running}
        for seq in growth.preempted:
            self._preempt(seq)
        return not mine.intersection(growth.preempted)

    def _preempt(self, seq: int) -> None:
        """Sequence `seq` lost its pages to an older one (grow_all freed them): it leaves its row and
        waits at the head of the queue, its tokens kept; it is fed again from the start (or from
        the pages of its prefix still cached) when pages free, drawing nothing it drew already."""
        g, x = self._rows[seq]
        self._order.pop(seq, None)
        self._vacate(g, next(i for i, y in enumerate(g.rows) if y is x), x)
        x.pos = x.confirmed = 0
        x.r.replays += 1
        self.queue.appendleft(x)
        self._rows[seq] = (None, x)
        self._settle(g)

    # ---- steps coming back --------------------------------------------------------------------------
    def _lost(self, g: _Group, step: _Step, error: str | None) -> None:
        """g's step came back lost (a fault cut it off) or failed (`error`): roll g back to what came
        back and feed from there; a failure where a failure came back before, with no step past it
        between, ends the step's sequences (the error is theirs, not the pipeline's)."""
        if error is not None:
            furthest = max((p for _, _, p in step.carried), default=0)
            if g.strikes and furthest <= g.failed_at:
                now = time.time()
                for i, x, _ in step.carried:
                    if g.rows[i] is x:
                        self._finish(g, i, x, FinishReason.ERROR, now, f"its step failed twice: {error}")
                if self.active.get(g.key) is not g:
                    return
            else:
                g.strikes += 1
                g.failed_at = max(g.failed_at, furthest)
        g.epoch += 1
        g.last = None
        for _, x in g.running:
            x.pos = x.confirmed
        self._want(g)

    def _receive(self, g: _Group, step: _Step, result: "StepResult") -> list[TokenEvent]:
        """Rows that drew a token get it; every row of the step is confirmed up to its position."""
        live = [(i, x, p) for i, x, p in step.carried if g.rows[i] is x]  # rows whose sequence runs on
        if g.strikes and max((p for _, _, p in live), default=0) >= g.failed_at:
            g.strikes = 0  # past the step that failed: it passed on its retry
        for _, x, p in live:
            if self.pool is not None and p > x.confirmed:  # their K/V are written: full pages become shareable
                self.pool.confirm(x.r.index, x.hist[x.confirmed:p])
            x.confirmed = p
        if self.logits_log is not None:
            self._log_logits(result.outputs, live)
        scores = result.scores
        for i, x, p in live:
            if x.scores_prompt and p < len(x.r.prompt):  # this step scored prompt token p
                entry = logprob_of(scores[i], x.request.prompt_logprobs) if scores is not None else None
                if entry is None:
                    self._finish(g, i, x, FinishReason.ERROR, time.time(), "the model's logits for this sequence "
                                 f"were not finite (NaN or inf) at prompt token {p}")
                    continue
                x.r.prompt_logprobs[p] = entry
            if x.request.max_new_tokens == 0 and p == len(x.hist):  # the prompt alone was asked for (echo)
                self._finish(g, i, x, FinishReason.LENGTH, time.time())
        drew = [(i, x) for i, x, p in live if p == len(x.hist) and g.rows[i] is x]  # the others' next tokens are known
        events = []
        if drew:
            now = time.time()
            for i, x in drew:
                t = int(result.drawn[i])
                if t == STATE_LOST:  # the sampling stage lost its tokens: feed them again from position 0
                    self._rebuild(g)
                    return events
                if t == NOT_FINITE:
                    self._finish(g, i, x, FinishReason.ERROR, now, "the model's logits for this sequence were not "
                                 f"finite (NaN or inf) at generated token {len(x.r.tokens)}")
                    continue
                if t == GRAMMAR_ERROR:
                    self._finish(g, i, x, FinishReason.ERROR, now, "its grammar (response_format) allows no token "
                                 f"at generated token {len(x.r.tokens)}")
                    continue
                entry = None
                if x.request.logprobs is not None:
                    entry = logprob_of(scores[i], x.request.logprobs) if scores is not None else None
                    if entry is None:
                        self._finish(g, i, x, FinishReason.ERROR, now, "the model's logits for this sequence were "
                                     f"not finite (NaN or inf) at generated token {len(x.r.tokens)}")
                        continue
                    x.r.cumulative_logprob += entry[0]
                if x.r.first_token_s is None:
                    x.r.first_token_s = now - x.admitted
                x.r.tokens.append(t)
                x.r.token_times.append(now)
                x.hist.append(t)
                why = (FinishReason.STOP if t in x.request.stop_tokens
                       else FinishReason.LENGTH if len(x.r.tokens) >= x.request.max_new_tokens
                       else FinishReason.CONTEXT if len(x.hist) > self.layout.max_context else None)
                first = x.r.prompt_logprobs if x.scores_prompt and len(x.r.tokens) == 1 else None
                events.append(TokenEvent(x.r.index, t, len(x.r.tokens) - 1, why, entry,
                                         None if first is None else tuple(first)))
                if why:
                    self._finish(g, i, x, why, now)
        if self.active.get(g.key) is g:
            self._want(g)  # its next step's tokens are known now, or in flight
        return events

    def _rebuild(self, g: _Group) -> None:
        """Feed g's rows again from position 0, their extras installed again first (the sampling
        stage lost the state it keeps for them: a restart); tokens already drawn are kept."""
        g.epoch += 1
        g.last = None
        for _, x in g.running:
            x.pos = x.confirmed = 0
            x.r.replays += 1
            if self.pool is not None:
                self.pool.restart(x.r.index)
            if x.extras is not None:
                self.installs.append((x.r.index, x.extras))
        self._want(g)

    def _log_logits(self, outputs: list, live: list[tuple[int, _Row, int]]) -> None:
        """The logits of each live row's last token this step, by its position."""
        logits = np.asarray(outputs[self.pipe.bundle.generation.logits])
        rows_of = logits.reshape(self.batch, -1) if self.batch > 1 else None
        for i, x, p in live:
            self.logits_log.setdefault(x.r.index, {})[p - 1] = np.array(logits if rows_of is None else rows_of[i],
                                                                        copy=True)

    def _finish(self, g: _Group, i: int, x: _Row, why: FinishReason, now: float, error: str | None = None) -> None:
        """Row i's sequence ended; with per-row admission the next queued request takes the row at
        once (its first step resets that row of the slot), else the row idles until the group ends."""
        self._end(x, why, error)
        self._vacate(g, i, x)
        if self.per_row and self._next_fits():
            self._place(g, i, now)
        self._settle(g)

    @staticmethod
    def _vacate(g: _Group, i: int, x: _Row) -> None:
        """x leaves g's row i."""
        g.running = [(j, y) for j, y in g.running if y is not x]
        g.rows[i] = None

    def _settle(self, g: _Group) -> None:
        """After a row of g emptied: a group with no sequence left ends (its slot frees once its
        steps in flight are back), else its next step is planned (a row admitted, or the others go on)."""
        if not g.running:
            del self.active[g.key]
            if g.outstanding == 0:
                self.free.append(g.slot)
        else:
            self._want(g)

    def _end(self, x: _Row, why: FinishReason, error: str | None = None) -> None:
        if self.pool is not None and x.r.index in self.pool:
            self.pool.free(x.r.index)  # its full confirmed pages stay cached for a later prompt alike
            self._order.pop(x.r.index, None)
        if x.stateful:
            self.retired.append(x.r.index)  # the sampling stage drops its tokens with a later step
        x.r.finish = why
        x.r.error = error
        if self.results is not None:
            self.results[x.r.index] = x.r
        self.finished.append(x.r)
        del self._rows[x.r.index]


def logprob_of(scores, k: int) -> Logprob | None:
    """A row's scores (decode_layout's SCORES floats) as (log probability, ((id, logprob), ...) of the
    k most likely); None where they are not finite (its logits were not)."""
    lp = float(scores[0])
    if lp != lp or lp == float("inf"):
        return None
    k = min(k, MAX_LOGPROBS)
    ids = scores[1:1 + k]
    return lp, tuple(zip((int(t) for t in ids), (float(v) for v in scores[1 + MAX_LOGPROBS:1 + MAX_LOGPROBS + k])))
