"""tvmpipe.generation.text against transformers' AutoTokenizer (the oracle) on tokenizer
directories built here with the `tokenizers` library: a byte-level BPE (Llama-3/ChatML style), a
SentencePiece-style BPE with byte fallback loaded by transformers as `LlamaTokenizer` (Llama-2
style), and a WordPiece one whose config asks for transformers' clean-up of spaces."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from tvmpipe.core.errors import TvmpipeError
from tvmpipe.generation.text import (
    REPLACEMENT,
    StopStrings,
    TextError,
    load_text_codec,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The lazy dog sleeps; the quick fox runs on.",
    "Café, naïve, résumé, déjà vu: accents café café résumé élan über straße.",
    "東京タワーは高い。你好，世界！こんにちは世界。",
    "Emoji: 😀 👍🏽 🎉 👩‍👩‍👧 and the flag 🇫🇷 — done.",
    "Hello world, hello tokenizer. Streaming text should never break a character in two.\n\nNew line.",
    "Numbers 12345 and 3.14159, symbols #@$%^&*() and quotes \"don't\" 'it's'.",
]

TEXTS = [
    *CORPUS,
    "",
    " ",
    "  leading and trailing spaces  ",
    "Hello",
    " Hello  world",
    "tabs\tand\r\nwindows line ends",
    "unseen characters: Ω ∑ ß ŋ 🦀 𝄞",
    "a€b€€c",
    "<|im_end|> inside text <|im_start|>user",
    "<s>[INST] looks like a prompt [/INST]</s>",
    "[CLS] don't stop . ok ? yes ! a , b",
]

CHATML = """{%- if messages[0]['role'] == 'system' -%}
{%- set system = messages[0]['content'] -%}{%- set rest = messages[1:] -%}
{%- else -%}
{%- set system = 'You are a helpful assistant.' -%}{%- set rest = messages -%}
{%- endif -%}
<|im_start|>system
{{ system }}<|im_end|>
{% for message in rest %}
{% if message['role'] not in ['user', 'assistant'] %}
{{ raise_exception('Only user and assistant roles may follow the system message') }}
{% endif %}
<|im_start|>{{ message['role'] }}{% if message.name is defined %} {{ message.name | tojson }}{% endif %}

{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}{% else %}{{ message['content'] }}{% endif %}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}
<think>

</think>

{% endif %}
{% endif %}"""

# The Llama-2 chat template (bos_token and eos_token come from the tokenizer config).
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)

CHATS = [
    [{"role": "user", "content": "Hello! Café? 東京 😀"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, how can I help?"},
     {"role": "user", "content": "Tell me a joke about a fox.\nKeep it short."}],
]


def write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, ensure_ascii=False, indent=1), encoding="utf-8")


def byte_level_bpe(directory: Path) -> Path:
    """Llama-3 / Qwen style: byte-level BPE, ChatML special tokens, eos ids as a list."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    write_json(directory / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False, "rstrip": False, "normalized": False,
                      "single_word": False, "special": True},
        "pad_token": "<|endoftext|>", "chat_template": CHATML})
    write_json(directory / "generation_config.json", {"eos_token_id": [2, 0], "pad_token_id": 0})
    return directory


def sentencepiece_bpe(directory: Path) -> Path:
    """Llama-2 style: Metaspace ("▁") BPE with byte fallback (<0xE2> tokens), <s> added by the
    post-processor; transformers loads it as its own LlamaTokenizer class."""
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=480, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens],
                                  limit_alphabet=60, show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    spec = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    # The byte tokens belong to the vocabulary, not to the added tokens (as in Llama's tokenizer.json).
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in byte_tokens]
    write_json(directory / "tokenizer.json", spec)
    write_json(directory / "tokenizer_config.json", {
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "legacy": False, "chat_template": LLAMA2})
    write_json(directory / "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2})
    return directory


def wordpiece(directory: Path) -> Path:
    """BERT style, decoding to "don ' t ." which transformers' clean_up_tokenization_spaces mends."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=False)
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"],
                                        show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                       special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    write_json(directory / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": True,
        "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]",
        "mask_token": "[MASK]"})
    return directory


BUILDERS = {"byte_level": byte_level_bpe, "sentencepiece": sentencepiece_bpe, "wordpiece": wordpiece}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {name: build(root / name) for name, build in BUILDERS.items()}


@pytest.fixture(scope="module")
def codecs(dirs):
    return {name: load_text_codec(path) for name, path in dirs.items()}


@pytest.fixture(scope="module")
def oracles(dirs):
    return {name: transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            for name, path in dirs.items()}


NAMES = list(BUILDERS)


def stream(codec, ids, skip_special_tokens=True):
    """The pieces a Detokenizer gives for ids, checking on the way that what is out is always a
    prefix of the decode of the ids so far (text once shown is never rewritten)."""
    det = codec.detokenizer(skip_special_tokens)
    pieces = []
    for k, token in enumerate(ids):
        pieces.append(det.push(token))
        assert codec.decode(ids[:k + 1], skip_special_tokens).startswith("".join(pieces))
    pieces.append(det.finish())
    return pieces


# --- encode / decode -------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_encode_and_decode_match_transformers(name, codecs, oracles):
    codec, oracle = codecs[name], oracles[name]
    if name == "sentencepiece":
        assert type(oracle).__name__ == "LlamaTokenizer"  # transformers rebuilt it from its own class
    for text in TEXTS:
        for add in (True, False):
            ids = codec.encode(text, add_special_tokens=add)
            assert ids == oracle.encode(text, add_special_tokens=add), (text, add)
        for skip in (False, True):
            assert codec.decode(ids, skip_special_tokens=skip) == oracle.decode(ids, skip_special_tokens=skip)
    rng = random.Random(7)
    for _ in range(50):
        ids = [rng.randrange(codec.vocab_size) for _ in range(rng.randrange(1, 30))]
        for skip in (False, True):
            assert codec.decode(ids, skip) == oracle.decode(ids, skip_special_tokens=skip), ids


def test_the_tokenizers_are_what_the_tests_need(codecs, oracles):
    """Guards the other tests' reach: characters really are split across tokens, the SentencePiece
    one really falls back to bytes, and the WordPiece one really needs the clean-up."""
    bl, sp, wp = codecs["byte_level"], codecs["sentencepiece"], codecs["wordpiece"]
    split_chars = [i for i in bl.encode("東京 😀 👩‍👩‍👧") if REPLACEMENT in bl.decode([i])]
    assert len(split_chars) >= 3
    assert any(sp.is_byte_token(i) for i in sp.encode("東京 😀"))
    assert bl.clean_up is False and sp.clean_up is False and wp.clean_up is True
    ids = wp.encode("don't stop .")
    assert wp.decode_raw(ids, True) != wp.decode(ids, True) == oracles["wordpiece"].decode(ids, skip_special_tokens=True)


def test_add_bos_token_and_missing_special_tokens_as_transformers(tmp_path):
    """transformers 5 keeps tokenizer.json's post-processor whatever add_bos_token says, and adds a
    named special token the vocabulary lacks as a new special token."""
    directory = byte_level_bpe(tmp_path / "t")
    config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.update({"bos_token": "<|endoftext|>", "add_bos_token": True, "eos_token": "<|eot|>",
                   "image_token": "<|image|>", "extra_special_tokens": ["<|tool|>"]})
    write_json(directory / "tokenizer_config.json", config)
    codec = load_text_codec(directory)
    oracle = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    text = "hi <|eot|> there<|tool|><|image|>"
    assert codec.encode(text) == oracle.encode(text)
    assert codec.encode(text)[0] != codec.token_id("<|endoftext|>")
    for token in ("<|eot|>", "<|image|>", "<|tool|>"):  # new ids, in transformers' order
        assert codec.token_id(token) == oracle.convert_tokens_to_ids(token) >= Tokenizer.from_file(
            str(directory / "tokenizer.json")).get_vocab_size()
    assert codec.config.special_tokens == oracle.special_tokens_map  # what chat templates see
    assert codec.decode(codec.encode(text), True) == oracle.decode(oracle.encode(text), skip_special_tokens=True)
    assert codec.stop_token_ids == (2, 0, codec.token_id("<|eot|>"))


def test_special_tokens_map_as_transformers(tmp_path):
    """A legacy checkpoint (no added_tokens_decoder in its config) takes its special tokens from
    special_tokens_map.json, over the config's."""
    directory = byte_level_bpe(tmp_path / "t")
    write_json(directory / "special_tokens_map.json", {"eos_token": {"content": "<|endoftext|>"},
                                                       "pad_token": "<|im_start|>"})
    codec = load_text_codec(directory)
    oracle = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    assert codec.eos_token == oracle.eos_token == "<|endoftext|>"
    assert codec.pad_token == oracle.pad_token == "<|im_start|>"
    assert codec.config.special_tokens == oracle.special_tokens_map


def test_no_tokenizer_config_at_all(tmp_path, dirs):
    directory = tmp_path / "bare"
    directory.mkdir()
    (directory / "tokenizer.json").write_bytes((dirs["byte_level"] / "tokenizer.json").read_bytes())
    codec = load_text_codec(directory)
    oracle = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    for text in TEXTS:
        assert codec.encode(text) == oracle.encode(text)
    assert codec.stop_token_ids == () and not codec.has_chat_template


# --- streaming -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_streaming_pieces_join_to_decode(name, codecs):
    codec = codecs[name]
    for text in TEXTS:
        for skip in (True, False):
            ids = codec.encode(text)
            pieces = stream(codec, ids, skip)
            assert "".join(pieces) == codec.decode(ids, skip), (text, pieces)
            if name != "wordpiece":  # its unknown characters are [UNK], never U+FFFD
                assert not any(REPLACEMENT in piece for piece in pieces), (text, pieces)


def test_streaming_holds_a_split_character_until_it_is_whole(codecs):
    codec = codecs["byte_level"]
    ids = codec.encode("😀")
    assert len(ids) > 1  # four bytes over several tokens
    det = codec.detokenizer()
    assert [det.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert det.push(ids[-1]) == "😀"
    assert det.finish() == ""


def test_streaming_sentencepiece_spaces_and_byte_runs(codecs):
    """The leading "▁" of the first token is dropped, later ones become spaces; a byte-fallback run
    (€ as <0xE2><0x82><0xAC>) comes out whole, once the run has ended."""
    codec = codecs["sentencepiece"]
    ids = codec.encode("Hello €€ world", add_special_tokens=False)
    pieces = [piece for piece in stream(codec, ids) if piece]
    assert codec.tokenizer.id_to_token(ids[0]).startswith("▁") and not pieces[0].startswith(" ")
    assert any(piece.startswith(" ") for piece in pieces[1:])
    assert "".join(pieces) == "Hello €€ world" == codec.decode(ids)
    assert any(piece.startswith("€€") for piece in pieces)  # the run, whole, with the next token's text


IDS = st.lists(st.integers(min_value=0, max_value=500), min_size=1, max_size=24)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=IDS, skip=st.booleans())
def test_streaming_any_ids_join_to_decode(name, codecs, ids, skip):
    """Any id sequence at all (invalid UTF-8, special tokens between byte tokens, ids the tokenizer
    does not know): the pieces join to the full decode and text once out is never rewritten."""
    codec = codecs[name]
    assert "".join(stream(codec, ids, skip)) == codec.decode(ids, skip)


# --- stop strings ----------------------------------------------------------------------------


def cut_at_stops(text: str, stops) -> str:
    found = [text.find(s) for s in stops if s in text]
    return text[:min(found)] if found else text


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc ", max_size=30),
       stops=st.lists(st.text(alphabet="abc ", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=10))
def test_stop_strings_cut_at_the_first_whatever_the_split(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    matcher = StopStrings(stops)
    out = [matcher.push(text[a:b]) for a, b in itertools.pairwise(bounds)]
    out.append(matcher.finish())
    assert "".join(out) == cut_at_stops(text, stops)
    assert matcher.stopped == any(s in text for s in stops)


def test_stop_string_spanning_tokens_never_shows(codecs):
    codec = codecs["byte_level"]
    text = "The quick brown fox jumps over the lazy dog. The lazy dog sleeps."
    ids = codec.encode(text)
    stop = "lazy dog"
    assert len(codec.encode(stop)) > 1
    ts = codec.text_stream(stop=[stop, "never"])
    shown = []
    for i in ids:
        step = ts.push(i)
        shown.append(step.text)
        if step.finished:
            break
    assert step.finished and step.reason == "stop_string" and ts.reason == "stop_string"
    assert "".join(shown) == ts.text == "The quick brown fox jumps over the "
    for k in range(1, len(stop)):  # not even the beginning of the stop string came out early
        assert not "".join(shown).endswith(stop[:k])
    assert ts.push(ids[0]).text == "" and ts.finish() == ""


def test_stop_string_inside_one_token_with_more_text(codecs):
    codec = codecs["byte_level"]
    text = "Hello world, hello tokenizer."
    ids = codec.encode(text)
    token_text = next(t for t in (codec.decode([i]) for i in ids) if len(t.strip()) >= 4)
    stop = token_text.strip()[1:3]  # a token holds the stop string with text on both sides
    ts = codec.text_stream(stop=[stop])
    for i in ids:
        if ts.push(i).finished:
            break
    assert ts.finished and ts.reason == "stop_string"
    assert ts.text == text[:text.find(stop)] and stop not in ts.text


def test_stop_token_ends_and_flushes_held_text(codecs):
    codec = codecs["byte_level"]
    body = codec.encode("Hello wor")
    ts = codec.text_stream(stop=["world"])
    shown = "".join(ts.push(i).text for i in body)
    assert shown == "Hello "  # "wor" may begin "world": held
    step = ts.push(codec.token_id("<|im_end|>"))
    assert step == type(step)("wor", True, "stop_token")
    assert ts.text == "Hello wor" and ts.push(body[0]).text == ""


def test_length_end_flushes_held_text_and_a_last_stop(codecs):
    codec = codecs["sentencepiece"]
    ts = codec.text_stream(stop=["dog"])
    for i in codec.encode("the lazy do", add_special_tokens=False):
        ts.push(i)
    assert ts.finish() == "do" and ts.text == "the lazy do" and ts.reason is None
    ts = codec.text_stream(stop=["€"])
    for i in codec.encode("a€b", add_special_tokens=False)[:-1]:
        assert not ts.push(i).finished
    assert ts.finish() == "" and ts.text == "a" and ts.reason == "stop_string"


# --- stop token ids --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece"])
def test_stop_token_ids_from_generation_config(name, dirs, codecs):
    codec = codecs[name]
    eos = transformers.GenerationConfig.from_pretrained(str(dirs[name])).eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    assert list(codec.stop_token_ids[:len(eos)]) == eos
    assert codec.token_id(codec.eos_token) in codec.stop_token_ids
    assert codec.stop_token_ids == {"byte_level": (2, 0), "sentencepiece": (2,)}[name]


# --- chat templates --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece"])
def test_chat_template_matches_transformers(name, codecs, oracles):
    codec, oracle = codecs[name], oracles[name]
    for chat in CHATS:
        for gen in (True, False):
            text = codec.render_chat(chat, add_generation_prompt=gen)
            assert text == oracle.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            ids = codec.apply_chat_template(chat, add_generation_prompt=gen)
            want = oracle.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen, return_dict=False)
            assert ids == list(want)
    if name == "sentencepiece":  # the template writes <s>; tokenizing must not add another
        assert codec.apply_chat_template(CHATS[0])[:2] != [1, 1]
        assert codec.apply_chat_template(CHATS[0])[0] == 1


def test_chat_system_argument_variables_and_tojson(codecs, oracles):
    codec, oracle = codecs["byte_level"], oracles["byte_level"]
    chat = [{"role": "user", "content": "Bonjour", "name": "Zoë"}]
    assert codec.render_chat(chat, system="Sois bref.") == oracle.apply_chat_template(
        [{"role": "system", "content": "Sois bref."}, *chat], tokenize=False, add_generation_prompt=True)
    thinking_off = codec.render_chat(chat, variables={"enable_thinking": False})
    assert thinking_off == oracle.apply_chat_template(chat, tokenize=False, add_generation_prompt=True,
                                                      enable_thinking=False)
    assert '"Zoë"' in thinking_off and "<think>" in thinking_off


def test_chat_template_file_and_named_templates_as_transformers(tmp_path):
    directory = byte_level_bpe(tmp_path / "t")
    config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = [{"name": "default", "template": CHATML},
                               {"name": "plain", "template": "{% for m in messages %}{{ m.content }}|{% endfor %}"}]
    write_json(directory / "tokenizer_config.json", config)
    codec = load_text_codec(directory)
    oracle = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    chat = CHATS[2]
    assert codec.render_chat(chat) == oracle.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert codec.render_chat(chat, template="plain") == oracle.apply_chat_template(
        chat, chat_template="plain", tokenize=False)
    # chat_template.jinja takes precedence over the config's templates
    (directory / "chat_template.jinja").write_text("{{ bos_token }}{% for m in messages %}[{{ m.role }}] "
                                                   "{{ m.content }}\n{% endfor %}", encoding="utf-8")
    codec = load_text_codec(directory)
    oracle = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    assert codec.render_chat(chat) == oracle.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert codec.render_chat(chat).startswith("[user] Hi\n")


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message and isinstance(exc.value, TvmpipeError)
    return message


def test_chat_errors_are_one_line(codecs, dirs):
    codec = codecs["sentencepiece"]
    with pytest.raises(TextError) as exc:  # the template's own raise_exception
        codec.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert "Conversation roles must alternate" in one_line(exc) and "tokenizer_config.json" in one_line(exc)
    bad = [
        ([{"role": "user"}], "messages[0].content: missing"),
        ([{"role": "user", "content": ["a"]}], "messages[0].content: expected a string, got list"),
        ([{"role": 3, "content": "a"}], "messages[0].role: expected a string, got int"),
        ([{"role": "user", "content": "a"}, "hello"], "messages[1]: expected an object"),
        ("hello", "messages: expected a list"),
        ([], "messages: empty"),
        ([{"role": "user", "content": "a", "extra": object()}], "messages[0].extra: expected JSON data"),
    ]
    for messages, message in bad:
        with pytest.raises(TextError) as exc:
            codec.apply_chat_template(messages)
        assert message in one_line(exc), messages
    with pytest.raises(TextError) as exc:
        codecs["wordpiece"].apply_chat_template(CHATS[0])
    assert "has no chat template" in one_line(exc) and str(dirs["wordpiece"]) in one_line(exc)


def test_broken_template_is_one_line_naming_its_file(tmp_path):
    directory = byte_level_bpe(tmp_path / "t")
    (directory / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }", encoding="utf-8")
    codec = load_text_codec(directory)  # loading works: plain prompts need no template
    with pytest.raises(TextError) as exc:
        codec.render_chat(CHATS[0])
    assert "chat_template.jinja: chat template line 1" in one_line(exc)


def test_the_sandbox_holds(tmp_path):
    """Templates come from the Hub: transformers' immutable sandbox, and its namespace() that
    refuses underscore names, hold here too."""
    directory = byte_level_bpe(tmp_path / "t")
    for source, message in [
        ("{% set ns = namespace(_hidden=1) %}{{ ns._hidden }}", "SecurityError"),
        ("{{ messages.append({'role': 'x'}) }}", "SecurityError"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),
    ]:
        (directory / "chat_template.jinja").write_text(source, encoding="utf-8")
        with pytest.raises(TextError) as exc:
            load_text_codec(directory).render_chat(CHATS[0])
        assert message in one_line(exc), source


# --- loading errors --------------------------------------------------------------------------


def test_loading_errors_are_one_line_naming_the_file(tmp_path, dirs):
    with pytest.raises(TextError) as exc:
        load_text_codec(tmp_path / "nowhere")
    assert "not a directory" in one_line(exc)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TextError) as exc:
        load_text_codec(tmp_path / "empty")
    assert f"{tmp_path / 'empty' / 'tokenizer.json'}: missing" in one_line(exc)

    def broken(name: str, content: str, *, file: str = "tokenizer.json") -> str:
        directory = byte_level_bpe(tmp_path / name)
        (directory / file).write_text(content, encoding="utf-8")
        with pytest.raises(TextError) as exc:
            load_text_codec(directory)
        message = one_line(exc)
        assert str(directory / file) in message
        return message

    assert "not valid JSON (line 1 column" in broken("cut", '{"version": "1.0", "model": ')
    assert "cannot read it" in broken("notatok", '{"model": {"type": "Nonsense"}}')
    assert "not valid JSON" in broken("badcfg", "{'single': 'quotes'}", file="tokenizer_config.json")
    assert "eos_token_id[1]: expected a non-negative token id" in broken(
        "badgen", '{"eos_token_id": [2, "x"]}', file="generation_config.json")
    assert "eos_token: expected a string or an AddedToken" in broken(
        "badeos", '{"eos_token": 5}', file="tokenizer_config.json")
    assert "chat_template[0]: expected an object" in broken(
        "badtpl", '{"chat_template": [{"name": "default"}]}', file="tokenizer_config.json")


def test_bad_arguments_are_one_line(codecs):
    codec = codecs["byte_level"]
    for call, message in [
        (lambda: codec.encode(b"bytes"), "expected a string, got bytes"),
        (lambda: codec.decode([1, -2]), "non-negative token id, got -2"),
        (lambda: codec.decode([1, "x"]), "expected a token id, got str"),
        (lambda: StopStrings(["ok", ""]), "stop[1]: expected a non-empty string"),
        (lambda: codec.text_stream(stop_token_ids=[-1]), "stop token id"),
    ]:
        with pytest.raises(TextError) as exc:
            call()
        assert message in one_line(exc)


def test_import_needs_neither_torch_nor_transformers():
    code = ("import sys, tvmpipe.generation.text; "
            "bad = [m for m in ('torch', 'transformers', 'torchvision') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
