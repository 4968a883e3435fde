"""The one text-table renderer: `tvmpipe inspect`'s node table, `Profile.table` and the run's
per-stage table all lay out columns with it, so they agree on widths, cutting and spacing.

Plain text, not a terminal library: these tables are compared by tests, piped to files and read
in CI logs, where colour codes and box drawing get in the way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence


def truncate(text: str, width: int) -> str:
    """Cut the end off, no marker (numbers and short names)."""
    return text[:width]


@dataclass(frozen=True)
class Column:
    """`width`: fixed; None fits the widest cell, title included, up to `max_width`. `cut`
    shortens a cell that does not fit (the title too)."""

    title: str
    width: int | None = None
    max_width: int | None = None
    cut: Callable[[str, int], str] = truncate


def render_table(columns: Sequence[Column], rows: Iterable[Sequence[str] | str], *, gap: int = 2,
                 rule: bool = False) -> list[str]:
    """The title line, a dashed rule under it if `rule`, then one line per row, left-aligned,
    trailing spaces stripped. A row given as a plain string is a line of its own (details under
    the row above it) and does not count for column widths."""
    rows = list(rows)
    cells = [r for r in rows if not isinstance(r, str)]
    widths = []
    for k, col in enumerate(columns):
        if col.width is not None:
            widths.append(col.width)
            continue
        fit = max([len(col.title)] + [len(r[k]) for r in cells])
        widths.append(fit if col.max_width is None else min(fit, col.max_width))
    sep = " " * gap

    def line(values: Sequence[str]) -> str:
        return sep.join(col.cut(v, w).ljust(w) for v, w, col in zip(values, widths, columns)).rstrip()

    out = [line([c.title for c in columns])]
    if rule:
        out.append(sep.join("-" * w for w in widths))
    out += [r if isinstance(r, str) else line(r) for r in rows]
    return out
