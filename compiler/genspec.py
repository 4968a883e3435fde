"""The `generation` section of a user's stateful .pt2: which input is the token, which the position,
which output the logits (`tvmpipe compile X.pt2 --decode`).

A program whose KV caches are buffers updated in place compiles with those caches as state pairs
(lift.py), but nothing in it says which of its other inputs a generation loop feeds the token and
the position through, or which output to sample. They are inferred where the shapes leave one
choice, and named by flags where they do not:

- token (`--token-input NAME`): the one integer input of rank 2 ([B, 1], or [B, C] for a step of
  up to C tokens a row);
- position (`--position-input NAME`): the one other integer input of shape [B] (or a scalar, for B = 1);
- count (`--count-input NAME`, a [B, C > 1] token input only): how many of a row's C tokens are
  real; with a count, position and count are both integer [B] inputs, so both must be named;
- logits (`--logits-output INDEX|NAME`): the one non-state output of rank 2 or 3 whose leading
  axis is the batch ([B, V] or [B, 1 or C, V]); its last axis is the vocabulary;
- max context (`--max-context T`): the caches' length. It is not inferred: a cache [B, H, T, D]
  has several axes a position could index, and a wrong T lets a sequence run past its cache.

Each refusal is one line naming the flag that settles it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tvmpipe.bundle.dtypes import is_float
from tvmpipe.compiler.errors import SourceError

INT_DTYPES = ("int64", "int32")


@dataclass(frozen=True)
class Declared:
    """What the user named on the command line (None: infer it)."""

    token: str | None = None
    position: str | None = None
    count: str | None = None
    logits: int | str | None = None  # a head index, or an output's name in the torch program
    max_context: int | None = None


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    dtype: str


def declare(program: str, inputs: list[Tensor], outputs: list[Tensor], state_inputs: set[str],
            state_outputs: set[int], declared: Declared) -> Any:
    """The GenerationSpec of a stateful program named `program` (for the messages): its `inputs`
    and `outputs` (outputs named as the torch program names them, in head order)."""
    from tvmpipe.bundle.state import GenerationSpec

    if not state_inputs:
        raise SourceError(f"{program}: --decode needs a program whose caches are buffers it updates in place "
                          "(each becomes a state pair); this one updates none")
    free = [t for t in inputs if t.name not in state_inputs]
    by_name = {t.name: t for t in free}
    token = _pick(program, "token", "--token-input", declared.token, by_name, [t for t in free if _is_token(t)],
                  "an integer input of shape [B, 1] or [B, C]")
    if not _is_token(token):
        raise SourceError(f"{program}: --token-input {token.name} is {token.dtype}{list(token.shape)}, not an integer "
                          "input of shape [B, 1] or [B, C]")
    batch, chunk = token.shape
    others = [t for t in free if t.name != token.name and _is_position(t, batch)]
    if chunk > 1 and (declared.position is None or declared.count is None):
        raise SourceError(f"{program}: token input '{token.name}' takes {chunk} tokens a row: name the position and "
                          "the count of real tokens with --position-input NAME and --count-input NAME")
    position = _pick(program, "position", "--position-input", declared.position, by_name, others,
                     "an integer input of shape [] or [B] besides the token")
    count = None
    if declared.count is not None:
        if chunk == 1:
            raise SourceError(f"{program}: --count-input is for a token input of several tokens a row; "
                              f"'{token.name}' is {list(token.shape)}")
        count = _pick(program, "count", "--count-input", declared.count, by_name, [], "")
    for what, flag, t in (("position", "--position-input", position), ("count", "--count-input", count)):
        if t is not None and (t.name == token.name or not _is_position(t, batch)):
            raise SourceError(f"{program}: {flag} {t.name} is {t.dtype}{list(t.shape)}, not an integer input of "
                              f"shape [] or [{batch}] besides the token")
    if count is not None and count.name == position.name:
        raise SourceError(f"{program}: --position-input and --count-input name the same input '{count.name}'")
    index = _logits(program, outputs, state_outputs, batch, declared.logits)
    if declared.max_context is None:
        raise SourceError(f"{program}: pass --max-context T, the length of its caches (tvmpipe cannot tell which "
                          "cache axis the position indexes)")
    if declared.max_context < 1:
        raise SourceError(f"--max-context must be a positive integer, got {declared.max_context}")
    return GenerationSpec(token.name, position.name, index, declared.max_context, outputs[index].shape[-1],
                          None if count is None else count.name)


def _is_token(t: Tensor) -> bool:
    return t.dtype in INT_DTYPES and len(t.shape) == 2


def _is_position(t: Tensor, batch: int) -> bool:
    return t.dtype in INT_DTYPES and (t.shape == (batch,) or (t.shape == () and batch == 1))


def _pick(program: str, what: str, flag: str, named: str | None, by_name: dict[str, Tensor],
          candidates: list[Tensor], shape: str) -> Tensor:
    if named is not None:
        if named not in by_name:
            raise SourceError(f"{program}: {flag} {named} is not one of its inputs besides the caches "
                              f"({', '.join(by_name) or 'none'})")
        return by_name[named]
    if len(candidates) == 1:
        return candidates[0]
    found = f"{len(candidates)} candidates ({', '.join(t.name for t in candidates)})" if candidates else "none"
    raise SourceError(f"{program}: cannot tell which input is the {what} ({shape}: {found}); name it with "
                      f"{flag} NAME")


def _logits(program: str, outputs: list[Tensor], state_outputs: set[int], batch: int,
            named: int | str | None) -> int:
    """The head index of the logits output."""
    free = [i for i in range(len(outputs)) if i not in state_outputs]
    if named is not None:
        if isinstance(named, int) or (isinstance(named, str) and named.isdigit()):
            index = int(named)
        else:
            hits = [i for i in free if outputs[i].name == named]
            if not hits:
                raise SourceError(f"{program}: --logits-output {named} names none of its outputs besides the caches "
                                  f"({', '.join(f'{i}: {outputs[i].name}' for i in free)})")
            index = hits[0]
        if index not in free:
            raise SourceError(f"{program}: --logits-output {named}: output {index} "
                              f"{'is a cache (a state output)' if index < len(outputs) else 'does not exist'}; "
                              f"its other outputs are {', '.join(map(str, free)) or 'none'}")
        return index
    cands = [i for i in free if is_float(outputs[i].dtype) and len(outputs[i].shape) in (2, 3)
             and outputs[i].shape[0] == batch]
    if len(cands) == 1:
        return cands[0]
    found = f"outputs {', '.join(map(str, cands))}" if cands else "none"
    raise SourceError(f"{program}: cannot tell which output is the logits ([B, V] or [B, 1, V]: {found}); name it "
                      "with --logits-output INDEX|NAME")
