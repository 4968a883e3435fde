"""A user's own stateful decode program: a transformers decoder whose KV caches are registered
buffers, updated in place each step (`self.k_cache_0.copy_(new)`), saved with torch.export as .pt2.

`forward(input_ids [B, 1], position [B]) -> logits [B, 1, V]`: the caches are state the program
keeps itself, as a user writes it for torch; `tvmpipe compile X.pt2 --decode` lifts them into state
pairs (compiler/lift.py) and declares the generation section (compiler/genspec.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def cached_decoder(family: str, seed: int, max_context: int) -> tuple[Any, Any]:
    """(the stateful module, the transformers model whose weights it uses)."""
    import torch

    from tvmpipe.compiler.decoders import build_decoder, decode_step_module

    model = build_decoder(family, seed)
    step, spec = decode_step_module(model, max_context)

    class CachedDecoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.step = step
            for name in spec.caches:
                self.register_buffer(name, torch.zeros(spec.cache_shape))

        def forward(self, input_ids: Any, position: Any) -> Any:
            out = self.step(input_ids, position, *(getattr(self, n) for n in spec.caches))
            for name, new in zip(spec.caches, out[1:]):
                getattr(self, name).copy_(new)
            return out[0]

    return CachedDecoder().eval(), model


def save_program(module: Any, path: Path) -> Path:
    import warnings

    import torch

    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        ep = torch.export.export(module, (torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)))
        torch.export.save(ep, str(path))
    return path
