"""Fixtures of the serve tests: the zoo's GPT-2 decode step at the compiler's default context (64,
as `tvmpipe compile gpt2 --decode` makes it), compiled once a session; tokenizer directories; the
module server most tests share; and an offline reference (Generator on its own pipeline)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.serve.harness import API_KEY, ServerProcess, build_tokenizer
from tvmpipe.generation.requests import Request


@pytest.fixture(scope="session")
def serve_bundle(tmp_path_factory) -> Path:
    from tvmpipe.compiler.decoders import DEFAULT_MAX_CONTEXT
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress

    out = tmp_path_factory.mktemp("serve_bundle") / "gpt2_step"
    export("gpt2", progress=Progress(stream=None), decode=DEFAULT_MAX_CONTEXT, seed=1).write(out)
    return out


@pytest.fixture(scope="session")
def chat_tokenizer(tmp_path_factory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok") / "chatml")


@pytest.fixture(scope="session")
def plain_tokenizer(tmp_path_factory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok") / "plain", chat_template=False)


@pytest.fixture(scope="module")
def server(serve_bundle, chat_tokenizer, tmp_path_factory):
    """The shared server: 2 stages as local processes, 4 sequence rows, 12 more may wait, a
    tokenizer with a chat template, the API key from TVMPIPE_API_KEY, run under `-X importtime`
    (test_safety reads which modules it imported)."""
    log = tmp_path_factory.mktemp("server") / "stderr.txt"
    srv = ServerProcess(serve_bundle, "--stages", "2", "--processes", "--tokenizer", str(chat_tokenizer),
                        "--max-waiting", "12", "--max-body-bytes", "65536", log_path=log,
                        env={"TVMPIPE_API_KEY": API_KEY}, api_key=API_KEY, python_flags=("-X", "importtime"))
    yield srv
    status = srv.stop()
    assert status == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def offline(serve_bundle):
    """`offline(cases)`: each case's tokens from an offline run (Generator on a pipeline of its
    own, the same K), each keyed 0 as a one-prompt `tvmpipe generate` keys its prompt. A case is
    (prompt ids, max new tokens, Sampling, stop token ids)."""
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.generation import Generator, layout_of

    with Pipeline(serve_bundle, 2, launcher="process", logits=False) as pipe:
        gen = Generator(pipe)
        layout = layout_of(pipe.bundle)

        def run(cases):
            requests = [Request.checked(p, n, layout, sampling=s, stop_tokens=stops, key=0) for p, n, s, stops in cases]
            return [r.tokens for r in gen.generate_all(requests)]

        yield run
