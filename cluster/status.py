"""What a stage worker reports about itself: typed on both sides of the control call.

`StageWorker.status()` answers the driver's health check (who is dead, failed or stuck) and
`StageWorker.stats()` feeds the run record (metrics, timeline). Both cross a process boundary
(a pipe or Ray), so they are plain dataclasses of plain values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class Span(NamedTuple):
    """One micro-batch computed by a stage, wall-clock seconds (comparable across nodes)."""

    epoch: int
    seq: int
    start: float
    end: float


@dataclass(frozen=True)
class WorkerStatus:
    """A worker's health, for the driver's diagnosis. `busy_seq` is the micro-batch it is
    computing (None when idle) and `busy_for_s` for how long; `error` is set once its stage
    failed, until it is re-wired; `peer_errors` are broken inbound or outbound connections."""

    stage: int
    pid: int
    epoch: int | None
    next_seq: int
    busy_seq: int | None
    busy_for_s: float
    error: str | None
    error_seq: int | None = None  # the micro-batch whose own computation raised `error` (None: not a step's)
    broken: bool = False  # that error left the stage unable to go on (its device failed): restart it
    peer_errors: list[str] = field(default_factory=list)
    paths: dict[int, str] = field(default_factory=dict)  # consumer -> "shm", "cuda-ipc" or "tcp": what each outbound edge took
    devices: str | None = None  # its CUDA_VISIBLE_DEVICES (CUDA IPC only between workers that see the same GPUs)


@dataclass(frozen=True)
class WorkerStats:
    """Timeline and traffic since the worker started. `bytes_out` / `frames_out` are per
    consumer stage (DRIVER for graph outputs), headers included."""

    stage: int
    pid: int
    host: str
    devices: str | None  # CUDA_VISIBLE_DEVICES of the worker process
    build_s: float
    warmup_s: float
    events: list[Span]
    bytes_out: dict[int, int]
    frames_out: dict[int, int]
    paths: dict[int, str] = field(default_factory=dict)  # consumer -> "shm" or "tcp", current epoch
    # Weights: bytes of the stage's own params resident in it, bytes this process read from the
    # weights file (header included), and bytes it was shipped (0: it read the bundle in place).
    weight_bytes: int = 0
    weights_read: int = 0
    shipped_bytes: int = 0
    # Declared state (KV caches) resident in the stage: each pair's buffers (Bundle.state_buffers) for each
    # slot used so far
    state_bytes: int = 0


@dataclass(frozen=True)
class Progress:
    """Where a paused worker stands, for the driver's replay plan (driver.py `_resume_points`): it has
    computed every micro-batch below `next_seq` of the current run, and still holds the outputs it
    sent for `retained_from` .. `next_seq` - 1 (none when the two are equal), ready to send again."""

    stage: int
    next_seq: int
    retained_from: int
