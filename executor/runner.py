"""GraphRunner: the whole graph on one device, with the verbs TVM's graph executor had.

    runner = GraphRunner("examples/mlp", backend="reference")
    runner.set_input("x", x)          # or set_input(0, x), set_input(x=x)
    runner.run()                      # or run(x=x)
    y = runner.get_output(0)

It is the one-stage case of `Stage`. As in TVM, `set_input` copies the input where the executor
runs it from: on cuda, the stage's page-locked buffer that each run copies to the device (so run()
copies nothing on the host), elsewhere a private copy fed at `run`. Outputs stay where the run left
them until `get_output` copies the one asked for (each at most once per run).
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


def passed_through(bundle: Bundle, entry: int, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
    """A head that is a null node (an input or a param passed straight through): a copy of it."""
    name = bundle.graph.nodes[bundle.graph.entries[entry].node].name
    return np.array(inputs[name] if name in inputs else bundle.params[name])


def head_outputs(bundle: Bundle, computed: Mapping[int, np.ndarray], inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """The graph's outputs in head order: computed entries as they are, passed-through ones copied."""
    return [computed[e] if e in computed else passed_through(bundle, e, inputs) for e in bundle.graph.head_entries]


class GraphRunner:
    def __init__(self, bundle: Bundle | str | Path, backend: str = "reference", **opts: Any):
        self.bundle = as_bundle(bundle)
        g = self.bundle.graph
        self.stage = Stage(self.bundle, 0, len(g.nodes), backend, **opts)
        self.program = self.stage.program
        self.input_names = list(self.bundle.input_names)
        self._specs = input_specs(self.bundle)
        self._inputs: dict[str, np.ndarray] = {}
        # per head, after a run: its array once copied out (or a passed-through input/param), else None
        self._outputs: list[np.ndarray | None] | None = None
        sent = set(self.program.send_entries)
        self._heads = [(e, e in sent) for e in g.head_entries]  # (entry, computed by the stage)

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
            checked[name] = check_array(v, self._specs[name], f"input '{name}'")
        for name, v in checked.items():  # every value checked before any is stored
            entry = self.program.input_entries.get(name)
            buf = self.stage.input_buffer(entry) if entry is not None else None
            if buf is None:
                self._inputs[name] = v.copy()
            else:
                np.copyto(buf, v)
                self._inputs[name] = buf

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
        self.stage.compute(self._feeds())
        self._outputs = self._passed_through()

    def _passed_through(self) -> list[np.ndarray | None]:
        """Per head: None for a computed entry (copied out by get_output), else a copy of the input
        or param it passes through, taken now, as the run saw it."""
        return [None if computed else passed_through(self.bundle, e, self._inputs) for e, computed in self._heads]

    def _collect(self, sent: Mapping[int, np.ndarray]) -> list[np.ndarray | None]:
        return head_outputs(self.bundle, sent, self._inputs)

    def get_output(self, index: int) -> np.ndarray:
        """Output `index` of the last run, copied from where the run left it the first time it is
        asked for (the same array after that)."""
        if self._outputs is None:
            raise ExecutorError("no outputs yet: call run() first")
        if not 0 <= index < len(self._outputs):
            raise ExecutorError(f"output index {index} is out of range: the graph has {len(self._outputs)} output(s)")
        out = self._outputs[index]
        if out is None:
            out = self._outputs[index] = self.stage.read(self._heads[index][0])
        return out

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
        self._inputs, self._outputs = {}, None  # cuda: staging buffers are freed by the stage, not held here
        self.stage.close()

    def __enter__(self) -> "GraphRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

