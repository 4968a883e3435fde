"""Where a generation run's prompts come from, each checked once before any cluster resource is
taken: token ids (`--prompt-ids`), text (`--prompt`, through the bundle's tokenizer), chats (`--chat`:
each text is a user message, rendered through the checkpoint's chat template), or a prompts file
(`--prompts-file in.jsonl`: one JSON object a line).

A prompts file line is one of

    {"prompt": "text"}            {"prompt_ids": [5, 17, 3]}            {"messages": [{"role": ..., "content": ...}, ...]}

with an optional "id" (a string or an integer; default: the line's number, from 1) that names the
line's result in the output file. A bad line is one error naming its line number, before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from tvmpipe.bundle.decode_layout import DecodeLayout
from tvmpipe.core import jsonlimits
from tvmpipe.core.errors import TvmpipeError
from tvmpipe.executor.sampler import Sampling
from tvmpipe.generation.requests import Request
from tvmpipe.generation.text import TextCodec, TextError

PROMPT_KEYS = {"prompt", "prompt_ids", "messages"}
LINE_KEYS = PROMPT_KEYS | {"id"}


@dataclass(frozen=True)
class Prompt:
    """One prompt of a run: its `id` (what its result is filed under) and its checked request (its
    index in the run is its sampling key, so that its draws do not depend on which other prompts ran
    with it: a resumed job draws what an uninterrupted one drew)."""

    id: str | int
    request: Request


def prompt_ids(entry: dict[str, Any], codec: TextCodec | None, where: str, system: str | None = None) -> list[int]:
    """The token ids of one prompt entry (one of PROMPT_KEYS)."""
    if "prompt_ids" in entry:
        ids = entry["prompt_ids"]
        if not isinstance(ids, list):
            raise TvmpipeError(f"{where}: prompt_ids must be a list of token ids")
        return ids
    if codec is None:
        raise TvmpipeError(f"{where}: a text prompt needs a tokenizer: the bundle has none, give --tokenizer DIR "
                           "(or give token ids)")
    try:
        if "messages" in entry:
            return codec.apply_chat_template(entry["messages"], add_generation_prompt=True, system=system)
    except TextError as exc:
        raise TvmpipeError(f"{where}: {exc}") from None
    if not isinstance(entry["prompt"], str):
        raise TvmpipeError(f"{where}: prompt must be a string")
    return codec.encode(entry["prompt"])


def prompts_from_options(ids: Sequence[Sequence[int]], texts: Sequence[str], *, chat: bool, system: str | None,
                         codec: TextCodec | None) -> list[dict[str, Any]]:
    """The command line's prompts as entries: --prompt-ids first, then --prompt (a chat each with --chat)."""
    if chat and not texts:
        raise TvmpipeError("--chat needs --prompt TEXT (each becomes a user message)")
    if system is not None and not chat:
        raise TvmpipeError("--system needs --chat")
    entries: list[dict[str, Any]] = [{"prompt_ids": list(p)} for p in ids]
    for t in texts:
        entries.append({"messages": [{"role": "user", "content": t}]} if chat else {"prompt": t})
    if not entries:
        raise TvmpipeError("no prompt: give --prompt TEXT, --prompt-ids 5,17,3 or --prompts-file FILE.jsonl")
    return entries


def read_prompts_file(path: str | Path) -> list[dict[str, Any]]:
    """Every line of a prompts .jsonl as an entry with its "id"; one error naming the first bad line."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TvmpipeError(f"--prompts-file {path}: cannot read it ({type(exc).__name__}: {exc})") from None
    entries: list[dict[str, Any]] = []
    seen: set = set()
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:  # bounded: nested at most jsonlimits.MAX_DEPTH deep, every string encodable as UTF-8
            entry = jsonlimits.loads(line)
        except jsonlimits.JsonError as exc:
            raise TvmpipeError(f"{where}: {exc}") from None
        if not isinstance(entry, dict):
            raise TvmpipeError(f"{where}: expected a JSON object like {{\"prompt\": \"...\"}}")
        unknown = sorted(set(entry) - LINE_KEYS)
        given = sorted(set(entry) & PROMPT_KEYS)
        if unknown:
            raise TvmpipeError(f"{where}: unknown key '{unknown[0]}' (a line holds one of prompt, prompt_ids, "
                               "messages, and optionally id)")
        if len(given) != 1:
            raise TvmpipeError(f"{where}: give exactly one of prompt, prompt_ids, messages")
        ident = entry.get("id", n)
        if isinstance(ident, bool) or not isinstance(ident, (str, int)):
            raise TvmpipeError(f"{where}: id must be a string or an integer")
        if ident in seen:
            raise TvmpipeError(f"{where}: id {ident!r} appears twice")
        seen.add(ident)
        entries.append({**entry, "id": ident, "_where": where})
    if not entries:
        raise TvmpipeError(f"--prompts-file {path}: no prompts in it")
    return entries


def make_prompts(entries: list[dict[str, Any]], layout: DecodeLayout, *, codec: TextCodec | None, max_new_tokens: int,
                 sampling: Sampling, stop_tokens: Sequence[int], system: str | None = None,
                 stop: Sequence[str] = ()) -> list[Prompt]:
    """Each entry's checked request, keyed by its index (Request.checked: the one check)."""
    out = []
    for i, entry in enumerate(entries):
        where = entry.get("_where", f"prompt {i}")
        ids = prompt_ids(entry, codec, where, system)
        out.append(Prompt(entry.get("id", i), Request.checked(ids, max_new_tokens, layout, sampling=sampling,
                                                               stop_tokens=stop_tokens, key=i, what=where,
                                                               stop=stop)))
    return out
