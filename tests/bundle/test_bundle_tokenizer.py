"""bundle.json `tokenizer`: the directory in the bundle that holds a checkpoint's tokenizer files
(docs/bundle-format.md). write_bundle copies the files there and checksums them in `files`; a
loader refuses a bad name, a missing directory, a changed file, a `files` entry in any other
directory, and the key in a version-1 bundle; bundles without it load as before."""

from __future__ import annotations

import json

import pytest

from tests.support.bundle_edits import edit_json
from tests.support.paths import EXAMPLES_DIR
from tests.support.tiny_bundle import write_tiny
from tvmpipe.bundle import load_bundle
from tvmpipe.bundle.errors import BundleError


@pytest.fixture
def with_tokenizer(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.json").write_text('{"model": {}}')
    (src / "generation_config.json").write_text('{"eos_token_id": [2, 7]}')
    return write_tiny(tmp_path / "b", tokenizer=[src / "tokenizer.json", src / "generation_config.json"])


def test_the_files_are_copied_checksummed_and_found(with_tokenizer):
    b = load_bundle(with_tokenizer)
    assert b.tokenizer_dir == with_tokenizer / "tokenizer"
    assert (b.tokenizer_dir / "generation_config.json").read_text() == '{"eos_token_id": [2, 7]}'
    m = json.loads((with_tokenizer / "bundle.json").read_text())
    assert m["tokenizer"] == "tokenizer" and m["version"] == 2
    assert {"tokenizer/tokenizer.json", "tokenizer/generation_config.json"} <= set(m["files"])


def test_a_changed_or_missing_tokenizer_file_is_refused(with_tokenizer):
    (with_tokenizer / "tokenizer" / "tokenizer.json").write_text("{}")
    with pytest.raises(BundleError, match="tokenizer/tokenizer.json: sha256 differs from bundle.json"):
        load_bundle(with_tokenizer)
    import shutil

    (with_tokenizer / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(BundleError, match="the tokenizer directory bundle.json names holds no tokenizer.json"):
        load_bundle(with_tokenizer)
    shutil.rmtree(with_tokenizer / "tokenizer")
    with pytest.raises(BundleError, match="the tokenizer directory bundle.json names is missing"):
        load_bundle(with_tokenizer)


@pytest.mark.parametrize("value,files,match", [
    ("../elsewhere", None, "tokenizer: must be null or a directory name inside the bundle"),
    ("tokenizer", {"other/tokenizer.json": "0" * 64}, "files.other/tokenizer.json: must map a file name inside"),
    (None, {"tokenizer/tokenizer.json": "0" * 64}, "files.tokenizer/tokenizer.json: must map a file name inside"),
])
def test_names_outside_the_tokenizer_directory_are_refused(with_tokenizer, value, files, match):
    def edit(m):
        m["tokenizer"] = value
        if files:
            m["files"].update(files)

    edit_json(with_tokenizer, "bundle.json", edit)
    with pytest.raises(BundleError, match=match):
        load_bundle(with_tokenizer)


def test_a_version_1_bundle_cannot_name_one_and_old_bundles_have_none(tmp_path):
    for name in ("mlp", "cnn"):
        assert load_bundle(EXAMPLES_DIR / name).tokenizer_dir is None
    b = write_tiny(tmp_path / "v1")
    assert load_bundle(b).tokenizer_dir is None and "tokenizer" not in json.loads((b / "bundle.json").read_text())
    edit_json(b, "bundle.json", lambda m: m.update(version=1, tokenizer="tokenizer"))
    with pytest.raises(BundleError, match="tokenizer: needs format version 2"):
        load_bundle(b)
