"""A user's own stateful .pt2 generates: `tvmpipe compile X.pt2 --decode` declares the bundle's
generation section (compiler/genspec.py), inferred where the shapes leave one choice and named by
--token-input, --position-input, --count-input, --logits-output where not; --max-context is
always given. The program (tests/support/stateful_program.py) is a transformers Llama whose KV
caches are buffers updated in place: its bundle gives transformers' tokens in the single-process
oracle and through `tvmpipe generate`, which refused such a bundle before ("declares no
`generation` section")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("tvm")
pytest.importorskip("transformers")
pytestmark = pytest.mark.tvm

CONTEXT = 16
PROMPT = [5, 17, 3, 60, 9]
NEW = 6


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    from tests.support.stateful_program import cached_decoder, save_program

    module, model = cached_decoder("llama", 1, CONTEXT)
    return save_program(module, tmp_path_factory.mktemp("pt2") / "cached.pt2"), model


@pytest.fixture(scope="module")
def bundle(program, tmp_path_factory):
    from tvmpipe.cli import main

    out = tmp_path_factory.mktemp("pt2_bundle") / "b"
    assert main(["compile", str(program[0]), "--decode", "--max-context", str(CONTEXT), "-o", str(out), "--quiet"]) == 0
    return out


def test_the_generation_section_is_inferred_and_the_bundle_generates(program, bundle):
    from tvmpipe.bundle import load_bundle
    from tvmpipe.compiler.decoders import transformers_generate
    from tvmpipe.executor.decode_loop import greedy_decode

    b = load_bundle(bundle)
    gen = b.generation
    assert (gen.token, gen.position, gen.logits, gen.max_context, gen.vocab_size, gen.count) == \
        ("input_ids", "position", 0, CONTEXT, 128, None)
    assert [p.input for p in b.state] == [f"b_{kv}_cache_{i}" for i in range(2) for kv in "kv"]
    want = transformers_generate(program[1], PROMPT, NEW)
    assert len(set(want)) > 1
    assert greedy_decode(bundle, PROMPT, NEW).tokens[0] == want
    proc = subprocess.run([sys.executable, "-m", "tvmpipe", "generate", str(bundle), "--stages", "2", "--processes",
                           "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", str(NEW), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [s["tokens"] for s in json.loads(proc.stdout)["sequences"]] == [want]


def test_flags_name_what_inference_cannot_and_wrong_names_are_refused(program, tmp_path, capsys):
    from tvmpipe.cli import main

    def err(*args: str) -> str:
        assert main(["compile", str(program[0]), "--decode", "-o", str(tmp_path / "out"), "--quiet", *args]) != 0
        e = capsys.readouterr().err.strip()
        assert e.count("\n") == 0 and "Traceback" not in e, e
        return e

    assert "pass --max-context T, the length of its caches" in err()
    assert "--token-input ids is not one of its inputs besides the caches (input_ids, position)" in err(
        "--max-context", "16", "--token-input", "ids")
    assert "--logits-output 1: output 1 is a cache (a state output)" in err("--max-context", "16", "--logits-output", "1")
    assert "--position-input input_ids is int64[1, 1], not an integer input of shape [] or [1]" in err(
        "--max-context", "16", "--position-input", "input_ids")
    assert not (tmp_path / "out").exists()


def _t(name, shape, dtype="int64"):
    from tvmpipe.compiler.genspec import Tensor

    return Tensor(name, tuple(shape), dtype)


def test_inference_takes_only_unambiguous_choices():
    """genspec.declare on signatures: each ambiguity is refused naming the flag that settles it,
    and the flag settles it."""
    from tvmpipe.compiler.errors import SourceError
    from tvmpipe.compiler.genspec import Declared, declare

    caches = [_t("k", (2, 4, 16, 8), "float32"), _t("v", (2, 4, 16, 8), "float32")]
    logits = _t("logits", (2, 1, 100), "float32")
    outs = [logits, _t("k_new", (2, 4, 16, 8), "float32"), _t("v_new", (2, 4, 16, 8), "float32")]
    state_in, state_out = {"k", "v"}, {1, 2}
    ok = Declared(max_context=16)
    gen = declare("p.pt2", [_t("ids", (2, 1)), _t("pos", (2,)), *caches], outs, state_in, state_out, ok)
    assert (gen.token, gen.position, gen.logits, gen.vocab_size, gen.count) == ("ids", "pos", 0, 100, None)
    two = [_t("ids", (2, 1)), _t("pos", (2,)), _t("offset", (2,)), *caches]
    with pytest.raises(SourceError, match=r"which input is the position .*2 candidates \(pos, offset\)\); name it "
                                          r"with --position-input NAME"):
        declare("p.pt2", two, outs, state_in, state_out, ok)
    assert declare("p.pt2", two, outs, state_in, state_out, Declared("ids", "offset", max_context=16)).position == "offset"
    with pytest.raises(SourceError, match="which output is the logits .*outputs 0, 3\\); name it with --logits-output"):
        declare("p.pt2", two[:2] + caches, outs + [_t("hidden", (2, 1, 64), "float32")], state_in, state_out, ok)
    assert declare("p.pt2", two[:2] + caches, outs + [_t("hidden", (2, 1, 64), "float32")], state_in, state_out,
                   Declared(logits="logits", max_context=16)).logits == 0
    chunked = [_t("ids", (2, 4)), _t("pos", (2,)), _t("count", (2,)), *caches]
    with pytest.raises(SourceError, match="takes 4 tokens a row: name the position and the count"):
        declare("p.pt2", chunked, outs, state_in, state_out, ok)
    gen = declare("p.pt2", chunked, outs, state_in, state_out, Declared(position="pos", count="count", max_context=16))
    assert (gen.position, gen.count) == ("pos", "count")
    with pytest.raises(SourceError, match="updates none"):
        declare("p.pt2", two, outs, set(), set(), ok)
    with pytest.raises(SourceError, match="which input is the token"):
        declare("p.pt2", [_t("pos", (2,)), *caches], outs, state_in, state_out, ok)
