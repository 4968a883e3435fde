"""Structured output at the sampler: token masks from a grammar, with llguidance.

A sequence whose output must follow a grammar (a served `response_format`: a JSON schema, or any
JSON object) draws each token from its logits with every token the grammar cannot take next ruled
out. The mask is computed where the logits are, on the sampling stage (executor.sampler), from an
llguidance matcher per sequence that consumes the tokens the sequence draws.

Why llguidance (of the three the issue names, all on PyPI): it has no dependencies (a 3 MB Rust
wheel; xgrammar's requires torch and transformers, which neither the server nor its stages load),
compiles a JSON schema lazily (outlines-core builds an index over the whole vocabulary per schema
first), builds its tokenizer from the `tokenizers` library's tokenizer.json alone, and computes a
mask in tens of microseconds (docs/serving.md has the measured cost).

A matcher's state is a function of the tokens the sequence generated, so it follows the
tokens the sampling stage keeps for the sequence (SequenceStates): before each draw it is rolled
back or fed forward to exactly the tokens generated before it. A restart, a roll-back, a replay
change nothing in what it allows.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # a dependency of tvmpipe: only a broken install lacks it
        raise RuntimeError("structured output needs the llguidance package (pip install llguidance)") from exc
    return llguidance


# JSON as Python's json.dumps writes it: ", " and ": ", no other whitespace. With any whitespace allowed
# (llguidance's default, and vLLM's), a model may write spaces until max_tokens (small ones do); a
# schema's own "x-guidance" options still override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_grammar(schema: dict | None) -> str:
    """The llguidance grammar of JSON following `schema` (None: any JSON object), written with
    JSON_OPTIONS; ValueError if the schema is not one llguidance can compile."""
    ll = _llguidance()
    import json

    grammar = ll.LLMatcher.grammar_from_json_schema(json.dumps(schema if schema is not None else {"type": "object"}),
                                                    defaults=JSON_OPTIONS)
    error = ll.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise ValueError(error)
    return grammar


def lark_grammar(lark: str) -> str:
    """The llguidance grammar of a Lark grammar (llguidance's dialect: `%json {schema}` inlines a
    JSON schema); ValueError if it does not compile."""
    ll = _llguidance()
    grammar = ll.LLMatcher.grammar_from_lark(lark)
    error = ll.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise ValueError(error)
    return grammar


def make_tokenizer(tokenizer_json: str, vocab: int, eos: Sequence[int]) -> Any:
    """llguidance's tokenizer of a tokenizer.json (the `tokenizers` library's), over the model's
    `vocab` ids, ending a sequence with any of `eos`."""
    return _llguidance().LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=list(eos) or None)


def can_begin(tokenizer: Any, grammar: str, size: int, tries: int = 16) -> bool:
    """Whether some token of a `size`-logit vocabulary can begin output that `grammar` allows.
    The first mask alone does not say: where the grammar's first bytes are forced and no token
    spells them (a vocabulary without '{' for JSON), llguidance's mask still allows a few tokens,
    each of which the matcher then refuses. So the mask's first `tries` tokens are each tried on a
    matcher of their own (the first one takes in any vocabulary that can begin at all)."""
    ll = _llguidance()
    first = Constrained(tokenizer, grammar, log_level=0)
    for token in np.flatnonzero(first.allowed(size))[:tries]:
        m = ll.LLMatcher(tokenizer, grammar, log_level=0)
        if m.consume_token(int(token)) and not m.is_error():
            return True
    return False


class Constrained:
    """One sequence's matcher: `consumed` tokens of its output taken so far."""

    def __init__(self, tokenizer: Any, grammar: str, log_level: int = 1):
        self.matcher = _llguidance().LLMatcher(tokenizer, grammar, log_level=log_level)
        self.consumed = 0
        self.vocab = tokenizer.vocab_size

    def sync(self, output: Sequence[int]) -> bool:
        """Take the matcher to exactly the generated tokens `output` (rolling back what lost steps
        drew, feeding what it missed); False if they do not fit the grammar."""
        n = len(output)
        if self.consumed > n:
            if not self.matcher.rollback(self.consumed - n):
                return False
            self.consumed = n
        if self.consumed < n:
            if not self.matcher.consume_tokens([int(t) for t in output[self.consumed:]]):
                return False
            self.consumed = n
        return not self.matcher.is_error()

    def allowed(self, size: int) -> np.ndarray:
        """The tokens the grammar takes next, as a bool mask over `size` logits."""
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        mask = np.zeros(size, dtype=bool)
        n = min(size, len(bits))
        mask[:n] = bits[:n].astype(bool)
        return mask

    def take(self, token: int) -> bool:
        ok = self.matcher.consume_token(int(token))
        if ok:
            self.consumed += 1
        return ok
