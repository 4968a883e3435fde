"""GraphRunner: the whole graph on one device, with the verbs TVM's graph executor had.

    runner = GraphRunner("examples/mlp", backend="reference")
    runner.set_input("x", x)          # or set_input(0, x), set_input(x=x)
    runner.run()                      # or run(x=x)
    y = runner.get_output(0)

It is the one-stage case of `Stage`: inputs are kept by name until `run`, then fed by entry id.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from tvmpipe.bundle import Bundle
from tvmpipe.bundle.params import load_params_file, load_tvm_params
from tvmpipe.executor.checks import check_array, check_names, expected_inputs
from tvmpipe.executor.errors import ExecutorError, InputError
from tvmpipe.executor.inputs import input_specs
from tvmpipe.executor.profile import Profile, build_profile
from tvmpipe.executor.stage import Stage, as_bundle


def head_outputs(bundle: Bundle, computed: Mapping[int, np.ndarray], inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """The graph's outputs in head order: computed entries as they are; a head that is a null node
    (an input or a param passed straight through) as a copy of the input or param."""
    g = bundle.graph
    outs = []
    for e in g.head_entries:
        if e in computed:
            outs.append(computed[e])
        else:
            name = g.nodes[g.entries[e].node].name
            outs.append(np.array(inputs[name] if name in inputs else bundle.params[name]))
    return outs


class GraphRunner:
    def __init__(self, bundle: Bundle | str | Path, backend: str = "reference", **opts: Any):
        self.bundle = as_bundle(bundle)
        g = self.bundle.graph
        self.stage = Stage(self.bundle, 0, len(g.nodes), backend, **opts)
        self.program = self.stage.program
        self.input_names = list(self.bundle.input_names)
        self._specs = input_specs(self.bundle)
        self._inputs: dict[str, np.ndarray] = {}
        self._outputs: list[np.ndarray] | None = None

    # ---- inputs ---------------------------------------------------------------------------------
    def _name(self, key: str | int) -> str:
        if isinstance(key, int) and not isinstance(key, bool):
            if not 0 <= key < len(self.input_names):
                raise InputError(f"input index {key} is out of range: the graph has {len(self.input_names)} input(s): "
                                 f"{expected_inputs(self._specs)}")
            return self.input_names[key]
        check_names([key], self._specs, complete=False)
        return key

    def set_input(self, key: str | int | None = None, value: np.ndarray | None = None, **inputs: np.ndarray) -> None:
        """Set one input by name or index, and/or several by keyword. Checked now, copied on run."""
        items = ([(key, value)] if key is not None else []) + list(inputs.items())
        checked = {}
        for k, v in items:
            name = self._name(k)
            checked[name] = check_array(v, self._specs[name], f"input '{name}'").copy()
        self._inputs.update(checked)

    def get_input(self, key: str | int) -> np.ndarray:
        name = self._name(key)
        if name not in self._inputs:
            raise InputError(f"input '{name}' has not been set")
        return self._inputs[name]

    def get_num_inputs(self) -> int:
        return len(self.input_names)

    # ---- running --------------------------------------------------------------------------------
    def _feeds(self) -> dict[int, np.ndarray]:
        missing = [n for n in self.program.input_names if n not in self._inputs]
        if missing:
            raise InputError(f"input(s) not set: {', '.join(f'{n}: {self._specs[n]}' for n in missing)}")
        return {self.program.input_entries[n]: self._inputs[n] for n in self.program.input_names}

    def run(self, **inputs: np.ndarray) -> None:
        if inputs:
            self.set_input(**inputs)
        self._outputs = self._collect(self.stage.run(self._feeds()))

    def _collect(self, sent: Mapping[int, np.ndarray]) -> list[np.ndarray]:
        return head_outputs(self.bundle, sent, self._inputs)

    def get_output(self, index: int) -> np.ndarray:
        if self._outputs is None:
            raise ExecutorError("no outputs yet: call run() first")
        if not 0 <= index < len(self._outputs):
            raise ExecutorError(f"output index {index} is out of range: the graph has {len(self._outputs)} output(s)")
        return self._outputs[index]

    def get_num_outputs(self) -> int:
        return len(self.bundle.graph.heads)

    # ---- params ---------------------------------------------------------------------------------
    def load_params(self, params: Mapping[str, np.ndarray] | bytes | bytearray | str | Path) -> None:
        """Replace params from a dict, TVM param-dict bytes (`save_param_dict`), or a .npz/.params file."""
        if isinstance(params, (bytes, bytearray)):
            params = load_tvm_params(bytes(params))
        elif isinstance(params, (str, Path)):
            params = load_params_file(params)
        known = set(self.bundle.param_names)
        unknown = [n for n in params if n not in known]
        if unknown:
            raise InputError(f"not params of this graph: {', '.join(map(repr, unknown))} "
                             f"(params: {', '.join(sorted(known)) or 'none'})")
        for name, value in params.items():
            if name in self.program.param_entries:
                self.stage.set_param(name, value)

    # ---- profiling ------------------------------------------------------------------------------
    def profile(self, repeat: int = 10, warmup: int = 1, **inputs: np.ndarray) -> Profile:
        """Per-node (and per-kernel on cuda) times averaged over `repeat` runs, plus end-to-end run()
        times measured separately (profiling adds events/timers, so run() is timed without them)."""
        if repeat < 1:
            raise ExecutorError(f"repeat must be at least 1, got {repeat}")
        if inputs:
            self.set_input(**inputs)
        feeds = self._feeds()
        for _ in range(warmup):
            self.stage.run(feeds)
        reps = []
        for _ in range(repeat):
            sent, timings = self.stage.run_profiled(feeds)
            reps.append(timings)
        run_s = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            sent = self.stage.run(feeds)
            run_s.append(time.perf_counter() - t0)
        self._outputs = self._collect(sent)
        return build_profile(self.bundle, self.program, self.stage.backend_name, reps, run_s)

    def close(self) -> None:
        self.stage.close()

    def __enter__(self) -> "GraphRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

