"""The generation loop: autoregressive decoding over a pipeline whose stages keep their KV caches.

Each micro-batch is one decode step of one sequence: the driver feeds the step's position (and the
sequence's slot, [slot, fresh], to every stage holding state), the stages read and write that
slot's caches where they are, and only hidden states cross stages. The stage that computes the
logits draws the next token and sends it straight to the stage that reads tokens (sampling.py),
so the driver is off the token's path: it submits a sequence's next step as soon as the previous
one is in flight, naming the micro-batch whose token it takes. The driver gets the token too, for
streaming and stop tokens (and the logits, if the pipeline keeps them: `logits_log`); a step
submitted after a stop token is dropped.

- The prompt goes in token by token, and a prompt's steps do not wait for each other: every stage
  runs micro-batches in submission order, so step p+1 of a slot always sees step p's cache.
- Several sequences are in flight (`in_flight`, at most the pipeline's slots): while one waits for
  its token to be sampled, the others' steps keep every stage busy. When one finishes, the next
  queued prompt takes its slot (continuous batching at micro-batch granularity).
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

from tvmpipe.cluster.sampling import STEP_NAME, Sampling, StepTag
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


class _Seq:
    def __init__(self, result: SequenceResult, slot: int, epoch: int, now: float):
        self.r = result
        self.hist = list(result.prompt)  # every token fed or to feed: prompt, then generated
        self.slot = slot
        self.epoch = epoch  # the pipeline's state_losses when its caches were (re)started
        self.next_pos = 0  # next position to submit
        self.outstanding = 0
        self.queued = False  # in the loop's ready queue
        # (micro-batch, position, epoch, its draw is fed back) of its latest step
        self.last: tuple[int, int, int, bool] | None = None
        self.admitted = now


def generate(pipe: "Pipeline", prompts: Iterable[list[int]], max_new_tokens: int, *, in_flight: int | None = None,
             sampling: Sampling = Sampling(), stop_tokens: Iterable[int] = (), results: dict | None = None,
             logits_log: dict | None = None) -> Iterator[TokenEvent]:
    """Generate for every prompt; yields a TokenEvent per generated token as it is sampled. The
    finished SequenceResults are put into `results` (by prompt index) as they complete; with
    `logits_log`, the logits of every step are kept there, per sequence, by position."""
    import time

    gen = generation_of(pipe.bundle)
    prompts = check_prompts(list(prompts), gen.vocab_size, gen.max_context)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise TvmpipeError(f"--max-new-tokens must be an integer >= 1, got {max_new_tokens!r}")
    stops = check_stop_tokens(stop_tokens, gen.vocab_size)
    sampling.check(gen.vocab_size)
    in_flight = pipe.slots if in_flight is None else in_flight
    if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 1:
        raise TvmpipeError(f"--in-flight must be an integer >= 1, got {in_flight!r}")
    in_flight = min(in_flight, pipe.slots, len(prompts))  # more sequences than slots: the rest queue

    specs = pipe.topology.specs
    inputs = pipe.topology.inputs
    tok_spec, pos_spec = specs[inputs[gen.token]], specs[inputs[gen.position]]
    if int(np.prod(tok_spec.shape)) != 1:
        raise TvmpipeError(f"input '{gen.token}' is {tok_spec}: generation feeds one sequence per micro-batch "
                           "(a bundle compiled with batch 1)")
    other = [n for n in inputs if n not in (gen.token, gen.position, "__slot__", STEP_NAME)]
    if other:
        raise TvmpipeError(f"the decode step also takes {', '.join(other)}, which generation does not feed")
    if logits_log is not None and pipe.topology.dropped_heads:
        raise TvmpipeError("logits_log needs the logits at the driver: this pipeline was built with logits=False")
    results = {} if results is None else results
    while pipe._delivered < pipe.submitted:  # an earlier generation abandoned mid-way: drop its steps
        pipe.get()
    queue = deque(SequenceResult(i, p) for i, p in enumerate(prompts))
    free = list(range(in_flight))[::-1]
    active: dict[int, _Seq] = {}
    records: deque[tuple[_Seq, int, int, int]] = deque()  # per micro-batch in flight: (sequence, position, epoch, seq)
    # Sequences with a step to submit (a known token not yet fed, a token in flight to feed forward,
    # or caches to rebuild), round robin: each step costs O(1) however many sequences are in flight
    ready: deque[_Seq] = deque()
    seen_losses = pipe.state_losses
    fed_back = pipe.topology.feedback is not None

    def source(s: _Seq, epoch: int) -> int | None:
        """Where the token of s's next step comes from: -1, it is known; m, the draw of micro-batch m
        (s's latest step, still in flight, whose draw is fed back; a stop token it may draw makes
        the step a wasted one); None: nothing to submit yet."""
        q = s.next_pos
        if q < len(s.hist):
            return -1
        if q == len(s.hist) and s.last is not None and s.last[1:] == (q - 1, epoch, True):
            return s.last[0]
        return None

    def want(s: _Seq) -> None:
        if not s.queued:
            s.queued = True
            ready.append(s)

    def feed(s: _Seq, pos: int, src: int, d: int, fwd: bool) -> dict:
        return {gen.token: np.full(tok_spec.shape, s.hist[pos] if src < 0 else 0, dtype=tok_spec.dtype),
                gen.position: np.full(pos_spec.shape, pos, dtype=pos_spec.dtype),
                "__slot__": np.array([s.slot, 1 if pos == 0 else 0], dtype=np.int64),
                STEP_NAME: StepTag(src, sampling, s.r.index, d, fwd).encode()}

    def draw(s: _Seq, pos: int) -> int:
        """Which generated token the step at `pos` draws: -1 when its next token is known."""
        return pos + 1 - len(s.r.prompt) if pos + 1 >= len(s.hist) else -1

    def forward(d: int, pos: int) -> bool:
        """Whether the step at `pos`, drawing generated token `d` (-1: none), feeds its draw forward:
        the pipeline has a token stage to feed (topology.feedback), the step draws, the draw cannot
        end the sequence by length or context, and the window holds two steps of every sequence in
        flight (with fewer, the next step could not be submitted before this one completes anyway)."""
        return (fed_back and 0 <= d and d + 1 < max_new_tokens and pos + 1 < gen.max_context
                and 2 * len(active) <= pipe.window)

    def finish(s: _Seq, why: str) -> None:
        s.r.finish = why
        results[s.r.index] = s.r
        del active[s.r.index]
        if s.outstanding == 0:
            free.append(s.slot)

    try:
        while queue or active:
            while queue and free:
                r = queue.popleft()
                active[r.index] = _Seq(r, free.pop(), pipe.state_losses, time.time())
                want(active[r.index])
            epoch = pipe.state_losses
            if epoch != seen_losses:  # a stage holding caches restarted: every sequence rebuilds its own
                seen_losses = epoch
                for s in active.values():
                    want(s)
            # submit every step whose token is known or in flight, round robin over sequences, while
            # the window has room. The token stage runs steps in submission order, so a step that takes
            # the token of the step just before it would hold that stage up for a whole trip round the
            # ring: such a step waits until as many other steps as there are stages (or sequences, if
            # fewer) were submitted after its predecessor.
            spacing = min(len(active), pipe.topology.num_stages)
            deferred = []
            while pipe.submitted - pipe._delivered < pipe.window and ready:
                s = ready.popleft()
                s.queued = False
                if active.get(s.r.index) is not s:
                    continue  # finished since it was queued
                if s.epoch != epoch:  # its caches were lost: rebuild them from position 0
                    s.epoch, s.next_pos, s.last = epoch, 0, None
                    s.r.replays += 1
                src = source(s, epoch)
                if src is None:
                    continue  # nothing to feed yet (queued again after its step was submitted)
                if src >= 0 and pipe.submitted - src < spacing:
                    deferred.append(s)
                    continue
                pos = s.next_pos
                d = draw(s, pos)
                fwd = forward(d, pos)
                seq = pipe.submit(feed(s, pos, src, d, fwd))
                if src >= 0:
                    pipe.fed_from[seq] = src
                records.append((s, pos, epoch, seq))
                s.last = (seq, pos, epoch, fwd)
                s.next_pos += 1
                s.outstanding += 1
                if source(s, epoch) is not None:
                    want(s)  # more to feed (its prompt, history, or the token this step draws): back of the queue
            for s in deferred:
                want(s)
            if not records:
                raise TvmpipeError("generation loop has nothing in flight")  # cannot happen: a bug
            out = pipe.get()
            s, pos, ep, seq = records.popleft()
            s.outstanding -= 1
            if s.r.index not in active:  # finished while a stale or wasted step was in flight
                if s.outstanding == 0:
                    free.append(s.slot)
                continue
            if ep != s.epoch or ep != pipe.state_losses:
                continue  # computed on caches a restart lost: the sequence rebuilds
            logits = out[gen.logits]
            if logits_log is not None:
                logits_log.setdefault(s.r.index, {})[pos] = np.array(logits, copy=True)
            if pos != len(s.hist) - 1:
                continue  # a prompt step (or a replayed one): its token is already known
            t = pipe.sampled(seq)
            now = time.time()
            if s.r.first_token_s is None:
                s.r.first_token_s = now - s.admitted
            s.r.tokens.append(t)
            s.r.token_times.append(now)
            s.hist.append(t)
            why = "stop" if t in stops else "length" if len(s.r.tokens) >= max_new_tokens \
                else "context" if len(s.hist) > gen.max_context else None
            yield TokenEvent(s.r.index, t, len(s.r.tokens) - 1, why is not None)
            if why:
                finish(s, why)
            else:
                want(s)  # its next step's token is known now, or in flight
    except TvmpipeError as exc:
        if isinstance(exc, GenerationError):
            raise
        raise GenerationError(f"generation failed after {len(results)} of {len(prompts)} sequence(s) finished: {exc}",
                              results) from exc
