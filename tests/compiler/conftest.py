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
    """checkpoint_bundle(family, decode=True) -> `tvmpipe compile DIR [--decode --max-context 24]`
    of checkpoint(family) (the forward pass over 8 tokens without decode), compiled once per session."""
    from tests.support.checkpoints import DECODE_CONTEXT, FORWARD_LENGTH

    cache: dict[tuple[str, bool], object] = {}

    def get(family: str, decode: bool = True):
        if (family, decode) not in cache:
            from tvmpipe.compiler.export import export
            from tvmpipe.compiler.progress import Progress

            out = tmp_path_factory.mktemp(f"ckpt_bundle_{family}_{'decode' if decode else 'forward'}") / "b"
            export(str(checkpoint(family)), progress=Progress(stream=None),
                   **({"decode": DECODE_CONTEXT} if decode else {"seq_len": FORWARD_LENGTH})).write(out)
            cache[family, decode] = out
        return cache[family, decode]

    return get
