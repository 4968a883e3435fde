"""tvmpipe.generation: autoregressive generation above the driver.

    from tvmpipe.generation import Generator
    events = Generator(pipe).generate([[5, 17, 3]], max_new_tokens=8)

Modules:
  requests   Request (checked once where it enters), SequenceResult, TokenEvent, GenerationError
  scheduler  Scheduler: continuous batching over a Pipeline's public verbs (submit, receive,
             in_flight, state_losses), per-row admission, chunked prefill, replays after faults
  generator  Generator: generate / generate_all over a prompt set
  engine     Engine: a scheduler on its own thread, for servers: requests in, token streams out
  text       tokenizer.json through `tokenizers`, streaming detokenization, stop strings, chat templates
  jobs       batch jobs: a prompts .jsonl in, one line per finished sequence out, resumable

The names below are imported on first use, so `import tvmpipe.generation.text` needs no numpy-heavy
layer below it.
"""

from __future__ import annotations

from tvmpipe.core.lazy import lazy_exports

_EXPORTS = {
    "Generator": "generator",
    "Scheduler": "scheduler",
    "Engine": "engine", "Stream": "engine", "QueueFull": "engine", "EngineClosed": "engine",
    "Request": "requests", "SequenceResult": "requests", "TokenEvent": "requests", "GenerationError": "requests",
    "make_requests": "requests", "layout_of": "requests",
    "Sampling": "tvmpipe.executor.sampler",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
