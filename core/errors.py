"""The base error of every layer. It lives below all of them so that no layer imports another
just to raise: the CLI prints any TvmpipeError as one line, without a traceback."""

from __future__ import annotations


class TvmpipeError(Exception):
    """Base of every error tvmpipe raises on purpose; the CLI prints these without a traceback."""


class FieldError(TvmpipeError):
    """A value that one field of a request or a command holds is refused. `field` is the field's
    canonical name in the generation layer (`temperature`, `max_new_tokens`, `stop_tokens`, ...)
    and `detail` says what is wrong, without naming it: each front end renders the error with its
    own name for the field (`render`), a command-line flag (`--temperature`) or an OpenAI request
    parameter (`temperature`, `max_tokens`), so that no layer below names another's options."""

    def __init__(self, field: str, detail: str):
        self.field = field
        self.detail = detail
        super().__init__(f"{field} {detail}")

    def render(self, names: dict[str, str]) -> str:
        """The message with the field called by the front end's name for it (itself if unnamed)."""
        return f"{names.get(self.field, self.field)} {self.detail}"
