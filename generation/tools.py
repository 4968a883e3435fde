"""Tool calls: how a checkpoint's chat template writes them, read back from a model's output, and
the grammar that makes a model write one (tool_choice `required` or a named function).

A template that defines tool calls (the `tools` variable rendered into the prompt, as transformers'
apply_chat_template passes it) teaches the model one of a few formats. Two are read here, by the
template's own text:

- "hermes" (Qwen2/2.5/3, Hermes, and the templates that copied them): each call is a JSON object
  `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>` lines; text before
  the first call is the message's content.
- "llama3" (Llama 3.1/3.2/3.3): the whole answer is one JSON object `{"name": ..., "parameters":
  {...}}` (after an optional `<|python_tag|>`), several separated by `;`.

A call is forced by a grammar of that format whose JSON follows the functions' parameter schemas
(llguidance's Lark with `%json`, executor.grammar), drawn under its mask at the sampling stage like
any response_format.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

from tvmpipe.core.errors import TvmpipeError

FORMATS = ("hermes", "llama3")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ToolError(TvmpipeError):
    """Tools that cannot be served with this template, or a call that does not parse."""


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as a JSON text (OpenAI's `arguments`)."""

    name: str
    arguments: str


def tool_format(template_source: str) -> str | None:
    """The tool call format a chat template teaches (FORMATS), or None if it writes no tools."""
    if "tools" not in template_source:
        return None
    if "<tool_call>" in template_source:
        return "hermes"
    if "<|python_tag|>" in template_source or "ipython" in template_source:
        return "llama3"
    return None


def _call(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str, fmt: str) -> tuple[str | None, list[ToolCall]]:
    """The message's content (None if only calls) and the calls `text` holds in format `fmt`; text
    that holds no well-formed call is all content."""
    if fmt == "hermes":
        calls = []
        for body in _HERMES.findall(text):
            try:
                call = _call(json.loads(body), "arguments")
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        if not calls:
            return text, []
        content = text[:text.index("<tool_call>")].strip()
        return content or None, calls
    if fmt == "llama3":
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):].strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        for part in body.split(";"):
            try:
                call = _call(json.loads(part), "parameters")
            except ValueError:
                return text, []
            if call is None:
                return text, []
            calls.append(call)
        return None, calls
    raise ToolError(f"unknown tool call format {fmt!r}")


class ToolStream:
    """An answer read for tool calls as it streams: `push` returns the text that can be sent as
    content now (never the start of a call: hermes holds back from `<tool_call>` on, and any tail
    that could begin it; llama3 holds an answer that begins with `{`, as a call does); `finish`
    reads the calls of the whole answer and returns the content not sent yet. `forced` (a call
    is sure: tool_choice required or named) sends no content."""

    MARK = "<tool_call>"

    def __init__(self, fmt: str, forced: bool = False):
        if fmt not in FORMATS:
            raise ToolError(f"unknown tool call format {fmt!r}")
        self.fmt, self.forced = fmt, forced
        self.text = ""
        self.sent = 0

    def push(self, piece: str) -> str:
        self.text += piece
        if self.forced:
            return ""
        if self.fmt == "hermes":
            at = self.text.find(self.MARK, max(0, self.sent - len(self.MARK)))
            if at < 0:  # the longest tail that could begin the mark is held
                at = len(self.text) - next((k for k in range(min(len(self.MARK) - 1, len(self.text)), 0, -1)
                                            if self.MARK.startswith(self.text[-k:])), 0)
        else:
            head = self.text.lstrip()
            at = self.sent if not head or head.startswith("{") else len(self.text)
        out = self.text[self.sent:max(self.sent, at)]
        self.sent = max(self.sent, at)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content not sent yet, and the calls (none: the rest of the answer is content)."""
        content, calls = parse_tool_calls(self.text, self.fmt)
        if not calls:
            return self.text[self.sent:], []
        end = self.text.index(self.MARK) if self.fmt == "hermes" else 0
        return self.text[self.sent:end].rstrip() if end > self.sent else "", calls


def _call_schema(functions: Sequence[dict[str, Any]], args_key: str) -> dict[str, Any]:
    """The JSON schema of one call of any of `functions` (OpenAI function objects; their arguments
    an object, as OpenAI's parameters always are, also where the schema leaves the type out)."""
    options = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                  args_key: {"type": "object", **(f.get("parameters") or {})}},
                "required": ["name", args_key], "additionalProperties": False} for f in functions]
    return options[0] if len(options) == 1 else {"anyOf": options}


def call_grammar(fmt: str, functions: Sequence[dict[str, Any]]) -> str:
    """The llguidance grammar of one call, in format `fmt`, of one of `functions` (the named one
    alone for a named tool_choice); ToolError if a parameter schema does not compile."""
    from tvmpipe.executor.grammar import JSON_OPTIONS, lark_grammar

    if fmt not in FORMATS:
        raise ToolError(f"unknown tool call format {fmt!r}")
    schema = {**_call_schema(functions, "arguments" if fmt == "hermes" else "parameters"), "x-guidance": JSON_OPTIONS}
    body = "%json " + json.dumps(schema)
    lark = f'start: "<tool_call>\\n" {body} "\\n</tool_call>"' if fmt == "hermes" else f"start: {body}"
    try:
        return lark_grammar(lark)
    except ValueError as exc:
        raise ToolError(f"the tools' parameters cannot be compiled into a grammar: {str(exc)[:300]}") from None
