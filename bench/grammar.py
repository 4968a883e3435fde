"""What a response_format costs the sampling stage a token: llguidance's mask (executor.grammar).

    python bench/grammar.py [--vocab 32000] [--tokens 400] [--out bench/results/grammar.json]

A byte-level BPE tokenizer is trained here on this repository's text to `--vocab` ids (a
published model's is 32K-150K; nothing is downloaded), and a JSON schema of nested objects, arrays,
strings, integers and enums is compiled as `tvmpipe serve` compiles one (executor.grammar,
JSON_OPTIONS). A sequence then draws `--tokens` tokens the way the sampling stage does: the mask
(compute_bitmask, unpacked into a bool array over the vocabulary), the logits masked, a draw
from random logits, the matcher fed the token; restarted when the grammar ends. Reported: the
median and p99 microseconds a token of the mask alone, and of the whole constrained draw against
the same draw unconstrained (np.argmax over the masked or plain logits), and the one-time cost of
the tokenizer and the grammar.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from stamp import stamp  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "role", "tags", "address"], "additionalProperties": False}


def train_tokenizer(vocab: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    files = [p for ext in ("*.py", "*.md") for p in ROOT.rglob(ext) if ".venv" not in p.parts]
    texts = (p.read_text(errors="ignore") for p in files)
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok.to_str()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "grammar.json")
    args = ap.parse_args()
    from tvmpipe.executor.grammar import Constrained, json_grammar, make_tokenizer

    t0 = time.perf_counter()
    tokenizer_json = train_tokenizer(args.vocab)
    trained = time.perf_counter() - t0
    t0 = time.perf_counter()
    tokenizer = make_tokenizer(tokenizer_json, args.vocab, [0])
    tokenizer_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = json_grammar(SCHEMA)
    grammar_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    mask_us, constrained_us, plain_us, texts = [], [], [], []
    c, first_mask_us, out = Constrained(tokenizer, grammar), [], []
    for _ in range(args.tokens):
        logits = rng.standard_normal(args.vocab)
        t0 = time.perf_counter()
        allowed = c.allowed(args.vocab)
        t1 = time.perf_counter()
        t = int(np.argmax(np.where(allowed, logits, -np.inf)))
        ok = c.take(t) if t != 0 else True
        t2 = time.perf_counter()
        int(np.argmax(logits))
        t3 = time.perf_counter()
        (first_mask_us if not out else mask_us).append((t1 - t0) * 1e6)
        constrained_us.append((t2 - t0) * 1e6)
        plain_us.append((t3 - t2) * 1e6)
        out.append(t)
        if t == 0 or not ok or c.matcher.is_stopped():
            texts.append(tokenizer.decode_str([x for x in out if x != 0]))
            c, out = Constrained(tokenizer, grammar), []
    for text in texts:
        json.loads(text)  # every finished answer is JSON
    results = {"vocab": args.vocab, "tokens": args.tokens, "answers": len(texts), "schema": SCHEMA,
               "tokenizer_train_s": trained, "tokenizer_build_s": tokenizer_s, "grammar_compile_s": grammar_s,
               "first_mask_us": first_mask_us, "mask_us_p50": statistics.median(mask_us), "mask_us_p99": pct(mask_us, 0.99),
               "constrained_draw_us_p50": statistics.median(constrained_us),
               "plain_draw_us_p50": statistics.median(plain_us), "example": texts[0] if texts else None}
    print(f"vocab {args.vocab}: mask p50 {results['mask_us_p50']:.0f} us, p99 {results['mask_us_p99']:.0f} us a token; "
          f"constrained draw p50 {results['constrained_draw_us_p50']:.0f} us against {results['plain_draw_us_p50']:.0f} us "
          f"unconstrained; tokenizer {tokenizer_s * 1e3:.0f} ms once, grammar {grammar_s * 1e3:.1f} ms a schema; "
          f"{len(texts)} answers, all JSON")
    from tvmpipe.core.files import write_json

    write_json(args.out, stamp(results))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
