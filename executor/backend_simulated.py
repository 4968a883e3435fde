"""The `simulated` backend: no compute, outputs of the right shape and dtype, after a modelled delay.

Pipeline experiments on CPU machines need stages that take as long as the GPU would and move
tensors of the real sizes. Per-step times come from, in order of preference:
  1. a profile JSON (`tvmpipe profile --json` on a GPU machine): measured per-node times;
  2. ops.json: a roofline estimate, max(FLOPs / peak, bytes / bandwidth), plus a launch overhead
     per kernel, for the device in `DEVICES`;
  3. a bare graph.json: `uniform_us` per op node.
The partition layer has its own, richer cost model; this one is deliberately small and local.
"""

from __future__ import annotations

import ctypes
import json
import math
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from tvmpipe.bundle import Bundle
from tvmpipe.bundle.dtypes import np_dtype
from tvmpipe.bundle.manifests import OpRecord
from tvmpipe.executor.backend import StepTiming
from tvmpipe.executor.errors import ExecutorError
from tvmpipe.executor.program import KERNELS, StageProgram

# device: (float32 FLOP/s without tensor cores, memory bytes/s); achieved fractions applied below.
DEVICES = {
    "h100": (67e12, 3.35e12), "h200": (67e12, 4.8e12), "a100": (19.5e12, 1.55e12),
    "a10g": (31e12, 0.6e12), "l4": (30e12, 0.3e12), "v100": (15.7e12, 0.9e12), "t4": (8.1e12, 0.32e12),
}
EFFICIENCY = 0.5  # fraction of peak a TVM-generated kernel reaches, for both FLOPs and bandwidth
LAUNCH_US = 2.5  # per kernel launch
SPIN_S = 0.00006  # the last 60 us are spun, not slept: with 1 ns timer slack a sleep wakes ~40 us late here
PR_SET_TIMERSLACK = 29
_slack = threading.local()


def _tight_timer_slack() -> None:
    """Once per thread: timer slack 1 ns (Linux's default lets a sleep end up to 50 us late).

    A simulated stage stands for a device computing while the host waits; spinning through that
    wait would take a core a GPU stage leaves free, and on a small machine the spinning stages
    starve each other and the driver. So the wait is slept, as precisely as the kernel allows."""
    if getattr(_slack, "done", False):
        return
    _slack.done = True
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the spin below still makes the time exact, at more CPU


def precise_sleep(seconds: float) -> None:
    """Sleep `seconds` to ~10 us: OS sleep for the bulk, then a short spin."""
    end = time.perf_counter() + seconds
    if seconds > SPIN_S:
        _tight_timer_slack()
        time.sleep(seconds - SPIN_S)
    while time.perf_counter() < end:
        pass


def op_flops(rec: OpRecord) -> float:
    """FLOPs of one model op, from its recorded shapes (matmul, conv, pooling, normalisation)."""
    out = sum(math.prod(s) for s in rec.output_shapes)
    ins = rec.input_shapes
    if rec.op == "matmul" and ins:
        return 2.0 * out * ins[0][-1]
    if rec.op.startswith("nn.conv") and len(ins) > 1:
        return 2.0 * out * math.prod(ins[1][1:])  # (O, C/groups, *K): MACs per output element
    if "pool" in rec.op:
        return float(out * math.prod(rec.attrs.get("pool_size") or [1]))
    if rec.op in ("nn.softmax", "nn.log_softmax", "nn.layer_norm", "nn.group_norm", "nn.rms_norm", "nn.batch_norm"):
        return 5.0 * sum(math.prod(s) for s in ins[:1])
    if rec.op in ("reshape", "permute_dims", "expand_dims", "squeeze", "flatten"):
        return 0.0
    return float(out)


def _bytes(program: StageProgram, entries: tuple[int, ...]) -> int:
    return sum(program.entry_specs[e].nbytes for e in entries)


class SimulatedBackend:
    name = "simulated"

    def __init__(self, bundle: Bundle, program: StageProgram, cost_profile: str | Path | dict | None = None,
                 device: str = "h100", uniform_us: float = 20.0, time_scale: float = 1.0):
        self.program = program
        if device not in DEVICES:
            raise ExecutorError(f"unknown simulated device {device!r} (known: {', '.join(DEVICES)})")
        self.step_seconds = [s * time_scale for s in self._model(bundle, cost_profile, device, uniform_us)]
        self.total = sum(self.step_seconds)
        self.zeros: dict[int, np.ndarray] = {}
        for e in program.send_entries:
            spec = program.entry_specs[e]
            z = np.zeros(spec.shape, np_dtype(spec.dtype))
            z.flags.writeable = False  # shared across runs: callers must not write into it
            self.zeros[e] = z

    def _model(self, bundle: Bundle, cost_profile: Any, device: str, uniform_us: float) -> list[float]:
        steps = self.program.steps
        if cost_profile is not None:
            prof = cost_profile if isinstance(cost_profile, dict) else _read_profile(cost_profile)
            by_node = {n["node"]: n for n in prof.get("nodes", [])}
            missing = [s.node for s in steps if s.node not in by_node]
            if missing:
                raise ExecutorError(f"cost profile has no time for node(s) {missing[:10]} of model {self.program.model!r}")
            for s in steps:
                if by_node[s.node].get("name", s.name) != s.name:
                    raise ExecutorError(f"cost profile node {s.node} is '{by_node[s.node]['name']}', the graph's is "
                                        f"'{s.name}': the profile is of another model")
            return [by_node[s.node]["time_us"] * 1e-6 for s in steps]
        flops_peak, bw_peak = DEVICES[device]
        out = []
        for s in steps:
            fn = bundle.ops.get(s.func) if s.kind == KERNELS else None
            if s.kind != KERNELS:
                out.append(0.0 if s.kind == "nop" else _bytes(self.program, s.inputs) / (bw_peak * EFFICIENCY))
            elif fn is None:
                out.append(uniform_us * 1e-6)
            else:
                flops = sum(op_flops(r) for r in fn.ops)
                nbytes = _bytes(self.program, s.inputs + s.outputs)
                launches = max(len(s.launches), 1)
                out.append(max(flops / (flops_peak * EFFICIENCY), nbytes / (bw_peak * EFFICIENCY)) + launches * LAUNCH_US * 1e-6)
        return out

    def write(self, entry: int, value: np.ndarray) -> None:
        pass  # nothing is computed; Stage has already checked shape and dtype

    def execute(self, profile: bool = False) -> list[StepTiming] | None:
        precise_sleep(self.total)
        return [StepTiming(i, t) for i, t in enumerate(self.step_seconds)] if profile else None

    def read(self, entry: int) -> np.ndarray:
        return self.zeros[entry]

    def close(self) -> None:
        self.zeros = {}


def _read_profile(path: str | Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ExecutorError(f"{path}: cannot read cost profile: {exc}") from None
