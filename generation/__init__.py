"""tvmpipe.generation: autoregressive generation above the driver.

    from tvmpipe.generation import Generator
    events = Generator(pipe).generate([[5, 17, 3]], max_new_tokens=8)

Modules:
  requests   Request (checked once where it enters), FinishReason, SequenceResult, TokenEvent, GenerationError
  scheduler  Scheduler: continuous batching; `schedule()` plans the steps, `update()` takes one back;
             per-row admission, chunked prefill, lost steps fed again, failures kept to their requests
  core       EngineCore: the scheduler and the pipeline's I/O (submit the plan, receive a step)
  output     OutputProcessor: text, stop strings and finish reasons of every request (RequestOutput)
  engine     Engine: a request's whole life (core + output processor), synchronous; EngineThread:
             the same Engine on a thread of its own (streams, cancel, drain)
  engine_process  EngineProcess: the same Engine in a process of its own, for servers (off their GIL)
  pages      PagePool: a paged KV cache's pages, which each sequence holds, shared prompt prefixes
  tools      tool calls: how a chat template writes them, read back, and the grammar that asks for one
  generator  Generator: token-level generate / generate_all over a prompt set
  text       tokenizer.json through `tokenizers`, streaming detokenization, stop strings, chat templates

The names below are imported on first use, so `import tvmpipe.generation.text` needs no numpy-heavy
layer below it.
"""

from __future__ import annotations

from tvmpipe.core.lazy import lazy_exports

_EXPORTS = {
    "Generator": "generator",
    "Scheduler": "scheduler", "PlannedStep": "scheduler",
    "EngineCore": "core",
    "OutputProcessor": "output", "RequestOutput": "output",
    "Engine": "engine", "EngineThread": "engine", "Stream": "engine", "QueueFull": "engine", "EngineClosed": "engine",
    "Request": "requests", "SequenceResult": "requests", "TokenEvent": "requests", "GenerationError": "requests",
    "FinishReason": "requests",
    "make_requests": "requests", "layout_of": "requests",
    "Sampling": "tvmpipe.executor.sampler",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
