"""Fixtures of the `tvmpipe generate` text and job tests: the fixture decode step (vocabulary 64,
context 16) with a word-level tokenizer over its 64 words (a chat template in its config) inside it,
as `tvmpipe compile DIR` leaves a checkpoint's; transformers' tokenizer on the same directory as the
oracle of ids and text; the single-process loop as the oracle of greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def word_tokenizer(tmp_path_factory) -> Path:
    from tests.support.decode_bundle import write_chat_tokenizer

    return write_chat_tokenizer(tmp_path_factory.mktemp("tok") / "words")


@pytest.fixture(scope="session")
def text_bundle(decode_bundle, word_tokenizer, tmp_path_factory) -> Path:
    """The session's decode step with the tokenizer inside it (bundle.json names tokenizer/)."""
    from tests.support.decode_bundle import bundle_with_tokenizer

    return bundle_with_tokenizer(decode_bundle, word_tokenizer, tmp_path_factory.mktemp("text_bundle") / "bundle")


@pytest.fixture(scope="session")
def hf(word_tokenizer):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(word_tokenizer))


@pytest.fixture(scope="session")
def greedy(decode_bundle):
    """`greedy(ids, n)`: the single-process loop's tokens (greedy_decode), cached."""
    from tests.support.decode_bundle import runner_greedy
    from tvmpipe.bundle import load_bundle

    bundle, cache = load_bundle(decode_bundle), {}

    def get(ids, n):
        key = (tuple(ids), n)
        if key not in cache:
            cache[key] = runner_greedy(bundle, list(ids), n)[0]
        return cache[key]

    return get

