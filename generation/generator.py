"""Generator: the token-level generation verbs over a running Pipeline of a decode-step bundle.

    from tvmpipe.cluster import Pipeline
    from tvmpipe.generation import Generator

    with Pipeline("B", 2, launcher="process") as pipe:
        for event in Generator(pipe).generate([[5, 17, 3], [60]], max_new_tokens=8):
            print(event.seq, event.token)

A thin facade over the engine core (core.py): it turns prompt lists into checked requests and runs
them to the end, streaming a TokenEvent per token (no text: `Engine` adds the output processor).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Sequence

from tvmpipe.core.errors import TvmpipeError
from tvmpipe.executor.sampler import Sampling
from tvmpipe.generation.core import EngineCore
from tvmpipe.generation.requests import GenerationError, Request, SequenceResult, TokenEvent, layout_of, make_requests

if TYPE_CHECKING:
    from tvmpipe.cluster.driver import Pipeline


class Generator:
    """Generation on `pipe`, whose bundle must be a decode step (one-line error otherwise)."""

    def __init__(self, pipe: "Pipeline"):
        self.pipe = pipe
        self.layout = layout_of(pipe.bundle)
        self.scheduler = None  # the last run's (its fed_from, for timelines)

    def requests(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop_tokens: Sequence[int] = ()) -> list[Request]:
        """The checked requests of a prompt set (prompt i keyed i for its draws)."""
        return make_requests(prompts, max_new_tokens, self.layout, sampling=Sampling(temperature, top_k, seed, top_p),
                             stop_tokens=stop_tokens)

    def generate(self, prompts: Sequence[Sequence[int]] | Sequence[Request], max_new_tokens: int | None = None, *,
                 in_flight: int | None = None, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0, stop_tokens: Sequence[int] = (), results: dict | None = None,
                 logits_log: dict | None = None, row_admission: bool = True) -> Iterator[TokenEvent]:
        """Generate for every prompt (token id lists, or requests already made by `requests`);
        yields a TokenEvent per generated token as it is drawn. Finished SequenceResults go into
        `results` (by prompt index) as they complete; with `logits_log`, the logits of every step
        are kept there, per sequence, by position. Greedy by default; seeded temperature / top-k /
        top-p. `in_flight`: sequences in flight (default: all the slots hold; a bundle compiled with
        `--batch B` counts whole batches); `row_admission`: a queued prompt takes the row of a
        finished sequence while its row-mates run on (Scheduler). A failure of the pipeline raises
        GenerationError carrying the sequences that finished."""
        if prompts and all(isinstance(p, Request) for p in prompts):
            requests = list(prompts)
        else:
            requests = self.requests(prompts, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                     seed=seed, stop_tokens=stop_tokens)
        core = EngineCore(self.pipe, in_flight=in_flight, row_admission=row_admission, logits_log=logits_log,
                          results={} if results is None else results)
        self.scheduler = core.scheduler
        for r in requests:
            core.add(r)
        return _run(core, len(requests))

    def generate_all(self, prompts: Sequence[Sequence[int]] | Sequence[Request], max_new_tokens: int | None = None,
                     **kw) -> list[SequenceResult]:
        """`generate`, run to the end: one SequenceResult per prompt, in prompt order."""
        results: dict = {}
        for _ in self.generate(prompts, max_new_tokens, results=results, **kw):
            pass
        return [results[i] for i in sorted(results)]


def _run(core: EngineCore, total: int) -> Iterator[TokenEvent]:
    results = core.scheduler.results
    try:
        while core.has_work:
            events = core.step()
            core.take_finished()  # kept in results
            yield from events
    except TvmpipeError as exc:
        if isinstance(exc, GenerationError):
            raise
        raise GenerationError(f"generation failed after {len(results)} of {total} sequence(s) finished: {exc}",
                              results) from exc
