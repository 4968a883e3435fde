"""Hugging Face checkpoint directories for `tvmpipe compile DIR`, written by `save_pretrained`.

Every checkpoint is a transformers model of the zoo's tiny configs (compiler/decoders.py: 2 layers,
hidden 64, vocabulary 128) with the zoo's seeded random weights, saved in a dtype, as one
`model.safetensors` or as shards with `model.safetensors.index.json` (`shard`: a small
`max_shard_size`), its embedding tied to the LM head or not. `with_tokenizer` adds the files a
generation layer reads: a real `tokenizers` tokenizer.json over the 128 ids, tokenizer_config.json
(with a chat template), special_tokens_map.json and chat_template.jinja (generation_config.json is
written by save_pretrained itself).

COVER is the covering set the tests compile: every family once; fp32 and bf16, one file and
shards, tied and untied each on five of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DECODE_CONTEXT = 24  # the decode steps' max context
FORWARD_LENGTH = 8  # the forward passes' sequence length
SEEDS = {"opt": 4}  # seed 1's OPT repeats one token (as in tests/compiler/test_decode.py)
SHARD = "100KB"  # the tiny models' 0.3-0.6 MB of weights in 3-6 shards


@dataclass(frozen=True)
class Case:
    family: str
    dtype: str
    shards: bool
    tied: bool


COVER = {c.family: c for c in (
    Case("gpt2", "float32", True, True),
    Case("llama", "bfloat16", False, True),
    Case("qwen2", "float32", False, False),
    Case("mistral", "bfloat16", True, False),
    Case("qwen3", "bfloat16", False, False),
    Case("gemma", "float32", True, True),
    Case("phi3", "bfloat16", True, False),
    Case("gpt_neox", "float32", False, False),
    Case("opt", "bfloat16", False, True),
    Case("falcon", "float32", True, True),
)}


def seed_of(family: str) -> int:
    return SEEDS.get(family, 1)


def write_checkpoint(out: Path, case: Case, with_tokenizer: bool = False) -> Path:
    """`case`'s model saved with save_pretrained into `out` (and its tokenizer files)."""
    import torch

    from tvmpipe.compiler.decoders import build_decoder

    model = build_decoder(case.family, seed_of(case.family), tie_word_embeddings=case.tied)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == case.tied
    model = model.to(getattr(torch, case.dtype))
    model.save_pretrained(out, **({"max_shard_size": SHARD} if case.shards else {}))
    if with_tokenizer:
        write_tokenizer(out, model.config.vocab_size)
    return out


CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}<|assistant|>"


def write_tokenizer(out: Path, vocab: int) -> list[str]:
    """A word-level tokenizer over `vocab` ids (w0 .. w{vocab-3}, <s>, </s>) and its config files;
    returns the file names written besides save_pretrained's generation_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(vocab - 2)} | {"<s>": vocab - 2, "</s>": vocab - 1}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "w0", "chat_template": CHAT_TEMPLATE}))
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                              "unk_token": "w0"}))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]


def load_transformers(path: Path, dtype: str):
    """transformers' own model of the checkpoint (the token oracle): from_pretrained, local files
    only, eager attention, in `dtype`."""
    import torch

    from tvmpipe.compiler.zoo import ensure_torchvision

    ensure_torchvision()
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=getattr(torch, dtype), local_files_only=True, attn_implementation="eager").eval()


def tensor_bytes(path: Path, at_least: int = 0) -> int:
    """The weights' bytes as the checkpoint stores them (every safetensors file's tensors of at
    least `at_least` bytes)."""
    from tvmpipe.bundle.weights import WeightsFile

    total = 0
    for f in sorted(path.glob("*.safetensors")):
        wf = WeightsFile(f)
        total += sum(t.nbytes for t in wf.tensors.values() if t.nbytes >= at_least)
        wf.close()
    return total
