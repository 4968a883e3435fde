"""A tokenizer that can spell JSON and tool calls within the zoo decoders' 128 ids, with a
Qwen2.5-style chat template that writes tools (issue 51: response_format and tools against tiny
checkpoints; the word-level tokenizer of tests/support/checkpoints.py has no punctuation)."""

from __future__ import annotations

from pathlib import Path

JSON_EOS = 2  # <|im_end|>

# Qwen2.5's chat template, its system text cut (the checkpoint's context is 256): tools in
# <tools></tools>, calls as <tool_call> JSON (the "hermes" format of generation/tools.py), results
# as <tool_response>
HERMES = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- endif %}"
    "{{- '<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def build_json_tokenizer(directory: Path, without: str = "") -> Path:
    """A byte-level BPE over printable ASCII and newline that fits the checkpoint's 128 ids (so the
    model can spell JSON and tool calls), ChatML specials, <|im_end|> the eos; `without`:
    characters left out of its alphabet and corpus (a tokenizer that cannot write them)."""
    import json
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = visible[:], 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            chars.append(256 + extra)
            extra += 1
    byte_char = {b: chr(c) for b, c in zip(visible, chars)}  # GPT-2's bytes_to_unicode
    alphabet = [byte_char[ord(c)] for c in string.printable if c not in "\t\r\x0b\x0c" + without]
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=alphabet, limit_alphabet=len(alphabet), show_progress=False)
    corpus = ['{"city": "Paris", "ok": true, "n": 12}', "Answer in JSON."]
    tok.train_from_iterator(["".join(c for c in line if c not in without) for line in corpus] * 20, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": HERMES}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": JSON_EOS}))
    return directory
