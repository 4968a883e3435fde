"""Scheduled PrimFuncs -> flat launch lists (kernels.json) and CUDA source (kernels.cu).

TVM 0.27 lowers a GPU PrimFunc into host code that calls each device kernel through
`tirx.call_ffi_kernel(symbol, operands..., launch values...)`. We run the s_tir pipeline up to
SplitHostDevice, then read that host code: kernel order, grid/block/shared memory, and each operand
as a function argument, a host-allocated workspace, or a scalar. Host code that does anything else
(loops, branches, values computed at run time) cannot be replayed as a flat list and is rejected.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from tvmpipe.bundle.manifests import KernelFunction, Launch, Operand, Workspace
from tvmpipe.compiler.errors import CompileError

LAUNCH_AXES = ("blockIdx.x", "blockIdx.y", "blockIdx.z", "threadIdx.x", "threadIdx.y", "threadIdx.z")
DYN_SHMEM = "tirx.use_dyn_shared_memory"


class HostCodeError(CompileError):
    """Host code of a function that a flat launch list cannot express; the caller names the op."""


ARCH = re.compile(r"^sm_(\d{2,3})[af]?$")
MIN_ARCH = 75  # nvcc 13 generates code for compute_75 and newer


def check_arch(arch: str) -> None:
    """A user-given --arch must be one nvcc can build the kernels for."""
    m = ARCH.match(arch)
    if not m or int(m.group(1)) < MIN_ARCH:
        raise CompileError(f"--arch {arch!r}: expected sm_XY with XY >= {MIN_ARCH} (e.g. sm_80, sm_90)")


def cuda_target(arch: str) -> Any:
    """TVM's CUDA target for `arch` (e.g. "sm_90"); targets are JSON dicts in TVM 0.27."""
    from tvm.target import Target

    return Target({"kind": "cuda", "arch": arch, "max_threads_per_block": 1024,
                   "max_shared_memory_per_block": 49152, "thread_warp_size": 32})


def split_passes() -> list[Any]:
    """`default_s_tir_pipeline` from CanonicalizeLoop through SplitHostDevice (stop before MakePackedAPI).

    Copied in order from tvm/s_tir/pipeline.py (0.27) with its default config; the pipeline is a
    closure there, so it cannot be cut at SplitHostDevice without listing the passes.
    """
    from tvm import s_tir, tirx

    return [
        s_tir.transform.CanonicalizeLoop(), s_tir.transform.LowerCrossThreadReduction(),
        s_tir.transform.LowerInitBlock(), s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
        s_tir.transform.ConvertBlocksToOpaque(), s_tir.transform.LiftThreadBinding(),
        s_tir.transform.ManifestSharedMemoryLocalStage(), s_tir.transform.CompactBufferAllocation(),
        s_tir.transform.LowerAutoCopy(), s_tir.transform.UnifyThreadBinding(),
        s_tir.transform.LowerMatchBuffer(), s_tir.transform.StmtSimplify(),
        s_tir.transform.InjectPermutedLayout(), s_tir.transform.AnnotateIrregularLoop(),
        s_tir.transform.InjectSoftwarePipeline(), s_tir.transform.TransformMmaBufferLayout(),
        s_tir.transform.LowerOpaqueBlock(), tirx.transform.FlattenBuffer(),
        tirx.transform.BF16ComputeLegalize(), tirx.transform.NarrowDataType(32),
        s_tir.transform.LoopPartition(), tirx.transform.VectorizeLoop(True),
        s_tir.transform.InjectVirtualThread(), s_tir.transform.InjectDoubleBuffer(),
        tirx.transform.StorageRewrite(), s_tir.transform.HoistIfThenElse(), tirx.transform.UnrollLoop(),
        s_tir.transform.RenormalizeSplitPattern(), tirx.transform.StmtSimplify(), tirx.transform.RemoveNoOp(),
        s_tir.transform.RewriteUnsafeSelect(), tirx.transform.CommonSubexprElim(),
        tirx.transform.FP8ComputeLegalize(), s_tir.transform.VerifyVTCMLimit(), s_tir.transform.LowerVtcmAlloc(),
        tirx.transform.VerifyMemory(), tirx.transform.AnnotateEntryFunc(),
        s_tir.transform.ThreadSync("shared"), s_tir.transform.ThreadSync("shared.dyn"),
        s_tir.transform.ThreadSync("warp"), s_tir.transform.InferFragment(),
        s_tir.transform.LowerThreadAllreduce(), s_tir.transform.MergeSharedMemoryAllocations(),
        tirx.transform.SplitHostDevice(),
    ]


@dataclass
class Lowered:
    """One function after SplitHostDevice: its launch list and its device kernels (PrimFuncs)."""

    name: str
    kernels: KernelFunction
    device_funcs: dict[str, Any]  # kernel symbol -> device PrimFunc


def lower_function(name: str, func: Any, target: Any) -> Lowered:
    """Split one scheduled PrimFunc into host + device code and read the host code's launches."""
    import tvm
    from tvm import tirx
    from tvm.target import Target

    mod = tvm.IRModule({name: func.with_attr("global_symbol", name)})
    mod = tirx.transform.BindTarget(target.with_host(Target({"kind": "llvm"})))(mod)
    with tvm.transform.PassContext(opt_level=3):
        mod = tvm.transform.Sequential(split_passes())(mod)
    host = None
    device = {}
    for gv, f in mod.functions.items():
        if f.attrs is not None and "calling_conv" in f.attrs and int(f.attrs["calling_conv"]) == 2:
            device[gv.name_hint] = f
        elif gv.name_hint == name:
            host = f
    if host is None:
        raise CompileError(f"internal: SplitHostDevice left no host function '{name}'")
    kernels = read_launches(name, host)
    missing = [l.kernel for l in kernels.launches if l.kernel not in device]
    if missing:
        raise CompileError(f"internal: host code of '{name}' launches unknown kernels {missing}")
    return Lowered(name, kernels, device)


def read_launches(name: str, host: Any) -> KernelFunction:
    """The launches of a host PrimFunc, in order. Raises HostCodeError for anything not flat."""
    import tvm
    from tvm import tirx

    params = {p.__chandle__(): i for i, p in enumerate(host.params)}
    aliases: dict[int, Any] = {}  # DeclBuffer var -> the buffer var whose data it views
    workspaces: dict[int, int] = {}  # AllocBuffer var -> workspace index
    ws_list: list[Workspace] = []
    launches: list[Launch] = []

    def buffer_of(expr: Any) -> Any:
        if isinstance(expr, tvm.ir.Call) and expr.op.name == "tirx.buffer_data":
            return expr.args[0]
        return None

    def operand(expr: Any, where: str) -> Operand:
        buf = buffer_of(expr)
        if buf is None:
            if isinstance(expr, tirx.IntImm):
                dt = str(expr.ty)
                return Operand("scalar", value=int(expr.value), dtype="int64" if dt == "int64" else "int32")
            if isinstance(expr, tirx.FloatImm):
                dt = str(expr.ty)
                if dt not in ("float32", "float64"):
                    raise HostCodeError(f"{where}: {dt} scalar operand {expr} has no kernel-argument packing")
                return Operand("scalar", value=float(expr.value), dtype=dt)
            raise HostCodeError(f"{where}: operand {expr} is computed at run time")
        seen = set()
        while buf.__chandle__() in aliases and buf.__chandle__() not in seen:
            seen.add(buf.__chandle__())
            buf = aliases[buf.__chandle__()]
        h = buf.__chandle__()
        if h in params:
            return Operand("arg", index=params[h])
        if h in workspaces:
            return Operand("workspace", index=workspaces[h])
        raise HostCodeError(f"{where}: operand {expr} is neither an argument nor a workspace")

    def visit(stmt: Any) -> None:
        if isinstance(stmt, tirx.SeqStmt):
            for s in stmt.seq:
                visit(s)
        elif isinstance(stmt, tirx.DeclBuffer):
            src = buffer_of(stmt.data) if stmt.data is not None else None
            if src is None:
                raise HostCodeError(f"host code declares buffer {stmt.buffer.name} over {stmt.data}")
            aliases[stmt.buffer.__chandle__()] = src
        elif isinstance(stmt, tirx.AllocBuffer):
            buf = stmt.buffer
            scope = buf.scope() if callable(getattr(buf, "scope", None)) else "global"
            if scope not in ("global", ""):
                raise HostCodeError(f"host code allocates {buf.name} in '{scope}' memory")
            shape = [_const_int(d, f"shape of workspace {buf.name}") for d in buf.shape]
            dtype = str(buf.dtype)
            workspaces[buf.__chandle__()] = len(ws_list)
            ws_list.append(Workspace(math.prod(shape) * _dtype_bytes(dtype), dtype, tuple(shape)))
        elif isinstance(stmt, tirx.Evaluate) and isinstance(stmt.value, tvm.ir.Call) \
                and stmt.value.op.name == "tirx.call_ffi_kernel":
            launches.append(launch(stmt.value))
        else:
            raise HostCodeError(f"host code has a {type(stmt).__name__} ({_short(stmt)}), not a flat sequence "
                                "of kernel launches")

    def launch(call: Any) -> Launch:
        args = list(call.args)
        symbol = str(args[0].value)
        tags = list(call.attrs.launch_params)
        n_vals = len([t for t in tags if t in LAUNCH_AXES or t == DYN_SHMEM])
        values = args[len(args) - n_vals:] if n_vals else []
        operands = args[1:len(args) - n_vals]
        where = f"launch of {symbol}"
        dims = {"blockIdx.x": 1, "blockIdx.y": 1, "blockIdx.z": 1,
                "threadIdx.x": 1, "threadIdx.y": 1, "threadIdx.z": 1}
        shared = 0
        vi = 0
        for t in tags:
            if t in dims:
                dims[t] = _const_int(values[vi], f"{where}: {t}")
                vi += 1
            elif t == DYN_SHMEM:
                shared = _const_int(values[vi], f"{where}: dynamic shared memory")
                vi += 1
            else:
                raise HostCodeError(f"{where}: unknown launch parameter '{t}'")
        return Launch(
            kernel=symbol,
            grid=(dims["blockIdx.x"], dims["blockIdx.y"], dims["blockIdx.z"]),
            block=(dims["threadIdx.x"], dims["threadIdx.y"], dims["threadIdx.z"]),
            shared_mem=shared,
            args=tuple(operand(o, f"{where} operand {k}") for k, o in enumerate(operands)),
        )

    visit(host.body)
    if not launches:
        raise HostCodeError(f"host code of '{name}' launches no kernel")
    return KernelFunction(name, launches, ws_list)


def _const_int(expr: Any, what: str) -> int:
    from tvm import tirx

    if isinstance(expr, int):
        return expr
    if isinstance(expr, tirx.IntImm):
        return int(expr.value)
    raise HostCodeError(f"{what} is {expr}, a value computed at run time (symbolic)")


def _dtype_bytes(dtype: str) -> int:
    import tvm

    dt = tvm.runtime.DataType(dtype)
    return (dt.bits * dt.lanes + 7) // 8


def _short(stmt: Any) -> str:
    text = " ".join(str(stmt).split())
    return text[:80] + ("..." if len(text) > 80 else "")


def cuda_source(device_funcs: dict[str, Any], target: Any) -> str:
    """CUDA C source of all device kernels: TVM's own CUDA codegen, one translation unit."""
    import tvm
    from tvm.tirx.compilation_pipeline import finalize_device_passes

    mod = tvm.IRModule(device_funcs)
    with target:
        mod = finalize_device_passes()(mod)
    built = tvm.get_global_func("target.build.cuda")(mod, target)
    return built.inspect_source()
