"""One zoo model through everything a user does with it: export, compile, run, compare, pipeline.

Checks, in order, for a zoo model (compiler/zoo.py) and an export path (.pt2 or ONNX):
- the bundle compiles (a CompileError's one-line message is the result otherwise);
- the reference backend's output is within `TOLERANCE x max|torch|` of torch eager (float32), or
  `FP16_TOLERANCE x max|torch|` for the fp16 mode (`dtype="float16"`: compiled with `--dtype
  float16`, compared with the float32 torch model);
- TVM's own CPU build of the same fused functions (compiler/cpucheck.py) is within it too;
- K = 2 and K = 3 equal-op splits (the planner's `plan_equal_ops`), run stage after stage as the
  pipeline feeds them, give the single-process run's bytes exactly;
- nvcc accepts kernels.cu for sm_80 and sm_90 (skipped, `None`, where nvcc is not installed).

It sits above compiler, executor and partition, so it lives in the application layer (app/); bench/zoo.py
and the tests call it.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

TOLERANCE = 1e-4  # of max|torch output|: float32 summation-order noise is ~1e-6 of it
# --dtype float16 against the float32 torch model: inputs and weights rounded to fp16 (2^-11
# relative each), every op's result rounded to fp16, and TVM's fp16 matmuls accumulate in fp16
# (sums of hundreds of terms: ~1e-3 relative per reduction, compounding over layers). Measured on
# the zoo: up to ~1.5% of max|torch| (docs/compiler.md); 5% keeps margin and still catches a wrong
# op (an error is O(1) of max|out|).
FP16_TOLERANCE = 5e-2
# Rounding every activation to fp16 costs deep CNNs more than that whoever computes: torch's own
# fp16 run of resnet50 is 5.7e-2 of max|out| off its float32 run (shufflenet_v2 3.9e-2). So an fp16
# bundle passes when it is within FP16_TOLERANCE, or within FP16_VS_TORCH_HALF x the error of torch
# running the same model in fp16 (measured in the check, `torch_fp16_error`): no worse than fp16 is.
FP16_VS_TORCH_HALF = 1.5
# TVM's own CPU build of the fused functions: a cross-check, given twice the room.
FP16_CPU_TOLERANCE = 1e-1
TOLERANCES = {"float32": TOLERANCE, "float16": FP16_TOLERANCE}
CPU_TOLERANCES = {"float32": TOLERANCE, "float16": FP16_CPU_TOLERANCE}
NVCC_ARCHS = ("sm_80", "sm_90")


@dataclass
class ZooResult:
    """What happened to one (model, path); error is a one-line message when a step failed."""

    model: str
    path: str
    dtype: str = "float32"  # the bundle's compute dtype (float16: compiled with --dtype float16)
    ok: bool = False
    error: str | None = None
    compile_s: float | None = None
    nodes: int | None = None
    kernels: int | None = None
    ref_error: float | None = None  # max|reference - torch| / max|torch|
    cpu_error: float | None = None  # max|TVM CPU build - torch| / max|torch|
    ref_ms: float | None = None
    torch_ms: float | None = None
    torch_fp16_error: float | None = None  # fp16 mode: torch's own fp16 run vs its float32 run, same measure
    split_identical: dict[str, bool] = field(default_factory=dict)  # "K=2" -> bit-identical
    nvcc_ok: bool | None = None
    exporter_failed: bool = False  # torch's exporter, not tvmpipe, could not produce the file

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def find_nvcc() -> str | None:
    return shutil.which("nvcc") or ("/usr/local/bin/nvcc" if Path("/usr/local/bin/nvcc").exists() else None)


def nvcc_accepts(cuda_source: Path, work: Path) -> bool | None:
    """nvcc --cubin for every arch in NVCC_ARCHS at once (two cores); None if nvcc is missing."""
    nvcc = find_nvcc()
    if nvcc is None:
        return None
    procs = [subprocess.Popen([nvcc, "--cubin", f"-arch={a}", "-w", "-o", str(work / f"{a}.cubin"), str(cuda_source)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for a in NVCC_ARCHS]
    for p in procs:
        p.communicate(timeout=600)
    return all(p.returncode == 0 for p in procs)


def _median_ms(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def torch_half_error(module: Any, inputs: dict[str, np.ndarray], want: np.ndarray, scale: float) -> float | None:
    """max|torch fp16 - torch float32| / max|torch float32|: what running in fp16 costs this model
    in torch itself (a copy of the module in half precision, float inputs rounded to fp16); None
    when torch cannot run it in half precision on the CPU."""
    import copy

    import torch

    try:
        half = copy.deepcopy(module).half()
        args = tuple(torch.from_numpy(v).half() if v.dtype == np.float32 else torch.from_numpy(v)
                     for v in inputs.values())
        with torch.no_grad():
            out = half(*args).float().numpy()
        return float(np.max(np.abs(out.astype(np.float64) - want))) / scale
    except Exception:  # noqa: BLE001 - an op without a CPU half kernel: the fixed tolerance applies
        return None


def split_outputs(bundle: Any, k: int, feeds: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Head entries of the K-stage equal-op plan, stages run one after another on the reference
    backend and fed exactly what the pipeline sends them."""
    from tvmpipe.executor import Stage
    from tvmpipe.partition.plan import plan_equal_ops

    values = dict(feeds)
    for start, end in plan_equal_ops(bundle.graph, k).stages:
        with Stage(bundle, start, end) as s:
            values.update(s.run({e: values[e] for e in s.program.feed_entries}))
    return {h: values[h] for h in bundle.graph.head_entries}


def check_model(name: str, path_kind: str, work: Path | None = None, *, seed: int = 0, nvcc: bool = True,
                repeat: int = 3, dtype: str = "float32") -> ZooResult:
    """Run every check on zoo model `name` exported via `path_kind` ("pt2" or "onnx"), compiled in
    `dtype` (float16: `--dtype float16`, float inputs rounded to fp16, compared with the float32
    torch model within FP16_TOLERANCE)."""
    if work is None:
        with tempfile.TemporaryDirectory(prefix=f"zoo-{name}-") as tmp:
            return check_model(name, path_kind, Path(tmp), seed=seed, nvcc=nvcc, repeat=repeat, dtype=dtype)
    from tvmpipe.bundle.errors import TvmpipeError
    from tvmpipe.compiler import zoo
    from tvmpipe.compiler.errors import CompileError
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress

    result = ZooResult(name, path_kind, dtype)
    try:
        source, module, inputs = zoo.export_model(zoo.get_zoo_model(name), path_kind, work, seed)
    except Exception as exc:  # torch's exporters raise anything; the table records it
        result.error = f"torch cannot export it: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        result.exporter_failed = True
        return result
    t = time.perf_counter()
    try:
        exported = export(str(source), seed=seed, progress=Progress(stream=None), name=f"{name}-{path_kind}",
                          dtype=None if dtype == "float32" else dtype)
    except CompileError as exc:
        result.error = str(exc)
        return result
    result.compile_s = time.perf_counter() - t
    try:
        _run_checks(result, exported, module, inputs, work, nvcc, repeat)
    except TvmpipeError as exc:  # e.g. an op the reference backend lacks: a row, not a traceback
        result.ok = False
        result.error = " ".join(str(exc).split())
    return result


def _run_checks(result: ZooResult, exported: Any, module: Any, inputs: dict[str, np.ndarray], work: Path,
                nvcc: bool, repeat: int) -> None:
    from tvmpipe.bundle import load_bundle
    from tvmpipe.compiler import zoo
    from tvmpipe.compiler.cpucheck import CpuRunner
    from tvmpipe.executor import GraphRunner, Stage, feeds_by_entry

    bundle = load_bundle(exported.write(work / "bundle"))
    g = bundle.graph
    result.nodes = len(g.op_nodes)
    result.kernels = sum(len(bundle.launches_of(n)) for n in g.op_nodes if not g.nodes[n].is_nop)
    dtype = exported.dtype
    named = {n: v.astype(dtype) if dtype != "float32" and v.dtype == np.float32 else v
             for n, v in zip(bundle.input_names, inputs.values())}
    want = zoo.torch_output(module, inputs)
    tolerance = TOLERANCES.get(dtype, FP16_TOLERANCE)
    cpu_tolerance = CPU_TOLERANCES.get(dtype, FP16_CPU_TOLERANCE)
    scale = max(float(np.max(np.abs(want))), 1e-30)

    runner = GraphRunner(bundle, backend="reference")
    runner.set_input(**named)
    runner.run()
    got = runner.get_output(0)
    result.ref_error = float(np.max(np.abs(got.astype(np.float64) - want))) / scale
    result.ref_ms = _median_ms(runner.run, repeat)
    import torch

    torch_args = tuple(torch.from_numpy(v) for v in inputs.values())
    with torch.no_grad():
        result.torch_ms = _median_ms(lambda: module(*torch_args), repeat)

    if dtype == "float16":
        result.torch_fp16_error = torch_half_error(module, inputs, want, scale)
        if result.torch_fp16_error is not None:
            tolerance = max(tolerance, FP16_VS_TORCH_HALF * result.torch_fp16_error)
            cpu_tolerance = max(cpu_tolerance, 2 * FP16_VS_TORCH_HALF * result.torch_fp16_error)

    cpu = CpuRunner.build(exported.unscheduled).run(g, named, bundle.params)[0]
    result.cpu_error = float(np.max(np.abs(cpu.astype(np.float64) - want))) / scale

    feeds = feeds_by_entry(bundle, named)
    with Stage(bundle, 0, len(g.nodes)) as whole_stage:
        whole = whole_stage.run(feeds)
    for k in (2, 3):
        parts = split_outputs(bundle, k, feeds)
        result.split_identical[f"K={k}"] = all(parts[h].tobytes() == whole[h].tobytes() for h in g.head_entries)
    result.nvcc_ok = nvcc_accepts(work / "bundle" / "kernels.cu", work) if nvcc else None
    problems = []
    if result.ref_error > tolerance:
        problems.append(f"reference differs from torch by {result.ref_error:.2e} of max|torch|")
    if result.cpu_error > cpu_tolerance:
        problems.append(f"TVM CPU build differs from torch by {result.cpu_error:.2e} of max|torch|")
    problems += [f"{k} split is not bit-identical" for k, same in result.split_identical.items() if not same]
    if result.nvcc_ok is False:
        problems.append(f"nvcc rejects kernels.cu for {'/'.join(NVCC_ARCHS)}")
    result.ok = not problems
    result.error = "; ".join(problems) or None
