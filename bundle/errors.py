"""Errors about input files: one `Problem` per thing wrong, collected into one error per file."""

from __future__ import annotations

from dataclasses import dataclass

from tvmpipe.core.errors import TvmpipeError

MAX_MESSAGE = 300


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an input file, located precisely enough to fix it by hand."""

    file: str
    where: str  # e.g. "node 12 'fused_add'", "entry 7", "function 'fused_dense'", "" for the file
    field: str  # e.g. "inputs[1]", "attrs.shape", "launches[0].kernel"
    message: str

    def __str__(self) -> str:
        loc = ", ".join(p for p in (self.where, self.field) if p)
        # Messages quote offending values; a corrupt file can make one megabytes long.
        msg = self.message if len(self.message) <= MAX_MESSAGE else self.message[:MAX_MESSAGE] + " ..."
        return f"{self.file}: {loc}: {msg}" if loc else f"{self.file}: {msg}"


class ProblemCollector:
    """Gathers the problems of one input file, so its reader reports them all at once.

    The one collector of the bundle layer: graph.json, kernels.json and ops.json readers share it,
    so a problem reads the same whichever file it is in. `problems` may be a list shared by several
    collectors (a bundle loader gathers every file's problems into one error).
    """

    def __init__(self, file: str, problems: list[Problem] | None = None):
        self.file = file
        self.problems: list[Problem] = [] if problems is None else problems

    def bad(self, where: str, fld: str, msg: str) -> None:
        self.problems.append(Problem(self.file, where, fld, msg))

    def unknown_keys(self, obj: dict, allowed: set[str], where: str, prefix: str = "", what: str = "key") -> None:
        """Every key of `obj` outside `allowed`: a silently ignored field is how wrong values get used."""
        for k in obj:
            if k not in allowed:
                self.bad(where, prefix + k, f"unknown {what} (expected one of {sorted(allowed)})")

    def raise_if_any(self, error: type[ProblemsError]) -> None:
        if self.problems:
            raise error(self.problems)


class ProblemsError(TvmpipeError):
    """Carries every problem found, so users fix a file in one pass instead of one error at a time."""

    def __init__(self, problems: list[Problem], what: str = "input"):
        self.problems = list(problems)
        if len(self.problems) == 1:  # the usual case (a missing file, one bad field): one line
            super().__init__(f"1 problem in {what}: {self.problems[0]}")
            return
        head = f"{len(self.problems)} problem(s) in {what}"
        shown = self.problems[:20]
        lines = [head + ":"] + [f"  - {p}" for p in shown]
        if len(self.problems) > len(shown):
            lines.append(f"  ... and {len(self.problems) - len(shown)} more")
        super().__init__("\n".join(lines))


class GraphError(ProblemsError):
    """graph.json is malformed or inconsistent."""

    def __init__(self, problems: list[Problem]):
        super().__init__(problems, "graph.json")


class BundleError(ProblemsError):
    """A bundle directory is incomplete or its files disagree with each other."""

    def __init__(self, problems: list[Problem]):
        super().__init__(problems, "bundle")
