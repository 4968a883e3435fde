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

import importlib
from typing import Any

_EXPORTS = {
    "Generator": "generator",
    "Scheduler": "scheduler",
    "Request": "requests", "SequenceResult": "requests", "TokenEvent": "requests", "GenerationError": "requests",
    "make_requests": "requests", "layout_of": "requests",
}

__all__ = sorted([*_EXPORTS, "Sampling"])


def __getattr__(name: str) -> Any:
    if name == "Sampling":
        from tvmpipe.executor.sampler import Sampling

        return Sampling
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tvmpipe.generation' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tvmpipe.generation.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
