"""The models the compiler tests compile, and the result of compiling one (compiled once per session)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

BUILTINS = ["mlp", "cnn", "resnet18", "transformer"]
FILE_SOURCES = ["onnx", "pt2"]


@dataclass
class Compiled:
    """A compiled model: the export result, its bundle on disk, and the source model's own output."""

    name: str
    exported: Any  # tvmpipe.compiler.export.Exported
    bundle_dir: Path
    x: np.ndarray  # the input fed to both the bundle and the source model
    reference: np.ndarray  # the source model's output for x (torch or ONNX reference)
    _cpu: tuple[list[np.ndarray], dict[int, np.ndarray]] | None = None

    def cpu_run(self) -> tuple[list[np.ndarray], dict[int, np.ndarray]]:
        """(outputs, every entry's value) of the bundle on disk, run once on the CPU with TVM's LLVM
        build of the unscheduled functions and the graph.json storage plan."""
        if self._cpu is None:
            from tvmpipe.bundle import load_bundle
            from tvmpipe.compiler.cpucheck import CpuRunner

            b = load_bundle(self.bundle_dir)
            record: dict[int, np.ndarray] = {}
            outs = CpuRunner.build(self.exported.unscheduled).run(
                b.graph, {b.input_names[0]: self.x}, b.params, use_storage_plan=True, keep=record)
            self._cpu = (outs, record)
        return self._cpu


def compile_source(name: str, tmp: Path) -> Compiled:
    """Compile a built-in model, "onnx" or "pt2" (see model_files.py) into a bundle under `tmp`."""
    import torch

    from tests.support import model_files
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.models import example_input
    from tvmpipe.compiler.progress import Progress

    quiet = Progress(stream=None)
    if name == "onnx":
        path = model_files.write_onnx_model(tmp / "small.onnx")
        exported = export(str(path), batch=3, progress=quiet)
        x = example_input(exported.input_shapes[0], "float32", 1)
        reference = model_files.onnx_reference(path, x)[0]
    elif name == "pt2":
        path = tmp / "small.pt2"
        model_files.write_pt2(path, batch=2)
        exported = export(str(path), progress=quiet)
        x = example_input(exported.input_shapes[0], "float32", 1)
        with torch.no_grad():
            reference = torch.export.load(str(path)).module()(torch.from_numpy(x)).numpy()
    else:
        exported = export(name, progress=quiet)
        x = example_input(exported.input_shapes[0], "float32", 1)
        with torch.no_grad():
            reference = exported.torch_module(torch.from_numpy(x)).numpy()
    bundle_dir = exported.write(tmp / "bundle")
    return Compiled(name, exported, bundle_dir, x, reference)
