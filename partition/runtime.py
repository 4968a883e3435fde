"""What the pipeline runtime costs beyond the ops, and where it is spent.

Cost models give op times; a real pipeline also receives, decodes, encodes and sends a frame per
edge per micro-batch, and its driver submits and collects every micro-batch. On GPUs with idle
host cores this is hidden behind compute; with sub-millisecond stages, or on a CPU machine where
stage processes and the driver share a few cores, it decides the throughput. So the prediction
charges it where the runtime spends it:

- a stage's *busy* time is what its worker records as compute: op times + `run_us` (one Stage.run's
  fixed cost: feeds checked, outputs gathered);
- its *CPU* time per micro-batch is the CPU part of compute (all of it on the reference backend;
  the simulated backend spins only its last `compute_cpu_cap_us`; a GPU stage ~0) + run_us + a
  receive per inbound frame + a send per outbound frame. One Python process runs these one at a
  time (the GIL), so they add up;
- its *cycle* (the interval it can sustain between micro-batches) is its link time plus the larger of
  its serial path and its CPU time. The serial path is busy + receive (the receiving thread decodes,
  then computes) + a send per outbound frame of at most `inline_bytes`: the transport writes such a
  frame from the computing thread itself (cluster/wire/tcp.py INLINE_BYTES, one thread wake-up less
  per hop), so the next micro-batch waits for it; larger frames go to a sender thread and overlap the
  next compute while it holds no CPU. Measured on the simulated backend (compute sleeps, 1 ms stages):
  without the inline sends the model put a 1-stage plan 4 % above its own calibration run, every time;
- the driver's cycle is `driver_us` + a send per input frame + a receive per output frame;
- when `cores` is given, every process shares them: the period is at least the total CPU per
  micro-batch / cores (oversubscription: K stage processes + the driver on fewer cores);
- the figures above are calibrated in wall time (what a frame or an op delays the stage by), and on a
  loaded machine that includes waiting for a core. For the CPU bound that wait is already the other
  processes' share, which `cores_free` takes away, so a stage's CPU is its wall-time work x `cpu_share`
  (its CPU time over that work in the calibration: 1 on a quiet machine) and the driver's frames are
  charged likewise. Measured on examples/cnn with a neighbour spinning on one of the 2 cores: charging
  the wait twice put K = 1 at -18 and -20 % of what it measured (bubble 14-16 points high); once,
  +1.7 and -8.2 % (bubble within 0.5 points);
- with `window` micro-batches in flight, the period is at least one micro-batch's latency / window.

With every figure 0 (the default) the stage cycle is compute + link time, the model of an ideal
runtime that the planner has always used.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from tvmpipe.partition.errors import PartitionError


@dataclass(frozen=True)
class RuntimeCosts:
    """Per-micro-batch runtime figures in microseconds (see the module docstring)."""

    recv_us: float = 0.0  # stage CPU per inbound frame: wake-up, decode, checks
    send_us: float = 0.0  # stage CPU per outbound frame: encode, socket write
    run_us: float = 0.0  # fixed cost of one Stage.run beyond its ops (counted as busy)
    driver_us: float = 0.0  # driver CPU per micro-batch beyond its frames: submit, bookkeeping, delivery
    compute_cpu_cap_us: float | None = None  # CPU part of a stage's compute: None = all of it; else min(compute, cap)
    compute_scale: float = 1.0  # op time in a pipelining stage worker / the profile's (measured in the calibration run)
    cores: int | None = None  # CPU cores the stage processes and the driver share; None: enough for all
    cores_free: float | None = None  # of `cores`, what other processes left (measured); None: all of them
    window: int | None = None  # micro-batches in flight; None: 2 x stages (the Pipeline's default)
    inline_bytes: int | None = None  # frames up to this size are sent by the computing thread; None: all overlap
    cpu_share: float = 1.0  # CPU time per wall-time unit of modelled stage work (below 1: the calibration waited for a core)
    driver_frame_us: float | None = None  # driver CPU per frame it sends or receives; None: send_us/recv_us x cpu_share
    source: str = "none"  # how the figures were obtained (for reports)

    def __post_init__(self) -> None:
        for name in ("recv_us", "send_us", "run_us", "driver_us"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and np.isfinite(v) and v >= 0):
                raise PartitionError(f"runtime cost {name} must be a non-negative number, got {v!r}")
        if not (isinstance(self.compute_scale, (int, float)) and np.isfinite(self.compute_scale)
                and self.compute_scale > 0):
            raise PartitionError(f"runtime compute_scale must be a positive number, got {self.compute_scale!r}")
        if self.cores is not None and self.cores < 1:
            raise PartitionError(f"cores must be >= 1, got {self.cores}")
        if self.cores_free is not None and not (isinstance(self.cores_free, (int, float)) and self.cores_free > 0):
            raise PartitionError(f"cores_free must be a positive number, got {self.cores_free!r}")
        if self.driver_frame_us is not None and not (isinstance(self.driver_frame_us, (int, float))
                                                     and np.isfinite(self.driver_frame_us) and self.driver_frame_us >= 0):
            raise PartitionError(f"runtime cost driver_frame_us must be a non-negative number, got {self.driver_frame_us!r}")
        if not (isinstance(self.cpu_share, (int, float)) and 0 < self.cpu_share <= 1):
            raise PartitionError(f"runtime cpu_share must be in (0, 1], got {self.cpu_share!r}")
        if self.window is not None and self.window < 1:
            raise PartitionError(f"window must be >= 1, got {self.window}")
        if self.inline_bytes is not None and not (isinstance(self.inline_bytes, int) and self.inline_bytes >= 0):
            raise PartitionError(f"inline_bytes must be a non-negative integer, got {self.inline_bytes!r}")

    @property
    def is_zero(self) -> bool:
        return not (self.recv_us or self.send_us or self.run_us or self.driver_us) and self.compute_scale == 1.0

    @property
    def cpu_cores(self) -> float | None:
        """The cores the pipeline's processes get: `cores`, less what other processes took when measured."""
        if self.cores is None:
            return None
        return min(float(self.cores), self.cores_free) if self.cores_free is not None else float(self.cores)

    def compute_cpu(self, compute_us: np.ndarray | float) -> np.ndarray | float:
        """The CPU part of `compute_us` of profiled op time (vectorised)."""
        if self.compute_cpu_cap_us is None:
            return compute_us * self.compute_scale
        return np.minimum(compute_us * self.compute_scale, self.compute_cpu_cap_us)

    def busy_us(self, compute_us: np.ndarray | float) -> np.ndarray | float:
        """What the worker records as compute for `compute_us` of profiled op time."""
        return compute_us * self.compute_scale + self.run_us

    def stage_cpu_us(self, compute_us: np.ndarray | float, frames_in: int = 1, frames_out: int = 1) -> np.ndarray | float:
        """CPU time of one stage process per micro-batch: its CPU work, at `cpu_share` of its wall time."""
        work = self.compute_cpu(compute_us) + self.run_us + frames_in * self.recv_us + frames_out * self.send_us
        return work * self.cpu_share

    def inline_frames(self, frame_bytes: np.ndarray | float | list[float]) -> np.ndarray | int:
        """How many of these outbound frames the computing thread sends itself (vectorised: 0 or 1 per
        cell for a table of one frame per stage; a count for a list of one stage's frames)."""
        if self.inline_bytes is None:
            return 0
        if isinstance(frame_bytes, list):
            return sum(1 for b in frame_bytes if b <= self.inline_bytes)
        return (np.asarray(frame_bytes) <= self.inline_bytes).astype(np.int64)

    def stage_cycle_us(self, compute_us: np.ndarray | float, transfer_us: np.ndarray | float,
                       frames_in: int = 1, frames_out: int = 1,
                       inline_out: np.ndarray | int = 0) -> np.ndarray | float:
        """Sustainable interval between micro-batches of one stage (vectorised over tables); `inline_out`
        of the `frames_out` frames are sent by the computing thread (inline_frames)."""
        serial = self.busy_us(compute_us) + frames_in * self.recv_us + inline_out * self.send_us
        return transfer_us + np.maximum(serial, self.stage_cpu_us(compute_us, frames_in, frames_out))

    def driver_cycle_us(self, frames_out: int, frames_in: int) -> float:
        """The driver per micro-batch: `frames_out` input frames sent, `frames_in` output frames received."""
        if self.is_zero:
            return 0.0
        return self.driver_us + frames_out * self.send_us + frames_in * self.recv_us

    def driver_cpu_us(self, frames_out: int, frames_in: int) -> float:
        """The driver's CPU time per micro-batch: its own work and its frames, at `driver_frame_us` each where
        calibrated, else at the stage's cost x `cpu_share` (a frame's wall time on a loaded machine includes
        waiting for a core, which is not CPU)."""
        if self.is_zero:
            return 0.0
        if self.driver_frame_us is not None:
            return self.driver_us + (frames_out + frames_in) * self.driver_frame_us
        return self.driver_us + (frames_out * self.send_us + frames_in * self.recv_us) * self.cpu_share

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


NO_RUNTIME = RuntimeCosts()


@dataclass(frozen=True)
class Calibration:
    """What one calibration run measured, per micro-batch: the stage's busy time and CPU time, the
    driver's CPU time, and the period, of a 1-stage pipeline doing (almost) no compute."""

    busy_us: float
    stage_cpu_us: float | None  # None where the worker's CPU time cannot be read (a remote node)
    driver_cpu_us: float | None
    period_us: float
    others_cores: float | None = None  # cores other processes took meanwhile (a shared machine), if read

    def costs(self, compute_us: float = 0.0, run_us: float | None = None, **kw: Any) -> RuntimeCosts:
        """RuntimeCosts from this run: a 1-stage pipeline receives one frame and sends one per micro-batch,
        so the stage's CPU beyond its busy time is one receive plus one send (split evenly: a chain has as
        many of each), and the driver's CPU beyond one send and one receive is its own. Without CPU times,
        the period beyond the busy time is taken as the stage's receive + send.

        `compute_us` is the profiled op time of the calibration run's stage. Without `run_us`, busy beyond it
        is Stage.run's fixed cost (a zero-op run: all of busy). With `run_us` (known from the profile), the
        run computed real ops, and busy - run_us over compute_us is `compute_scale`: how much slower ops run
        in a stage worker that pipelines (frames decoded between and beside them, caches shared with the
        sockets, the driver on the other core) than in the single-process profile. Measured in the same
        sweep, so it holds whatever this machine's load is at the time, not a constant for one machine."""
        scale = 1.0
        if run_us is None:
            run_us = max(0.0, self.busy_us - compute_us)
        elif compute_us > 0:
            scale = max(0.0, self.busy_us - run_us) / compute_us or 1.0
        if self.stage_cpu_us is not None:
            hop = max(0.0, self.stage_cpu_us - self.busy_us)
            if self.stage_cpu_us >= (self.driver_cpu_us or 0.0):
                # the stage paced the run: its wall time beyond busy is what a frame costs in wall time. On a
                # loaded machine the stage process waits for a core between frames too (measured: 22 % of
                # a 1-stage reference run outside compute, 11 % by CPU time), and that wait is spent per frame
                hop = max(hop, self.period_us - self.busy_us)
        else:
            hop = max(0.0, self.period_us - self.busy_us)
        frame = hop / 2
        fields: dict[str, Any] = dict(recv_us=frame, send_us=frame, run_us=run_us, compute_scale=scale)
        fields.update(kw)
        share = 1.0
        if self.stage_cpu_us is not None:
            # the wall-time figures above model the stage's work; its CPU time over that work is what a core
            # gave it: below 1 where it waited for one (a loaded machine), which the CPU bound must not charge
            work = RuntimeCosts(**fields).stage_cpu_us(compute_us)
            if work > 0 and self.stage_cpu_us > 0:
                share = min(1.0, self.stage_cpu_us / work)
        fields.setdefault("cpu_share", share)
        if self.driver_cpu_us is not None:
            # the driver sent one frame and received one: each costs it what it costs the stage in CPU, or less
            # (it measured less in all: its frames are cheaper than the stage's), and its own work the rest
            fields.setdefault("driver_frame_us", min(frame * fields["cpu_share"], self.driver_cpu_us / 2))
            fields.setdefault("driver_us", max(0.0, self.driver_cpu_us - 2 * fields["driver_frame_us"]))
        if self.others_cores is not None and fields.get("cores"):
            # a shared machine: other processes took these cores while the calibration ran beside the plan
            fields.setdefault("cores_free", max(0.1, fields["cores"] - self.others_cores))
        return RuntimeCosts(**fields)
