"""Text in and text out for the decoders, with `tokenizers` and jinja2 alone: no torch and no
transformers at run time, yet the same ids, text and chat prompts as transformers' `AutoTokenizer`
on the same files (the tests hold it to that, with transformers as the oracle).

A tokenizer directory is the Hugging Face layout, as found in a checkpoint and as `tvmpipe compile`
copies it into a bundle's `tokenizer/`:

  tokenizer.json            required: the `tokenizers` pipeline (normalizer, pre-tokenizer, model,
                            post-processor, decoder) and its added tokens
  tokenizer_config.json     special token strings, `chat_template`, `clean_up_tokenization_spaces`, ...
  chat_template.jinja       the chat template; it and `additional_chat_templates/*.jinja` take
                            precedence over the config's `chat_template`, as in transformers
  generation_config.json    `eos_token_id` (an id or a list), `bos_token_id`, `pad_token_id`
  special_tokens_map.json   legacy special token strings (read only where the config has no
                            `added_tokens_decoder`, as transformers does)

`load_text_codec(dir)` reads them once into a `TextCodec`: `encode`, `decode`, `apply_chat_template`,
`stop_token_ids`, and the streaming pieces a generation loop needs: `Detokenizer` (one token id in,
the new text out, never a broken character nor text a later token would change), `StopStrings`
(holds back what could begin a stop string, cuts at the first one) and `TextStream`, which joins
them with the stop token ids.

Why the details below follow transformers 5 rather than the files alone: a user compares our output
with what `AutoTokenizer` gives for the same checkpoint. So `add_bos_token` in the config does not
change encoding when tokenizer.json exists (transformers 5 drops it and keeps the file's
post-processor); named special tokens missing from the added vocabulary are added, as special; and
`clean_up_tokenization_spaces` applies only to non-BPE models. Where a config names a
model-specific tokenizer class (e.g. `LlamaTokenizer`) transformers 5 rebuilds the pipeline from the
class; this module always runs tokenizer.json as written, which is what that class rebuilds for
checkpoints that were saved by it.
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
from tokenizers import AddedToken, Tokenizer
from tvmpipe.bundle.bundle import (CHAT_TEMPLATE_FILE, GENERATION_CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE,
                                   TOKENIZER_CONFIG_FILE, TOKENIZER_FILE)
from tvmpipe.core.errors import TvmpipeError

CHAT_TEMPLATE_DIR = "additional_chat_templates"

# transformers' SPECIAL_TOKENS_ATTRIBUTES: the named special tokens, which chat templates see as variables.
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# The replacement character: what a decoder writes for bytes that do not (yet) make a character.
REPLACEMENT = "\ufffd"


class TextError(TvmpipeError):
    """A tokenizer directory, a chat or a text-generation argument is unusable (one line, naming
    the file or field)."""


# ---------------------------------------------------------------------------------------------
# What the directory says
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatTemplate:
    """One Jinja chat template and the file it came from (named in errors about it)."""

    name: str
    source: str
    origin: Path


@dataclass(frozen=True)
class TextConfig:
    """The JSON files beside tokenizer.json, read and checked once.

    `special_tokens` are the named special tokens that are set (``{"eos_token": "</s>"}``): chat
    templates see them as variables. `declared_tokens` (the config's `added_tokens_decoder`) and
    `special_added` (named and extra special tokens) are what transformers hands the tokenizer on
    load. `eos_token_ids` come from generation_config.json, in its order. `clean_up_spaces` is
    transformers' string clean-up after decoding (" ." -> "."), which it skips for BPE models
    unless `clean_up_bpe`."""

    directory: Path
    special_tokens: dict[str, str] = field(default_factory=dict)
    declared_tokens: tuple[AddedToken, ...] = ()
    special_added: tuple[AddedToken, ...] = ()
    chat_templates: dict[str, ChatTemplate] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    clean_up_spaces: bool = False
    clean_up_bpe: bool = False
    split_special_tokens: bool = False


def _read_text(path: Path, required: bool) -> str | None:
    """The file's text; None for a missing optional one; a one-line TextError naming it otherwise."""
    if not path.exists():
        if required:
            raise TextError(f"{path}: missing (a tokenizer directory needs the `tokenizers` library's "
                            f"{path.name})")
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TextError(f"{path}: cannot read it ({type(exc).__name__}: {_first_line(exc)})") from None


def _parse_json(text: str, path: Path) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise TextError(f"{path}: not valid JSON (line {exc.lineno} column {exc.colno}: {exc.msg})") from None


def _read_json(path: Path, required: bool) -> Any:
    """The parsed file, or None for a missing optional one."""
    text = _read_text(path, required)
    return None if text is None else _parse_json(text, path)


def _first_line(value: object) -> str:
    lines = str(value).strip().splitlines()
    return lines[0] if lines else ""


def _object(value: Any, path: Path) -> dict:
    if not isinstance(value, dict):
        raise TextError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _added_token(value: Any, where: str, named: bool = False) -> AddedToken:
    """A token given as a string (a special token) or as an AddedToken object ({"content": ...,
    "lstrip": ...}); a named special token is special whatever its object says, as in transformers
    (which sets the flag after building the token, so `normalized` keeps its default for non-special)."""
    if isinstance(value, str):
        return AddedToken(value, special=True)
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        flags = {k: value[k] for k in ("single_word", "lstrip", "rstrip", "normalized", "special")
                 if isinstance(value.get(k), bool)}
        token = AddedToken(value["content"], **flags)
        if named and not token.special:
            token.special = True
        return token
    raise TextError(f"{where}: expected a string or an AddedToken object with a string \"content\", "
                    f"got {json.dumps(value)[:80]}")


def _token_id_field(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TextError(f"{where}: expected a non-negative token id, got {json.dumps(value)[:80]}")
    return value


def _token_ids_field(value: Any, where: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(_token_id_field(v, f"{where}[{i}]") for i, v in enumerate(value))
    return (_token_id_field(value, where),)


def _chat_templates(directory: Path, config: dict, config_path: Path) -> dict[str, ChatTemplate]:
    """The templates by name, "default" for the unnamed one. Template files win over the config's
    entry, all of them together, as transformers has it."""
    templates: dict[str, ChatTemplate] = {}
    for path in [directory / CHAT_TEMPLATE_FILE, *sorted((directory / CHAT_TEMPLATE_DIR).glob("*.jinja"))]:
        if not path.is_file():
            continue
        name = "default" if path.name == CHAT_TEMPLATE_FILE else path.name.removesuffix(".jinja")
        try:
            templates[name] = ChatTemplate(name, path.read_text(encoding="utf-8"), path)
        except (OSError, UnicodeDecodeError) as exc:
            raise TextError(f"{path}: cannot read it ({type(exc).__name__}: {_first_line(exc)})") from None
    if templates:
        return templates
    entry = config.get("chat_template")
    if entry is None:
        return {}
    if isinstance(entry, str):
        return {"default": ChatTemplate("default", entry, config_path)}
    if isinstance(entry, list):
        for i, item in enumerate(entry):
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)
                    and isinstance(item.get("template"), str)):
                raise TextError(f"{config_path}: chat_template[{i}]: expected an object with string "
                                "\"name\" and \"template\"")
            templates[item["name"]] = ChatTemplate(item["name"], item["template"], config_path)
        return templates
    raise TextError(f"{config_path}: chat_template: expected a string or a list of {{name, template}}, "
                    f"got {type(entry).__name__}")


def read_text_config(directory: str | Path) -> TextConfig:
    """Read the optional files of a tokenizer directory (not tokenizer.json itself) the way
    transformers' `AutoTokenizer.from_pretrained` reads them."""
    directory = Path(directory)
    config_path = directory / TOKENIZER_CONFIG_FILE
    config = _read_json(config_path, required=False)
    config = {} if config is None else _object(config, config_path)

    named: dict[str, Any] = {}
    model_specific: dict[str, Any] = {}
    for key, value in config.items():
        if key in NAMED_SPECIAL_TOKENS:
            if value is not None:
                named[key] = value
        elif key.endswith("_token") and isinstance(value, str):
            model_specific[key] = value  # e.g. "image_token": transformers makes it a named token too
    extras = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
    if isinstance(extras, dict):
        model_specific.update(extras)
        extras = []
    if not isinstance(extras, list):
        raise TextError(f"{config_path}: extra_special_tokens: expected a list, got {type(extras).__name__}")

    if "added_tokens_decoder" not in config:  # legacy checkpoints keep their special tokens here
        map_path = directory / SPECIAL_TOKENS_MAP_FILE
        special_map = _read_json(map_path, required=False)
        for key, value in _object(special_map, map_path).items() if special_map is not None else ():
            if key in NAMED_SPECIAL_TOKENS and value is not None:
                named[key] = value
            elif key in ("additional_special_tokens", "extra_special_tokens") and isinstance(value, list):
                extras = extras + [v for v in value if v not in extras]
    named.update(model_specific)

    declared = []
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise TextError(f"{config_path}: added_tokens_decoder: expected an object, got {type(decoder).__name__}")
    for index, value in decoder.items():
        if not str(index).isdigit():
            raise TextError(f"{config_path}: added_tokens_decoder: key {index!r} is not a token id")
        declared.append((int(index), _added_token(value, f"{config_path}: added_tokens_decoder[{index}]")))
    # Named tokens in transformers' order (it decides the ids of tokens new to the vocabulary).
    order = [*NAMED_SPECIAL_TOKENS, *(k for k in named if k not in NAMED_SPECIAL_TOKENS)]
    tokens = {key: _added_token(named[key], f"{config_path}: {key}", named=True) for key in order if key in named}
    extra_tokens = [_added_token(v, f"{config_path}: extra_special_tokens[{i}]") for i, v in enumerate(extras)]

    gen_path = directory / GENERATION_CONFIG_FILE
    gen = _read_json(gen_path, required=False)
    gen = {} if gen is None else _object(gen, gen_path)

    clean_up = config.get("clean_up_tokenization_spaces", False)
    split = config.get("split_special_tokens", False)
    for key, value in (("clean_up_tokenization_spaces", clean_up), ("split_special_tokens", split)):
        if not isinstance(value, bool):
            raise TextError(f"{config_path}: {key}: expected true or false, got {json.dumps(value)[:80]}")
    return TextConfig(
        directory=directory,
        special_tokens={key: token.content for key, token in tokens.items()},
        declared_tokens=tuple(token for _, token in sorted(declared, key=lambda pair: pair[0])),
        special_added=(*tokens.values(), *extra_tokens),
        chat_templates=_chat_templates(directory, config, config_path),
        eos_token_ids=_token_ids_field(gen.get("eos_token_id"), f"{gen_path}: eos_token_id"),
        bos_token_id=_token_id_field(gen.get("bos_token_id"), f"{gen_path}: bos_token_id"),
        pad_token_id=_token_id_field(gen.get("pad_token_id"), f"{gen_path}: pad_token_id"),
        clean_up_spaces=clean_up,
        clean_up_bpe=config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output") is True,
        split_special_tokens=split,
    )


def _has_decoder(spec: Any, kind: str) -> bool:
    """Whether tokenizer.json's decoder (or one inside a Sequence) is of this type."""
    if isinstance(spec, dict):
        return spec.get("type") == kind or any(_has_decoder(d, kind) for d in spec.get("decoders") or [])
    return False


def load_text_codec(directory: str | Path) -> TextCodec:
    """The tokenizer of an HF-style directory (a checkpoint, or a bundle's `tokenizer/`), ready to
    encode, decode, stream and render chats; one-line TextErrors naming the file that is wrong."""
    directory = Path(directory)
    if not directory.is_dir():
        raise TextError(f"{directory}: not a directory (expected a tokenizer directory with {TOKENIZER_FILE})")
    path = directory / TOKENIZER_FILE
    text = _read_text(path, required=True)
    spec = _object(_parse_json(text, path), path)
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as exc:  # noqa: BLE001 - the Rust side raises Exception with its own message
        raise TextError(f"{path}: the tokenizers library cannot read it ({_first_line(exc)})") from None
    config = read_text_config(directory)

    # As transformers' TokenizersBackend.__init__: the config's added tokens all go to add_tokens
    # (which ignores contents it has, but marks special ones special), then the named and extra
    # special tokens the vocabulary still lacks.
    to_add = list(config.declared_tokens)
    known = {t.content for t in tokenizer.get_added_tokens_decoder().values()} | {t.content for t in to_add}
    for token in config.special_added:
        if token.content not in known:
            known.add(token.content)
            to_add.append(token)
    if to_add:
        tokenizer.add_tokens(to_add)
    tokenizer.no_truncation()
    tokenizer.no_padding()
    tokenizer.encode_special_tokens = config.split_special_tokens
    model_type = (spec.get("model") or {}).get("type")
    clean_up = config.clean_up_spaces and (model_type != "BPE" or config.clean_up_bpe)
    return TextCodec(tokenizer, config, clean_up=clean_up,
                     byte_fallback=_has_decoder(spec.get("decoder"), "ByteFallback"))


# ---------------------------------------------------------------------------------------------
# Encoding and decoding
# ---------------------------------------------------------------------------------------------


def _token_id(value: Any, where: str = "token id") -> int:
    """An int (numpy integers too) that is a non-negative token id."""
    if isinstance(value, bool):
        raise TextError(f"{where}: expected a token id, got {value!r}")
    try:
        index = operator.index(value)
    except TypeError:
        raise TextError(f"{where}: expected a token id, got {type(value).__name__}") from None
    if index < 0:
        raise TextError(f"{where}: expected a non-negative token id, got {index}")
    return index


_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
             (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def clean_up_spaces(text: str) -> str:
    """transformers' `clean_up_tokenization`: the spaces WordPiece-style decoders leave before
    punctuation and contractions."""
    for old, new in _CLEAN_UP:
        text = text.replace(old, new)
    return text


# How far back (in characters) appending text can change clean_up_spaces' output: each of the
# replacements, applied in turn, reaches at most 3 characters further back than the one before.
_CLEAN_UP_REACH = 3 * len(_CLEAN_UP) + 4


@dataclass(eq=False)
class TextCodec:
    """A tokenizer directory, loaded: `encode` and `decode` as transformers' AutoTokenizer gives
    them, the stop token ids, chat templates, and the streaming helpers. Built by `load_text_codec`."""

    tokenizer: Tokenizer = field(repr=False)
    config: TextConfig = field(repr=False)
    clean_up: bool = False
    byte_fallback: bool = False
    _special_ids: frozenset[int] = field(init=False, repr=False)
    _byte_ids: dict[int, bool] = field(init=False, repr=False, default_factory=dict)

    def __repr__(self) -> str:
        return f"TextCodec({str(self.directory)!r}, vocab_size={self.vocab_size})"

    def __post_init__(self) -> None:
        self._special_ids = frozenset(i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special)

    @property
    def directory(self) -> Path:
        return self.config.directory

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included (a model's vocabulary may be larger;
        decode drops ids it does not know, as transformers does)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The prompt's ids: the post-processor of tokenizer.json adds the special tokens (a BOS)
        unless `add_special_tokens` is false (chat prompts carry their own)."""
        if not isinstance(text, str):
            raise TextError(f"text to encode: expected a string, got {type(text).__name__}")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids` (special tokens kept unless asked, as transformers' decode)."""
        text = self.decode_raw([_token_id(i) for i in ids], skip_special_tokens)
        return clean_up_spaces(text) if self.clean_up else text

    def decode_raw(self, ids: list[int], skip_special_tokens: bool) -> str:
        """The tokenizers decoder alone, without transformers' string clean-up."""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def is_byte_token(self, token_id: int) -> bool:
        """A byte-fallback token (`<0xE2>`) for a decoder with ByteFallback: it decodes together with
        its neighbours, so text is held while such a run may continue."""
        if not self.byte_fallback:
            return False
        known = self._byte_ids.get(token_id)
        if known is None:
            token = self.tokenizer.id_to_token(token_id) or ""
            known = self._byte_ids[token_id] = bool(re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token))
        return known

    @property
    def eos_token(self) -> str | None:
        return self.config.special_tokens.get("eos_token")

    @property
    def bos_token(self) -> str | None:
        return self.config.special_tokens.get("bos_token")

    @property
    def pad_token(self) -> str | None:
        return self.config.special_tokens.get("pad_token")

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The ids that end a sequence: generation_config.json's `eos_token_id` (an id or a list),
        then the tokenizer config's eos token, each once."""
        ids = list(self.config.eos_token_ids)
        eos = self.eos_token
        eos_id = self.tokenizer.token_to_id(eos) if eos is not None else None
        if eos_id is not None and eos_id not in ids:
            ids.append(eos_id)
        return tuple(ids)

    # --- chat ---

    @property
    def has_chat_template(self) -> bool:
        return bool(self.config.chat_templates)

    def chat_template(self, name: str | None = None) -> ChatTemplate:
        """The template to render: `name`, else the only one or "default"."""
        templates = self.config.chat_templates
        if not templates:
            raise TextError(f"{self.directory}: the checkpoint has no chat template (no {CHAT_TEMPLATE_FILE} "
                            f"and no chat_template in {TOKENIZER_CONFIG_FILE}); send plain prompts instead")
        if name is not None:
            if name not in templates:
                raise TextError(f"{self.directory}: no chat template named {name!r} (it has: "
                                f"{', '.join(sorted(templates))})")
            return templates[name]
        if "default" in templates:
            return templates["default"]
        raise TextError(f"{self.directory}: several chat templates and none is \"default\"; name one of "
                        f"{', '.join(sorted(templates))}")

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                    system: str | None = None, template: str | None = None,
                    variables: Mapping[str, Any] | None = None, tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The chat as the checkpoint's template writes it: transformers' sandboxed Jinja with the
        named special tokens (`bos_token`, ...), `variables` (e.g. enable_thinking) and `tools`
        (OpenAI's tool objects, as transformers' apply_chat_template passes them) in scope."""
        chat = check_messages(messages, system)
        chosen = self.chat_template(template)
        extra = {k: _plain(v, f"chat variable {k}") for k, v in (variables or {}).items()}
        compiled = _compile_template(chosen.source, str(chosen.origin))
        try:
            return compiled.render(messages=chat, tools=_plain(list(tools), "tools") if tools else None, documents=None,
                                   add_generation_prompt=bool(add_generation_prompt),
                                   **{**self.config.special_tokens, **extra})
        except jinja2.TemplateError as exc:
            raise TextError(f"chat template of {chosen.origin}: {type(exc).__name__}: {_first_line(exc)}") from None

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                            system: str | None = None, template: str | None = None,
                            variables: Mapping[str, Any] | None = None,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """The prompt ids of a chat: the rendered template tokenized without adding special tokens
        again (the template writes them), as transformers' apply_chat_template(tokenize=True)."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, system=system,
                                template=template, variables=variables, tools=tools)
        return self.encode(text, add_special_tokens=False)

    # --- streaming ---

    def detokenizer(self, skip_special_tokens: bool = True) -> Detokenizer:
        return Detokenizer(self, skip_special_tokens)

    def text_stream(self, stop: Sequence[str] = (), stop_token_ids: Iterable[int] | None = None,
                    skip_special_tokens: bool = True) -> TextStream:
        """One sequence's text as its tokens arrive, ended by a stop token (the checkpoint's unless
        given) or a stop string."""
        ids = self.stop_token_ids if stop_token_ids is None else stop_token_ids
        return TextStream(self.detokenizer(skip_special_tokens), StopStrings(stop),
                          frozenset(_token_id(i, "stop token id") for i in ids))


# ---------------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------------


def _plain(value: Any, where: str) -> Any:
    """JSON-like data only: templates from the Hub are untrusted code, so they see nothing with
    methods beyond those of str, list and dict (transformers rebuilds inputs the same way)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k, where): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise TextError(f"{where}: expected JSON data (string, number, list, object), got {type(value).__name__}")


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def check_messages(messages: Sequence[Mapping[str, Any]], system: str | None = None) -> list[dict[str, Any]]:
    """The chat as plain dicts: each message an object with string `role` and `content` (one-line
    errors naming `messages[i].field`; an assistant message with `tool_calls` may have no content);
    keys whose value is None dropped and reasoning copied under the names templates read, as
    transformers does; `system` first when given."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TextError(f"messages: expected a list of {{role, content}} objects, got {type(messages).__name__}")
    chat: list[dict[str, Any]] = []
    if system is not None:
        if not isinstance(system, str):
            raise TextError(f"system: expected a string, got {type(system).__name__}")
        if messages and isinstance(messages[0], Mapping) and messages[0].get("role") == "system":
            raise TextError("system: given, but messages[0] is already a system message")
        chat.append({"role": "system", "content": system})
    if not messages and system is None:
        raise TextError("messages: empty (a chat needs at least one message)")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise TextError(f"{where}: expected an object with role and content, got {type(message).__name__}")
        calls = message.get("tool_calls")
        if calls is not None and (not isinstance(calls, list) or not calls):
            raise TextError(f"{where}.tool_calls: expected a non-empty list of tool calls")
        for key in ("role", "content"):
            if key == "content" and calls is not None and message.get(key) is None:
                continue  # an assistant turn that only called tools
            if key not in message:
                raise TextError(f"{where}.{key}: missing")
            if not isinstance(message[key], str):
                raise TextError(f"{where}.{key}: expected a string, got {type(message[key]).__name__}")
        if not message["role"]:
            raise TextError(f"{where}.role: empty")
        plain = {str(k): _plain(v, f"{where}.{k}") for k, v in message.items() if v is not None}
        reasoning = next((plain[k] for k in _REASONING_FIELDS if plain.get(k) is not None), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        chat.append(plain)
    return chat


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks in
    transformers): rendered as its body, so templates that use it parse."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Any) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` in templates without handing them the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names (a way out of the sandbox)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # No named `self`, as in Jinja's Namespace: a template may call namespace(self=...).
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile_template(source: str, origin: str) -> jinja2.Template:
    """The template in transformers' environment: immutable sandbox, trim_blocks and lstrip_blocks,
    loop controls, `raise_exception`, `strftime_now`, plain `tojson`, safe `dict` and `namespace`."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TextError(f"{origin}: chat template line {exc.lineno}: {_first_line(exc.message)}") from None


# ---------------------------------------------------------------------------------------------
# Streaming: detokenization and stop strings
# ---------------------------------------------------------------------------------------------


class Detokenizer:
    """Text for one sequence, one token id at a time: `push(id)` returns the text that id adds
    (often "", never a broken character), `finish()` the rest; all pieces joined equal
    `codec.decode(ids, skip_special_tokens)`.

    Decoders are not per-token: byte-level BPE spreads a character over tokens, SentencePiece drops
    the leading "▁" of the first token, byte-fallback tokens (`<0xE2>`) decode as a run. So, as
    vLLM's prefix_offset/read_offset, each step decodes a short window twice, with and without the
    new tokens, and emits the difference: the window starts at tokens already printed, so the
    first-token rules apply to text already out. Text is held while it ends in U+FFFD (a character
    still incomplete) or while a byte-fallback run may continue, and when the decoder rewrote the
    window's start. With transformers' clean-up (" ." -> ".", non-BPE models only) the cleaned text
    is held back by as far as the clean-up can reach."""

    def __init__(self, codec: TextCodec, skip_special_tokens: bool = True):
        self.codec = codec
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # the window starts here: tokens whose text is already out
        self._read = 0  # tokens before this are out
        self._raw_out: list[str] = []  # the decoder's text handed on so far (before clean-up)
        self._clean_raw = ""  # with clean-up: the raw text not yet settled, and
        self._clean_out = 0  # how much of its cleaned form is out
        self._finished = False

    def push(self, token_id: int) -> str:
        if self._finished:
            raise TextError("detokenizer: push after finish")
        token_id = _token_id(token_id)
        self.ids.append(token_id)
        if self.codec.tokenizer.id_to_token(token_id) is None or (
                self.skip_special_tokens and self.codec.is_special(token_id)):
            return ""  # the decoder never sees it: an id the tokenizer lacks, a special token skipped
        if self.codec.is_byte_token(token_id):
            return ""  # a byte-fallback run decodes as a whole: it may go on
        decode = self.codec.decode_raw
        before = decode(self.ids[self._prefix:self._read], self.skip_special_tokens)
        after = decode(self.ids[self._prefix:], self.skip_special_tokens)
        if len(after) <= len(before) or after.endswith(REPLACEMENT) or not after.startswith(before):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return self._out(after[len(before):], final=False)

    def finish(self) -> str:
        """The text still held (the sequence has ended): what the full decode adds to what is out."""
        if self._finished:
            return ""
        self._finished = True
        full = self.codec.decode_raw(self.ids, self.skip_special_tokens)
        out = "".join(self._raw_out)
        if full.startswith(out):
            rest = full[len(out):]
        else:  # not expected: the window rules keep what is out a prefix of the full decode
            before = self.codec.decode_raw(self.ids[self._prefix:self._read], self.skip_special_tokens)
            after = self.codec.decode_raw(self.ids[self._prefix:], self.skip_special_tokens)
            rest = after[len(before):] if after.startswith(before) else ""
        self._prefix = self._read = len(self.ids)
        return self._out(rest, final=True)

    def _out(self, raw: str, final: bool) -> str:
        if raw:
            self._raw_out.append(raw)
        if not self.codec.clean_up:
            return raw
        # The clean-up rewrites the text as a whole, but appending reaches back only so far; the
        # cleaned text before that is out. Settled text is dropped where no match can straddle
        # the cut (no space in the 3 characters before it: the patterns start with a space and
        # the rewrites only delete spaces), so each step costs the unsettled tail, not all text.
        self._clean_raw += raw
        cleaned = clean_up_spaces(self._clean_raw)
        upto = len(cleaned) if final else max(self._clean_out, len(cleaned) - _CLEAN_UP_REACH)
        piece = cleaned[self._clean_out:upto]
        self._clean_out = upto
        if len(self._clean_raw) > 4 * _CLEAN_UP_REACH:
            for cut in range(len(self._clean_raw) - 2 * _CLEAN_UP_REACH, 3, -1):
                if " " not in self._clean_raw[cut - 3:cut]:
                    settled = len(clean_up_spaces(self._clean_raw[:cut]))
                    if settled <= self._clean_out:
                        self._clean_raw, self._clean_out = self._clean_raw[cut:], self._clean_out - settled
                    break
        return piece


class StopStrings:
    """Cuts streamed text at the first stop string: `push(text)` returns what can be shown now,
    holding back any tail that could be the start of a stop string; once one appears, `stopped` is
    true and nothing more comes out. The text shown in all equals the full text up to (excluding)
    the earliest stop string, however the text was split."""

    def __init__(self, stops: Sequence[str] = ()):
        if isinstance(stops, str):
            stops = [stops]
        for i, stop in enumerate(stops):
            if not isinstance(stop, str) or not stop:
                raise TextError(f"stop[{i}]: expected a non-empty string, got {stop!r}")
        self.stops = tuple(dict.fromkeys(stops))
        self._longest = max((len(s) for s in self.stops), default=0)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def push(self, text: str) -> str:
        if self.stopped or not text:
            return ""
        return self._scan(self._held + text, final=False)

    def finish(self) -> str:
        """The held tail, now that the text has ended: up to a stop string it holds complete (one
        that an earlier, unfinished candidate kept waiting), else all of it."""
        if self.stopped:
            return ""
        return self._scan(self._held, final=True)

    def _scan(self, buffer: str, final: bool) -> str:
        first: tuple[int, str] | None = None
        for stop in self.stops:
            at = buffer.find(stop)
            if at >= 0 and (first is None or at < first[0]):
                first = (at, stop)
        # The earliest place where a stop string may begin but has not ended yet: the text from
        # there is held, even past a complete stop string, since an earlier one would win.
        partial = len(buffer)
        if not final:
            for at in range(max(0, len(buffer) - self._longest + 1), len(buffer)):
                tail = buffer[at:]
                if any(len(stop) > len(tail) and stop.startswith(tail) for stop in self.stops):
                    partial = at
                    break
        if first is not None and first[0] <= partial:
            self.stopped, self.matched, self._held = True, first[1], ""
            return buffer[:first[0]]
        self._held = buffer[partial:]
        return buffer[:partial]


@dataclass(frozen=True)
class StreamStep:
    """What one token adds: the text to show, and whether the sequence has ended and why
    ("stop_token" or "stop_string")."""

    text: str
    finished: bool = False
    reason: str | None = None


class TextStream:
    """One sequence's visible text as its tokens arrive: a Detokenizer, then StopStrings; a stop
    token id ends it without being shown (the held text is flushed first), a stop string ends it
    cut before the string. `finish()` flushes a sequence that ended otherwise (its length limit)."""

    def __init__(self, detokenizer: Detokenizer, stops: StopStrings, stop_token_ids: frozenset[int] = frozenset()):
        self.detokenizer = detokenizer
        self.stops = stops
        self.stop_token_ids = stop_token_ids
        self.finished = False
        self.reason: str | None = None
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text shown so far."""
        return "".join(self._pieces)

    def push(self, token_id: int) -> StreamStep:
        if self.finished:
            return StreamStep("", True, self.reason)
        token_id = _token_id(token_id)
        if token_id in self.stop_token_ids:
            return self._end(self.finish(), "stop_token")
        shown = self.stops.push(self.detokenizer.push(token_id))
        if self.stops.stopped:
            self.detokenizer.finish()
            return self._end(shown, "stop_string")
        self._pieces.append(shown)
        return StreamStep(shown)

    def finish(self) -> str:
        """The held text, for a sequence that ended without a stop (it may still hold a stop string
        that the last characters complete)."""
        if self.finished:
            return ""
        shown = self.stops.push(self.detokenizer.finish())
        shown += self.stops.finish()
        if self.stops.stopped:
            self.reason = "stop_string"
        self.finished = True
        self._pieces.append(shown)
        return shown

    def _end(self, shown: str, reason: str) -> StreamStep:
        if not self.finished:
            self._pieces.append(shown)
        self.finished = True
        self.reason = self.reason or reason
        return StreamStep(shown, True, self.reason)
