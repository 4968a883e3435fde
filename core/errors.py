"""The base error of every layer. It lives below all of them so that no layer imports another
just to raise: the CLI prints any TvmpipeError as one line, without a traceback."""

from __future__ import annotations


class TvmpipeError(Exception):
    """Base of every error tvmpipe raises on purpose; the CLI prints these without a traceback."""
