"""Errors the executor raises on purpose. All are TvmpipeError, so the CLI prints them without a traceback."""

from __future__ import annotations

from tvmpipe.core.errors import TvmpipeError


class ExecutorError(TvmpipeError):
    """A stage cannot be built or run (bad node range, missing kernels, backend failure)."""


class InputError(ExecutorError):
    """Inputs handed to a stage or runner are wrong; raised before any kernel runs."""


class UnsupportedOpError(ExecutorError):
    """The reference backend has no implementation of an op; raised when the stage is built."""


class BackendUnavailable(ExecutorError):
    """The requested backend cannot run on this machine (no pycuda, no GPU, no nvcc)."""


class DeviceError(ExecutorError):
    """A CUDA driver call failed; the message names the kernel and graph node involved."""
