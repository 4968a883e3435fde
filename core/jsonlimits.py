"""JSON from outside (HTTP request bodies, prompts files) read with two bounds Python's json lacks.

Depth: json.loads recurses once a nesting level, so a body of 1,000 "[" raises RecursionError (not
a ValueError: callers that catch ValueError let it through as a traceback). `check_depth` counts
the nesting of the text before it is parsed, without recursion and in linear time, and refuses
what is deeper than a bound (MAX_DEPTH: no request or prompt needs more).

Strings: JSON may escape a lone surrogate ("\\ud800"), which Python reads into a str that cannot
be encoded as UTF-8; it fails later, wherever the text is encoded (the tokenizer, a response, a
log line). `unencodable` finds such a string or object key, and names where it is.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

MAX_DEPTH = 64  # arrays and objects inside one another

# A JSON string, or the rest of the text from an unterminated one: the closing quote is optional,
# so every match succeeds at its first attempt (no backtracking: linear in the text, whatever it is).
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"?', re.DOTALL)
_NOT_BRACKET = re.compile(r'[^\[\]{}]+')
_SURROGATE_ESCAPE = re.compile(r'\\u[dD][89a-fA-F]')  # \uD800..\uDFFF: paired, or lone
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class JsonError(ValueError):
    """JSON text refused: `message` says why; `kind` is "encoding" (not UTF-8), "syntax" (not
    JSON), "depth" (nested too deep) or "string" (cannot be encoded as UTF-8); `where` is the path
    of the value at fault (such as `messages[0].content`), "" for the text as a whole."""

    def __init__(self, message: str, kind: str, where: str = ""):
        super().__init__(f"{where}: {message}" if where else message)
        self.message = message
        self.kind = kind
        self.where = where


def depth(text: str) -> int:
    """The deepest nesting of arrays and objects in JSON text (brackets in strings do not count),
    without parsing it; for text that is not JSON, at least the depth a parser reaches before its
    error (it agrees with the parser on where strings are up to that point)."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    if not brackets:
        return 0
    return max(0, max(accumulate(map(_STEP.__getitem__, brackets))))


def check_depth(text: str, max_depth: int = MAX_DEPTH) -> None:
    """JsonError if `text` nests arrays and objects deeper than `max_depth`."""
    if text.count("[") + text.count("{") <= max_depth:  # fast path: not that many brackets at all
        return
    found = depth(text)
    if found > max_depth:
        raise JsonError(f"nested {found} levels deep, more than the limit of {max_depth} levels of arrays and "
                        "objects", "depth")


def unencodable(value: Any) -> tuple[str, bool] | None:
    """The first string in parsed JSON that cannot be encoded as UTF-8 (a lone surrogate), in
    document order, as (its path, whether it is an object key: then the path is of the object,
    "" for the top level); None if there is none. Walked without recursion."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not _encodes(item):
                return path, False
        elif isinstance(item, dict):
            children = []
            for key, child in item.items():
                if not _encodes(key):
                    return path, True
                children.append((child, f"{path}.{key}" if path else key))
            stack.extend(reversed(children))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]") for i, child in reversed(list(enumerate(item))))
    return None


def _encodes(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def loads(data: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """json.loads with the bounds above; every refusal a JsonError (a ValueError). Bytes are
    decoded as json.loads decodes them (UTF-8, or UTF-16/32 by their first bytes), but strictly:
    the UTF-8 encoding of a surrogate is refused as not UTF-8."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = bytes(data)
        encoding = json.detect_encoding(data)
        try:
            text = data.decode(encoding)
        except UnicodeDecodeError as exc:
            raise JsonError(f"not valid {encoding.upper()} ({exc.reason} at byte {exc.start})", "encoding") from None
    else:
        text = data
    check_depth(text, max_depth)
    try:
        value = json.loads(text)
    except RecursionError:  # not reached below the bound; kept as a backstop
        raise JsonError(f"nested more than the limit of {max_depth} levels of arrays and objects", "depth") from None
    except json.JSONDecodeError as exc:
        at = f"line {exc.lineno} column {exc.colno}" if "\n" in text.strip() else f"column {exc.colno}"
        raise JsonError(f"not valid JSON ({exc.msg}: {at})", "syntax") from None
    except ValueError as exc:  # e.g. an integer of more than sys.get_int_max_str_digits() digits
        raise JsonError(f"not valid JSON ({exc})", "syntax") from None
    if _SURROGATE_ESCAPE.search(text):  # strictly decoded text: an escape is the only way to one
        bad = unencodable(value)
        if bad is not None:
            path, key = bad
            what = "an object key" if key else "a string"
            raise JsonError(f"{what} that cannot be encoded as UTF-8 (a lone surrogate such as \\ud800: "
                            "send text as UTF-8, or escape a character beyond U+FFFF as a surrogate pair)",
                            "string", path)
    return value
