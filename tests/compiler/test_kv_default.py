"""The KV layout a decode step gets without `--kv` (issue 53, docs/paged-kv.md): paged for the
built-in decoders, checkpoint directories and GGUF files, static where a paged step is not built
(a .pt2's own step, pages of bfloat16), with the reason in the compile log, bundle.json's
source.decode.kv and `tvmpipe inspect`; never an error. An explicit `--kv paged` that cannot be
built stays a one-line error. (The paged steps themselves: test_paged_decode.py.)
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tvm")
pytest.importorskip("transformers")
pytestmark = pytest.mark.tvm


def test_the_default_is_paged_where_a_paged_step_is_built(checkpoint, tmp_path):
    """export.default_kv, the one place that decides: each source kind and dtype."""
    from tvmpipe.compiler.decoders import DEFAULT_PAGE_SIZE
    from tvmpipe.compiler.export import default_kv

    f32, bf16 = str(checkpoint("qwen2")), str(checkpoint("llama"))  # a float32 and a bfloat16 checkpoint
    gguf = str(tmp_path / "m.gguf")
    for source, dtype in (("gpt2", None), ("llama", "float32"), ("gpt2", "float16"), (f32, None), (f32, "float16"),
                          (bf16, "float16"), (bf16, "float32"), (gguf, None), (gguf, "float16")):
        kv = default_kv(source, dtype)
        assert (kv.layout, kv.reason, kv.page_size, kv.pages) == ("paged", None, DEFAULT_PAGE_SIZE, None), (source,
                                                                                                              dtype)
    bf16_pages = "pages of bfloat16 are not built (float32 and float16 are)"
    for source, dtype, why in ((bf16, None, bf16_pages), (f32, "bfloat16", bf16_pages), ("gpt2", "bfloat16", bf16_pages),
                               (gguf, "bfloat16", bf16_pages),
                               (str(tmp_path / "step.pt2"), None, "a .pt2 program's decode step keeps the caches"),
                               ("resnet18", None, "not a built-in decoder, a checkpoint directory or a GGUF file")):
        kv = default_kv(source, dtype)
        assert kv.layout == "static" and why in kv.reason, (source, dtype, kv)


def test_a_step_that_cannot_be_paged_compiles_static_and_says_why(checkpoint, tmp_path, capsys):
    """`tvmpipe compile` of a bfloat16 checkpoint without --kv: a static step (exit 0), the reason
    on the compile log, in bundle.json's source.decode.kv and in `tvmpipe inspect`; with
    `--kv paged` the same source is refused in one line, and so is a .pt2's declared step."""
    from tvmpipe.bundle import load_bundle
    from tvmpipe.cli import main

    ckpt = str(checkpoint("llama"))
    capsys.readouterr()  # the checkpoint writer's progress
    out = tmp_path / "b"
    assert main(["compile", ckpt, "--decode", "--max-context", "8", "-o", str(out)]) == 0
    why = "pages of bfloat16 are not built (float32 and float16 are)"
    assert f"kv cache static: {why}" in capsys.readouterr().err
    b = load_bundle(out)
    assert b.generation.paged is None and [p.input for p in b.state][:2] == ["k_cache_0", "v_cache_0"]
    assert json.loads((out / "bundle.json").read_text())["source"]["decode"]["kv"] == {"layout": "static",
                                                                                       "reason": why}
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "static, [B, H_kv, T, D] per layer and sequence slot" in text and f"not paged    {why}" in text
    for source in (ckpt, str(tmp_path / "step.pt2")):
        assert main(["compile", source, "--decode", "--max-context", "8", "--kv", "paged", "--quiet",
                     "-o", str(tmp_path / "p")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--kv paged" in err[0], err
    assert not (tmp_path / "p").exists()
