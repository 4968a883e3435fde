"""One generation run, the flow `tvmpipe generate` takes for prompts on its command line and for
batch jobs over a prompts file.

    run = GenerationRun(bundle, plan, options, prompts, codec=codec)
    run.execute(on_text=..., on_done=...)   # open/join the cluster, start the stages, generate
    run.done, run.error                     # kept as far as the run got, also when it failed

Down through the layers: the prompts arrive checked (app/prompts.py), the pipeline is opened as every
run opens it (app/connect.py), and the generation layer's Engine schedules the sequences while its
output processor turns each sequence's tokens into text as they arrive (no broken characters, stop
strings never shown; a stop string ends its sequence): the same Engine that `tvmpipe serve` runs in
a process of its own, here driven step by step.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tvmpipe.app.decoding import open_decode_pipeline
from tvmpipe.app.options import ClusterOptions
from tvmpipe.app.prompts import Prompt
from tvmpipe.bundle import Bundle
from tvmpipe.core.errors import TvmpipeError
from tvmpipe.generation.requests import SequenceResult
from tvmpipe.generation.text import TextCodec
from tvmpipe.partition import Plan


@dataclass
class Finished:
    """A sequence that ended: its prompt, result and (with a tokenizer) its text."""

    prompt: Prompt
    result: SequenceResult
    text: str | None

    def to_json(self) -> dict[str, Any]:
        out = {"id": self.prompt.id, **self.result.to_json()}
        if self.text is not None:
            out["text"] = self.text
        return out


@dataclass
class GenerationRun:
    bundle: Bundle
    plan: Plan
    options: ClusterOptions
    prompts: list[Prompt]
    codec: TextCodec | None = None  # stop strings are each request's (Request.stop)
    slots: int | None = None
    in_flight: int | None = None
    done: list[Finished] = field(default_factory=list)  # in the order the sequences ended
    error: str | None = None
    backend: str | None = None
    startup_s: float = 0.0
    wall_s: float = 0.0
    restarts: int = 0
    pipe_slots: int = 0
    batch: int = 1
    chunk: int = 1
    metrics: Any = None
    kv: Any = None  # a paged step's pool at the end (generation.pages.PoolStats), else None
    kv_tokens: int | None = None  # a paged step's pool asked for (--kv-tokens); None: sized by free memory
    kv_pool: Any = None  # how the pool was sized (executor.kvpool.PoolSize), else None

    def execute(self, on_text: Callable[[int, str], None] = lambda i, t: None,
                on_done: Callable[[Finished], None] = lambda f: None,
                on_start: Callable[[], None] = lambda: None) -> None:
        """Generate every prompt. `on_start()`: the stages are up and generation begins;
        `on_text(i, piece)`: new text of prompt i as its tokens arrive (with a codec);
        `on_done(finished)`: a sequence ended. A pipeline that fails beyond its restarts ends the
        run with `error` set; what finished before is kept."""
        from tvmpipe.generation.engine import Engine

        t0 = time.time()
        with open_decode_pipeline(self.options, self.bundle, self.plan, slots=self.slots,
                                  kv_tokens=self.kv_tokens) as opened:
            pipe, self.backend = opened.pipe, opened.backend
            self.kv_pool = pipe.kv_pool
            t1 = time.time()
            self.startup_s = t1 - t0
            on_start()
            engine = Engine(pipe, self.codec, in_flight=self.in_flight)
            try:
                for out in engine.generate([p.request for p in self.prompts]):
                    if out.text:
                        on_text(out.index, out.text)
                    if out.result is not None:
                        finished = Finished(self.prompts[out.index], out.result, out.result.text)
                        self.done.append(finished)
                        on_done(finished)
            except TvmpipeError as exc:
                self.error = f"generation failed after {len(self.done)} of {len(self.prompts)} sequence(s) finished: {exc}"
            self.wall_s = time.time() - t1
            self.restarts = sum(pipe.restarts)
            self.pipe_slots = pipe.slots
            self.batch, self.chunk = pipe.topology.batch, pipe.topology.chunk
            self.metrics = stage_metrics(pipe)
            self.kv = engine.pool_stats()

    @property
    def generated_tokens(self) -> int:
        return sum(len(f.result.tokens) for f in self.done)

    def summary(self) -> dict[str, Any]:
        """The run's JSON document, its sequences in prompt order."""
        order = {id(p): i for i, p in enumerate(self.prompts)}
        seqs = [f.to_json() for f in sorted(self.done, key=lambda f: order[id(f.prompt)])]
        tokens = self.generated_tokens
        return {"bundle": str(self.bundle.path), "stages": self.plan.num_stages,
                "plan": [list(s) for s in self.plan.stages], "backend": self.backend, "slots": self.pipe_slots,
                "batch": self.batch, "chunk": self.chunk, "sequences": seqs, "generated_tokens": tokens,
                "tokens_per_s": tokens / self.wall_s if self.wall_s > 0 else None, "wall_s": self.wall_s,
                "startup_s": self.startup_s, "restarts": self.restarts, "error": self.error,
                "metrics": self.metrics.to_json() if self.metrics is not None else None,
                "kv": None if self.kv is None else dataclasses.asdict(self.kv),  # each stage's pool: the same page ids
                "kv_pool": None if self.kv_pool is None else {**dataclasses.asdict(self.kv_pool),
                                                              "tokens": self.kv_pool.tokens}}


def stage_metrics(pipe: Any) -> Any:
    """The run's per-stage figures (PipelineMetrics: each micro-batch is one step of one sequence,
    or of a static batch of them), with the weights and the KV caches each stage holds; None where
    a worker cannot say any more (a run that failed), which costs the report its table, not the
    tokens."""
    try:
        return pipe.metrics()
    except (TvmpipeError, OSError):
        return None
