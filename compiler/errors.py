"""Errors the compiler raises on purpose. The CLI prints them without a traceback."""

from __future__ import annotations

from tvmpipe.core.errors import TvmpipeError


class CompileError(TvmpipeError):
    """A model could not be compiled into a bundle; the message says which input and why."""


class SourceError(CompileError):
    """The model source is missing, unreadable, or not a model TVM can import."""


class UnsupportedOpError(CompileError):
    """A model op lowers to host code a flat launch list cannot express (loops, symbolic grids).

    Names the op and the graph node, because that is what the user changes in the model.
    """

    def __init__(self, op: str, node: str, reason: str):
        self.op = op
        self.node = node
        self.reason = reason
        super().__init__(f"model op '{op}' in graph node '{node}' is not supported: {reason}")


class TvmMissingError(CompileError):
    """apache-tvm (or another compile-only dependency) is not installed."""

    def __init__(self, module: str):
        self.module = module
        super().__init__(
            f"`tvmpipe compile` needs the '{module}' package, which is not installed; "
            "install the compile extra with `pip install -e '.[compile]'`"
        )
