"""Session fixtures: each model is compiled once per test session (ResNet-18 alone takes ~5 s)."""

from __future__ import annotations

from typing import Callable

import pytest

from tests.support.compiled_models import Compiled, compile_source


@pytest.fixture(scope="session")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Compiled]:
    """compiled(name) for a built-in model name, "onnx" or "pt2"; compiles on first use only."""
    cache: dict[str, Compiled] = {}

    def get(name: str) -> Compiled:
        if name not in cache:
            cache[name] = compile_source(name, tmp_path_factory.mktemp(f"bundle_{name}"))
        return cache[name]

    return get


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """checkpoint(family) -> the family's Hugging Face checkpoint directory of the covering set
    (tests/support/checkpoints.py COVER; llama's with tokenizer files), written once per session."""
    from tests.support.checkpoints import COVER, write_checkpoint

    cache: dict[str, object] = {}

    def get(family: str):
        if family not in cache:
            out = tmp_path_factory.mktemp(f"ckpt_{family}") / family
            cache[family] = write_checkpoint(out, COVER[family], with_tokenizer=family == "llama")
        return cache[family]

    return get


@pytest.fixture(scope="session")
def checkpoint_bundle(tmp_path_factory: pytest.TempPathFactory, checkpoint):
    """checkpoint_bundle(family, decode=True, batch=1, chunk=1) -> `tvmpipe compile DIR [--decode
    --max-context 24 --batch B --chunk C]` of checkpoint(family) (the forward pass over 8 tokens
    without decode), compiled once per session."""
    from tests.support.checkpoints import DECODE_CONTEXT, FORWARD_LENGTH

    cache: dict[tuple[str, bool, int, int], object] = {}

    def get(family: str, decode: bool = True, batch: int = 1, chunk: int = 1):
        key = (family, decode, batch, chunk)
        if key not in cache:
            from tvmpipe.compiler.export import export
            from tvmpipe.compiler.progress import Progress

            out = tmp_path_factory.mktemp(f"ckpt_bundle_{family}_{'decode' if decode else 'forward'}") / "b"
            kind = {"decode": DECODE_CONTEXT, "chunk": chunk} if decode else {"seq_len": FORWARD_LENGTH}
            export(str(checkpoint(family)), progress=Progress(stream=None), batch=batch, **kind).write(out)
            cache[key] = out
        return cache[key]

    return get
