"""`tvmpipe generate` as the app tests run it: the CLI's `main` in this process (stdout and stderr
from capsys), and transformers' chat prompt ids as the oracle of `--chat` and `messages` lines."""

from __future__ import annotations

import json


def generate(capsys, bundle, *argv) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `tvmpipe generate BUNDLE ARGV...`."""
    from tvmpipe.cli import main

    code = main(["generate", str(bundle), *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def generate_json(capsys, bundle, *argv) -> dict:
    """A --json run that succeeded: all of stdout is the document (json.loads of all of it)."""
    code, out, err = generate(capsys, bundle, "--json", *argv)
    assert code == 0, err[-3000:]
    doc = json.loads(out)
    assert doc["error"] is None, doc["error"]
    return doc


def chat_ids(hf, messages) -> list[int]:
    """transformers' prompt ids of a chat (apply_chat_template, the generation prompt added)."""
    ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
