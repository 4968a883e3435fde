"""The generation loop: autoregressive decoding over a pipeline whose stages keep their KV caches.

Each micro-batch is one decode step of one sequence, or of a static batch of B sequences for a
bundle compiled with `--batch B` (one per row, each at its own position: a *group*, which takes one
slot): the driver feeds the step's positions (and the group's slot, [slot, fresh per row], to every
stage holding state), the stages read and write that slot's caches where they are, and only hidden states
cross stages. The stage that computes the
logits draws the next token and sends it straight to the stage that reads tokens (sampling.py),
so the driver is off the token's path: it submits a sequence's next step as soon as the previous
one is in flight, naming the micro-batch whose token it takes. The driver gets the token too, for
streaming and stop tokens (and the logits, if the pipeline keeps them: `logits_log`); a step
submitted after a stop token is dropped.

- The prompt goes in token by token, or up to C tokens a step for a step compiled with `--chunk C`
  (chunked prefill: `widths`), and a prompt's steps do not wait for each other: every stage
  runs micro-batches in submission order, so step p+1 of a slot always sees step p's cache.
- Several groups are in flight (`in_flight` sequences, rounded up to whole groups, at most the
  pipeline's slots): while one waits for its tokens to be sampled, the others' steps keep every
  stage busy. In a group, each row feeds its own prompt token by token and then its own draws.
  When a row's sequence finishes, the next queued prompt takes that row at position 0 in the
  group's next step, which resets that row of the slot's caches only, while the other rows go on
  (continuous batching at row granularity; Topology.row_reset: every cache has the rows as its
  leading axis). Otherwise, or with no prompt queued, the row is fed padding and draws nothing;
  when all of a group's rows are done, the next queued prompts take its slot.
- Faults: when the pipeline restarts a stage that held state (`Pipeline.state_losses` moves), the
  caches of every sequence in flight are gone there. Results of steps submitted before that are
  dropped, and each sequence replays its history (prompt + tokens generated so far) from position 0
  into a fresh slot state before it continues; tokens already generated are kept, not sampled
  again, so the streams equal those of a run without the fault.
- Sampling draws each token from a generator keyed by (seed, sequence index, token index): the
  streams do not depend on how sequences interleave, how many are in flight, or on faults.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import numpy as np

from tvmpipe.cluster.sampling import ROW, STEP_NAME, Sampling, encode_step, step_head
from tvmpipe.core.errors import TvmpipeError

if TYPE_CHECKING:
    from tvmpipe.cluster.driver import Pipeline


class GenerationError(TvmpipeError):
    """A generation run ended early; `finished` holds the sequences that completed (by index)."""

    def __init__(self, message: str, finished: dict[int, "SequenceResult"] | None = None):
        self.finished = dict(finished or {})
        super().__init__(message)


@dataclass
class SequenceResult:
    """One sequence: its prompt, the tokens generated, and why it stopped ("length": max new
    tokens, "stop": a stop token (kept as the last token), "context": the cache is full)."""

    index: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    first_token_s: float | None = None  # seconds from admission to the first generated token
    token_times: list[float] = field(default_factory=list)  # wall clock of each generated token
    replays: int = 0  # times its caches were rebuilt after a stage restart

    def to_json(self) -> dict:
        return {"prompt": list(self.prompt), "tokens": list(self.tokens), "finish": self.finish}


@dataclass(frozen=True)
class TokenEvent:
    """Sequence `seq` generated `token`, its `index`-th; `done` when it was the last."""

    seq: int
    token: int
    index: int
    done: bool = False


def check_prompts(prompts: list[list[int]], vocab: int, max_context: int) -> list[list[int]]:
    """Every prompt a non-empty list of token ids inside the vocabulary, no longer than the context."""
    if not prompts:
        raise TvmpipeError("no prompts: give at least one (--prompt-ids 5,17,3)")
    out = []
    for i, p in enumerate(prompts):
        p = list(p)
        if not p:
            raise TvmpipeError(f"prompt {i} is empty")
        bad = [t for t in p if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise TvmpipeError(f"prompt {i}: token id {bad[0]!r} is outside the vocabulary 0..{vocab - 1}")
        if len(p) > max_context:
            raise TvmpipeError(f"prompt {i} has {len(p)} tokens, more than the bundle's max_context {max_context}")
        out.append([int(t) for t in p])
    return out


def generation_of(bundle: Any) -> Any:
    """The bundle's GenerationSpec; a one-line error unless it is a decode-step bundle."""
    if bundle.generation is None or not bundle.state:
        raise TvmpipeError(f"{bundle.path} is not a decode-step bundle: bundle.json declares no `generation` "
                           "section and state pairs (compile a decoder with `tvmpipe compile NAME --decode`; "
                           "see docs/generation.md)")
    return bundle.generation


def check_stop_tokens(tokens: Iterable[int], vocab: int) -> set[int]:
    """Stop token ids, each inside the vocabulary."""
    stops = set()
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab:
            raise TvmpipeError(f"--stop-token {t!r} is outside the vocabulary 0..{vocab - 1}")
        stops.add(int(t))
    return stops


class _Row:
    """One sequence of a group: its result, every token fed or to feed (prompt, then generated),
    and the position its next step feeds."""

    def __init__(self, result: SequenceResult, now: float):
        self.r = result
        self.hist = list(result.prompt)
        self.pos = 0
        self.admitted = now


class _Group:
    """The sequences of one static batch, one per row (None: an empty row), in one slot; every step
    of the group is one micro-batch that advances each running row by one position, its own."""

    def __init__(self, rows: list[_Row | None], slot: int, epoch: int):
        self.rows = rows
        self.key = rows[0].r.index  # its first sequence's index
        self.slot = slot
        self.epoch = epoch  # the pipeline's state_losses when its caches were (re)started
        self.outstanding = 0
        self.queued = False  # in the loop's ready queue
        self.last: tuple[int, int, bool] | None = None  # (micro-batch, epoch, draws fed back) of its latest step
        self.running = [(i, x) for i, x in enumerate(rows) if x is not None]  # (row, sequence) not finished


def generate(pipe: "Pipeline", prompts: Iterable[list[int]], max_new_tokens: int, *, in_flight: int | None = None,
             sampling: Sampling = Sampling(), stop_tokens: Iterable[int] = (), results: dict | None = None,
             logits_log: dict | None = None, row_admission: bool = True) -> Iterator[TokenEvent]:
    """Generate for every prompt; yields a TokenEvent per generated token as it is sampled. The
    finished SequenceResults are put into `results` (by prompt index) as they complete; with
    `logits_log`, the logits of every step are kept there, per sequence, by position.
    `row_admission`: a queued prompt takes the row of a static batch whose sequence finished while
    the others run on, where the bundle's state can be reset a row at a time
    (Topology.row_reset); False, or a state that cannot, admits a group's rows together."""
    import time

    gen = generation_of(pipe.bundle)
    prompts = check_prompts(list(prompts), gen.vocab_size, gen.max_context)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise TvmpipeError(f"--max-new-tokens must be an integer >= 1, got {max_new_tokens!r}")
    stops = check_stop_tokens(stop_tokens, gen.vocab_size)
    sampling.check(gen.vocab_size)
    batch = pipe.topology.batch
    in_flight = pipe.slots * batch if in_flight is None else in_flight
    if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 1:
        raise TvmpipeError(f"--in-flight must be an integer >= 1, got {in_flight!r}")
    # more sequences than the slots' rows: the rest queue
    groups = min(-(-in_flight // batch), pipe.slots, -(-len(prompts) // batch))

    specs = pipe.topology.specs
    inputs = pipe.topology.inputs
    tok_spec, pos_spec = specs[inputs[gen.token]], specs[inputs[gen.position]]
    chunk = pipe.topology.chunk  # tokens a row per step (a chunked step: count [B] of them real)
    count_spec = specs[inputs[gen.count]] if gen.count is not None else None
    other = [n for n in inputs if n not in (gen.token, gen.position, gen.count, "__slot__", STEP_NAME)]
    if other:
        raise TvmpipeError(f"the decode step also takes {', '.join(other)}, which generation does not feed")
    if logits_log is not None and pipe.topology.dropped_heads:
        raise TvmpipeError("logits_log needs the logits at the driver: this pipeline was built with logits=False")
    results = {} if results is None else results
    while pipe._delivered < pipe.submitted:  # an earlier generation abandoned mid-way: drop its steps
        pipe.get()
    queue = deque(SequenceResult(i, p) for i, p in enumerate(prompts))
    free = list(range(groups))[::-1]
    active: dict[int, _Group] = {}
    records: deque[tuple[_Group, int, int, int]] = deque()  # per micro-batch in flight: (group, position, epoch, seq)
    # Groups with a step to submit (known tokens not yet fed, tokens in flight to feed forward, or
    # caches to rebuild), round robin: each step costs O(1) however many groups are in flight
    ready: deque[_Group] = deque()
    seen_losses = pipe.state_losses
    fed_back = pipe.topology.feedback is not None
    head = step_head(sampling)
    per_row = row_admission and pipe.topology.row_reset

    def source(g: _Group, epoch: int) -> int | None:
        """Where the tokens of g's next step come from: -1, every live row's is known; m, the draws
        of micro-batch m (g's latest step, still in flight, whose draws are fed back; a stop token
        it may draw makes the step a wasted one for that row); None: nothing to submit yet. A
        running row was in each of g's steps since it was admitted, so a row whose next token is
        not known yet draws it in g's latest step."""
        fed = False
        for _, x in g.running:
            n = len(x.hist)
            if x.pos > n:
                return None
            fed = fed or x.pos == n
        if not fed:
            return -1
        if g.last is not None and g.last[1:] == (epoch, True):
            return g.last[0]
        return None

    def want(g: _Group) -> None:
        if not g.queued:
            g.queued = True
            ready.append(g)

    def widths(g: _Group) -> list[int]:
        """Tokens each row's next step feeds: up to `chunk` of those known (a prompt goes in a
        chunk at a time, and a replayed history), else one (the draw fed back to it); 1 in a
        finished or empty row."""
        ns = [1] * batch
        if chunk > 1:
            for i, x in g.running:
                ns[i] = max(1, min(chunk, len(x.hist) - x.pos))
        return ns

    def draws(g: _Group, ns: list[int]) -> list[int]:
        """Which generated token each row's next step draws (from its last token's logits): -1
        where the token after the step's is known (and in a finished or empty row)."""
        ds = [-1] * batch
        for i, x in g.running:
            if x.pos + ns[i] >= len(x.hist):
                ds[i] = x.pos + ns[i] - len(x.r.prompt)
        return ds

    def feed(g: _Group, src: int, ns: list[int], ds: list[int], fwd: bool) -> dict:
        """The step's inputs: per row its tokens (or the fed-back draw), its position, whether it
        starts a sequence (a row reset, or the whole slot's when every row starts), and its tag.
        Finished and empty rows get padding at position 0 and draw nothing."""
        toks, poss, fresh, rows = [0] * (batch * chunk), [0] * batch, [0] * batch, [0, -1, 0] * batch
        for i, x in g.running:
            n, p = len(x.hist), x.pos
            if p < n:
                toks[i * chunk:i * chunk + ns[i]] = x.hist[p:p + ns[i]]
            poss[i] = p
            fresh[i] = 1 if p == 0 else 0
            rows[ROW * i:ROW * i + ROW] = (x.r.index, ds[i], 1 if src >= 0 and p >= n else 0)
        if all(poss[i] == 0 for i, _ in g.running):
            fresh = [1] * batch  # the group (re)starts: the whole slot
        out = {gen.token: np.array(toks, dtype=tok_spec.dtype).reshape(tok_spec.shape),
               gen.position: np.array(poss, dtype=pos_spec.dtype).reshape(pos_spec.shape),
               "__slot__": np.array([g.slot] + fresh, dtype=np.int64),
               STEP_NAME: encode_step(src, head, fwd, rows)}
        if count_spec is not None:
            out[gen.count] = np.array(ns, dtype=count_spec.dtype).reshape(count_spec.shape)
        return out

    def forward(g: _Group, ns: list[int], ds: list[int]) -> bool:
        """Whether g's next step, drawing `ds` (per row, -1: none), feeds its draws forward: the
        pipeline has a token stage to feed (topology.feedback), a row draws a token that cannot end
        its sequence by length or context, and the window holds two steps of every group in flight
        (with fewer, the next step could not be submitted before this one completes anyway)."""
        return (fed_back and 2 * len(active) <= pipe.window
                and any(0 <= ds[i] and ds[i] + 1 < max_new_tokens and x.pos + ns[i] < gen.max_context
                        for i, x in g.running))

    def finish(g: _Group, i: int, x: _Row, why: str, now: float) -> None:
        """Row i's sequence ended; with per-row admission the next queued prompt takes the row at
        once (its first step resets that row of the slot), else the row idles until the group ends."""
        x.r.finish = why
        results[x.r.index] = x.r
        g.running = [(j, y) for j, y in g.running if y is not x]
        g.rows[i] = None
        if per_row and queue:
            g.rows[i] = y = _Row(queue.popleft(), now)
            g.running.append((i, y))
        if not g.running:
            del active[g.key]
            if g.outstanding == 0:
                free.append(g.slot)

    try:
        while queue or active:
            while queue and free:
                now = time.time()
                rows: list[_Row | None] = [_Row(queue.popleft(), now) for _ in range(min(batch, len(queue)))]
                g = _Group(rows + [None] * (batch - len(rows)), free.pop(), pipe.state_losses)
                active[g.key] = g
                want(g)
            epoch = pipe.state_losses
            if epoch != seen_losses:  # a stage holding caches restarted: every group rebuilds its own
                seen_losses = epoch
                for g in active.values():
                    want(g)
            # submit every step whose tokens are known or in flight, round robin over groups, while
            # the window has room. The token stage runs steps in submission order, so a step that takes
            # the tokens of the step just before it would hold that stage up for a whole trip round the
            # ring: such a step waits until as many other steps as there are stages (or groups, if
            # fewer) were submitted after its predecessor.
            spacing = min(len(active), pipe.topology.num_stages)
            deferred = []
            while pipe.submitted - pipe._delivered < pipe.window and ready:
                g = ready.popleft()
                g.queued = False
                if active.get(g.key) is not g:
                    continue  # finished since it was queued
                if g.epoch != epoch:  # its caches were lost: rebuild them from position 0
                    g.epoch, g.last = epoch, None
                    for _, x in g.running:
                        x.pos = 0
                        x.r.replays += 1
                src = source(g, epoch)
                if src is None:
                    continue  # nothing to feed yet (queued again after its step was submitted)
                if src >= 0 and pipe.submitted - src < spacing:
                    deferred.append(g)
                    continue
                ns = widths(g)
                ds = draws(g, ns)
                fwd = forward(g, ns, ds)
                seq = pipe.submit(feed(g, src, ns, ds, fwd))
                if src >= 0:
                    pipe.fed_from[seq] = src
                # per running row: (row, sequence, the position after the step's last token)
                records.append((g, [(i, x, x.pos + ns[i]) for i, x in g.running], epoch, seq))
                g.last = (seq, epoch, fwd)
                for i, x in g.running:
                    x.pos += ns[i]
                g.outstanding += 1
                if source(g, epoch) is not None:
                    want(g)  # more to feed (prompts, history, or the tokens this step draws): back of the queue
            for g in deferred:
                want(g)
            if not records:
                raise TvmpipeError("generation loop has nothing in flight")  # cannot happen: a bug
            out = pipe.get()
            g, carried, ep, seq = records.popleft()
            g.outstanding -= 1
            if active.get(g.key) is not g:  # finished while a stale or wasted step was in flight
                if g.outstanding == 0:
                    free.append(g.slot)
                continue
            if ep != g.epoch or ep != pipe.state_losses:
                continue  # computed on caches a restart lost: the group rebuilds
            live = [(i, x, p) for i, x, p in carried if g.rows[i] is x]  # rows whose sequence runs on
            if logits_log is not None:
                logits = np.asarray(out[gen.logits])
                rows_of = logits.reshape(batch, -1) if batch > 1 else None
                for i, x, p in live:  # the logits of the step's last token, at its position
                    logits_log.setdefault(x.r.index, {})[p - 1] = np.array(logits if rows_of is None else rows_of[i],
                                                                           copy=True)
            drew = [(i, x) for i, x, p in live if p == len(x.hist)]  # the others' next tokens are known
            if not drew:
                continue  # prompt steps (or replayed ones)
            tokens = pipe.sampled(seq)
            now = time.time()
            for i, x in drew:
                t = tokens[i]
                if x.r.first_token_s is None:
                    x.r.first_token_s = now - x.admitted
                x.r.tokens.append(t)
                x.r.token_times.append(now)
                x.hist.append(t)
                why = "stop" if t in stops else "length" if len(x.r.tokens) >= max_new_tokens \
                    else "context" if len(x.hist) > gen.max_context else None
                yield TokenEvent(x.r.index, t, len(x.r.tokens) - 1, why is not None)
                if why:
                    finish(g, i, x, why, now)
            if active.get(g.key) is g:
                want(g)  # its next step's tokens are known now, or in flight
    except TvmpipeError as exc:
        if isinstance(exc, GenerationError):
            raise
        raise GenerationError(f"generation failed after {len(results)} of {len(prompts)} sequence(s) finished: {exc}",
                              results) from exc
