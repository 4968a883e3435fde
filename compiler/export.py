"""The compile pipeline: model source -> bundle dicts (graph, kernels, ops, CUDA source, params).

Steps (each timed on stderr): import, fold (cleanup + constant folding), fuse (record ops,
legalize, fuse, graph), schedule (dlight), codegen (launch lists + CUDA source). TVM is imported
here, inside functions: `import tvmpipe.compiler` works without it.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from tvmpipe.bundle.dtypes import is_float
from tvmpipe.bundle.manifests import FusedFunction, KernelFunction
from tvmpipe.compiler.errors import CompileError, TvmMissingError, UnsupportedOpError, one_line
from tvmpipe.compiler.lazyweights import GraphParams, materialize_folded
from tvmpipe.compiler import smallrows
from tvmpipe.compiler.progress import Progress

DEFAULT_ARCH = "sm_90"
DTYPES = ("float32", "float16", "bfloat16")
LOW = ("float16", "bfloat16")
# dlight's fp16 matmul tensorization crashes for sm_70+ when any dimension exceeds 64 (see
# docs/compiler.md); scheduling fp16 under this arch and generating code for the real one works.
FP16_SCHEDULE_ARCH = "sm_61"


def require_tvm() -> None:
    """Fail with the install hint, not an ImportError, when the compile extra is missing."""
    for module in ("tvm", "torch", "onnx"):
        try:
            importlib.import_module(module)
        except ImportError:
            raise TvmMissingError(module) from None


@dataclass
class Exported:
    """Everything a bundle holds, as JSON-ready dicts, plus the unscheduled fused functions.

    `unscheduled` (an IRModule of the graph's PrimFuncs before GPU scheduling) is what the CPU
    check builds with LLVM: the same fused functions, compiled independently of the CUDA path.
    """

    model: str
    source: dict[str, Any]
    target: dict[str, Any]
    batch: int
    dtype: str
    inputs: list[str]
    input_shapes: list[tuple[int, ...]]
    input_dtypes: list[str]
    graph: dict[str, Any]
    kernels: dict[str, Any]
    ops: dict[str, Any]
    cuda_source: str
    params: Mapping[str, np.ndarray]  # a GraphParams from export(): each tensor valued on lookup
    tvm_version: str
    unscheduled: Any = None
    torch_module: Any = None
    timings: dict[str, float] = field(default_factory=dict)
    state: list[Any] = field(default_factory=list)  # bundle.state.StatePair
    generation: Any = None  # bundle.state.GenerationSpec
    tokenizer: list[Path] = field(default_factory=list)  # a checkpoint's tokenizer files (bundle dir tokenizer/)

    def write(self, out_dir: str | Path, *, params_seed: int | None = None, overwrite: bool = False) -> Path:
        """Write the bundle atomically. With `params_seed`, weights are left out and generated on load.

        The weights are streamed: each tensor is computed (transposed, converted), written into a
        safetensors file beside `out_dir` and dropped, and the file is then moved into the bundle."""
        import os

        from tvmpipe.bundle import write_bundle

        common = dict(model=self.model, source=self.source, target=self.target, batch=self.batch,
                      dtype=self.dtype, graph=self.graph, kernels=self.kernels, ops=self.ops,
                      cuda_source=self.cuda_source, inputs=self.inputs, tvm_version=self.tvm_version,
                      overwrite=overwrite, state=self.state, generation=self.generation,
                      tokenizer=self.tokenizer)
        if params_seed is not None or not isinstance(self.params, GraphParams):
            return write_bundle(out_dir, params=None if params_seed is not None else self.params,
                                params_seed=params_seed, **common)
        out = Path(out_dir).resolve()
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.params-{os.getpid()}.safetensors")
        try:
            sums = self.params.write(tmp)
            return write_bundle(out_dir, params=None, weights=(tmp, sums), **common)
        finally:
            tmp.unlink(missing_ok=True)


@contextmanager
def _step(progress: Progress, name: str, detail: str = "") -> Iterator[None]:
    """A timed step whose unexpected TVM failure becomes one line naming the step, not a traceback."""
    with progress.step(name, detail):
        try:
            yield
        except CompileError:
            raise
        except Exception as exc:  # noqa: BLE001 - TVM raises TVMError, TypeError, ValueError, ...
            raise CompileError(f"TVM fails in the {name} step ({type(exc).__name__}: {one_line(exc)}); the model "
                               "uses a construct tvmpipe cannot compile yet: please report it with the model") from None


def default_rules() -> list[Any]:
    """dlight's GPU rules in the order that picks each function's schedule."""
    import tvm.s_tir.dlight as dl

    return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]


def _rules(few_rows: bool) -> list[Any]:
    """default_rules, after compiler/smallrows.py's tile for matmuls of 2-16 rows where `few_rows`
    (decode steps)."""
    return ([smallrows.small_rows_rule()] if few_rows else []) + default_rules()


def export(source: str, *, arch: str = DEFAULT_ARCH, batch: int | None = None, dtype: str | None = None,
           seed: int = 0, progress: Progress | None = None, name: str | None = None,
           decode: int | None = None, chunk: int = 1, seq_len: int | None = None,
           generation: Any = None, tokenizer: str | None = None, quantize: str | None = None,
           group_size: int | None = None, kv: Any = None) -> Exported:
    """Compile SOURCE (.onnx, .pt2, a Hugging Face checkpoint directory, or a built-in model name)
    for CUDA `arch`. With `decode` (a max context), SOURCE is a decoder (compiler/decoders.py) or a
    checkpoint of one and the bundle is its decode step, taking up to `chunk` tokens a row; or a
    stateful .pt2 whose generation inputs and logits `generation` (genspec.Declared) names or
    leaves to inference. A checkpoint's forward pass takes `seq_len` tokens. `kv`: a decode step's
    KV layout (decoders.KvOptions, or "static" / "paged" with the default page size and pool;
    None: default_kv's, paged wherever it is built)."""
    from tvmpipe.compiler import launches

    progress = progress or Progress()
    launches.check_arch(arch)
    if dtype not in (None, *DTYPES):
        raise CompileError(f"unsupported --dtype {dtype!r} (supported: {', '.join(DTYPES)})")
    with progress.step("load", "tvm, torch, onnx"):
        require_tvm()
    import tvm

    from tvmpipe.compiler import frontend

    if kv is not None or decode is not None or generation is not None:
        kv = _kv_options(kv, arch, source, dtype)
    with _step(progress, "import", source):
        imp = frontend.load_source(source, batch, seed, decode=decode, chunk=chunk, dtype=dtype, seq_len=seq_len,
                                   generation=generation, tokenizer=tokenizer, quantize=quantize,
                                   group_size=group_size, kv=kv)
    if kv is not None:
        _record_kv(imp, kv, progress)
    if name:
        imp.model = name
    target = launches.cuda_target(arch)
    names = imp.const_names
    with _step(progress, "fold"), target:
        mod = _fold(imp.mod, names, imp.weights)
        imp.mod = None  # the import's module holds the unfolded constants
        want = dtype or imp.native_dtype or imp.dtype  # a bf16/fp16 torch program imports in float32
        if want != imp.dtype:
            mod = _convert(mod, imp, want, names)
            mod = materialize_folded(mod, names, imp.weights)  # casts the conversion added on weights
    with _step(progress, "fuse"), target:
        fused = _fuse(mod, names, imp.packed)
    prims = {name: fused.mod[name] for name in fused.calls}
    with _step(progress, "schedule", f"{len(prims)} functions"):
        # dlight's fp16 matmul rule crashes for sm_70+; see FP16_SCHEDULE_ARCH
        fp16 = any(d in LOW for n in fused.graph.nodes for _, d in n.outputs)
        with launches.cuda_target(FP16_SCHEDULE_ARCH) if fp16 else target:
            scheduled = _schedule(fused, prims, few_rows=decode is not None)
    with _step(progress, "codegen", f"CUDA {arch}"):
        kernels, ops, src = _codegen(fused, scheduled, prims, target)
    return Exported(
        model=imp.model, source=imp.source, target={"kind": "cuda", "arch": arch}, batch=imp.batch,
        dtype=imp.dtype, inputs=fused.graph.inputs, input_shapes=imp.input_shapes, input_dtypes=imp.input_dtypes,
        graph=fused.graph.graph,
        kernels={"version": 1, "functions": {k: v.to_json() for k, v in kernels.items()}},
        ops={"version": 1, "functions": {k: v.to_json() for k, v in ops.items()}},
        cuda_source=src, params=GraphParams(fused.graph.params, imp.weights), tvm_version=tvm.__version__,
        unscheduled=tvm.IRModule(_for_cpu(prims, ops)), torch_module=imp.torch_module, timings=dict(progress.timings),
        state=_check_state(imp, fused.graph.inputs), generation=imp.generation, tokenizer=list(imp.tokenizer),
    )


def _for_cpu(prims: dict[str, Any], ops: dict[str, FusedFunction]) -> dict[str, Any]:
    """The functions the CPU check builds: the fused PrimFuncs before scheduling, except a paged
    step's paged kernels, which come scheduled for CUDA from their generators: their llvm
    variants (compiler/pagedkv.py) take their place."""
    from tvmpipe.compiler import pagedkv
    from tvmpipe.compiler.opmap import PAGED_OPS

    out = dict(prims)
    for name, fn in ops.items():
        if len(fn.ops) == 1 and fn.ops[0].op in PAGED_OPS:
            rec = fn.ops[0]
            out[name] = pagedkv.cpu_func(rec.op, rec.input_shapes, rec.input_dtypes)
    return out


def _kv_options(kv: Any, arch: str, source: str, dtype: str | None) -> Any:
    """A decode step's `kv` as decoders.KvOptions built for `arch` (None: default_kv's)."""
    import dataclasses

    from tvmpipe.compiler.decoders import KvOptions

    if kv is None:
        opts = default_kv(source, dtype)
    else:
        opts = KvOptions(layout=kv) if isinstance(kv, str) else kv
    return dataclasses.replace(opts, arch=arch)


def default_kv(source: str, dtype: str | None) -> Any:
    """The KV layout (decoders.KvOptions) of a decode step compiled without `--kv` (issue 53):
    paged (the default page size and pool) wherever a paged step is built, else static with the
    reason. The one place that decides; an explicit `--kv paged` that cannot be built is refused
    where it is built (frontend.load_source, pagedkv.check_page_dtype), in one line."""
    from tvmpipe.compiler.decoders import DECODERS, KvOptions
    from tvmpipe.compiler.pagedkv import PAGE_DTYPES

    path = Path(source)
    if path.suffix == ".pt2":
        return KvOptions("static", reason="a .pt2 program's decode step keeps the caches it declares")
    if path.is_dir():
        from tvmpipe.compiler.checkpoint import open_checkpoint

        pages = dtype or open_checkpoint(path, True).dtype  # a checkpoint builds in its --dtype directly
    elif path.suffix == ".gguf" or source in DECODERS:
        pages = dtype or "float32"  # built in float32, or converted to --dtype
    else:  # not a decode step at all: frontend.load_source says what it is
        return KvOptions("static", reason=f"{source} is not a built-in decoder, a checkpoint directory or a GGUF file")
    if pages not in PAGE_DTYPES:
        return KvOptions("static", reason=f"pages of {pages} are not built ({' and '.join(PAGE_DTYPES)} are)")
    return KvOptions("paged")


def _record_kv(imp: Any, kv: Any, progress: Progress) -> None:
    """bundle.json's source.decode.kv says a static step's layout too (a paged one's is the
    frontend's: page size and pool), with the reason a step compiled without --kv is not paged;
    the compile log says that reason."""
    if kv.reason is not None:
        progress.note(f"kv cache static: {kv.reason} (the default is paged where it is built)")
    decode = imp.source.get("decode") if isinstance(imp.source, dict) else None
    if isinstance(decode, dict) and "kv" not in decode:
        decode["kv"] = {"layout": "static", **({"reason": kv.reason} if kv.reason is not None else {})}


def _check_state(imp: Any, inputs: list[str]) -> list[Any]:
    """The imported state pairs, whose inputs must have survived compilation as graph inputs."""
    lost = [p.input for p in imp.state if p.input not in inputs]
    if lost:
        raise CompileError(f"{imp.model}: state input(s) {', '.join(lost)} are not inputs of the compiled graph "
                           "(the program never reads them); tvmpipe cannot declare their state")
    return list(imp.state)


def _fold(mod: Any, names: Any, weights: Any = None) -> Any:
    """Inference cleanups and constant folding (weights pre-transposed, batch norm folded).

    Placeholder weights (lazyweights.py) are folded as recipes by the NumPy folder; any that TVM
    would still compute with is given its real value first."""
    import tvm
    from tvm import relax

    from tvmpipe.compiler import lowfold, npfold
    from tvmpipe.compiler.lazyweights import materialize_folded

    mod = tvm.transform.Sequential([
        relax.transform.FoldBatchnormToConv2D(), relax.transform.DecomposeOpsForInference(),
        relax.transform.CanonicalizeBindings(),  # without it batch-norm leftovers block relu fusion
    ])(mod)
    mod = npfold.fold_constants(mod, names, weights)
    if weights is not None:
        mod = materialize_folded(mod, names, weights)
    folded = relax.transform.FoldConstant()(mod)
    names.track_fold(mod["main"], folded["main"])
    return lowfold.fold_after_legalize(relax.transform.DeadCodeElimination()(folded), names)


def _convert(mod: Any, imp: Any, dtype: str, names: Any) -> Any:
    """--dtype float16/bfloat16 on a float32 model (or a bf16/fp16 torch program, imported in
    float32): convert inputs, weights and compute (after folding)."""
    from tvmpipe.compiler.precision import to_float16

    if imp.dtype != "float32" or dtype not in LOW:
        raise CompileError(f"{imp.model}: cannot convert a {imp.dtype} model to {dtype} "
                           "(only float32 -> float16 or bfloat16)")
    imp.input_dtypes = [dtype if d == "float32" else d for d in imp.input_dtypes]
    imp.dtype = dtype
    return to_float16(mod, names, imp.weights, dtype)


@dataclass
class _Fused:
    """The fused module, its graph.json, and for each launched function its first node and group."""

    mod: Any
    graph: Any  # graphjson.BuiltGraph
    fusion: Any  # opmap.Fusion
    prog: Any  # opmap.Program
    calls: dict[str, tuple[str, Any]]


def _fuse(mod: Any, names: Any, packed: dict[str, Any] | None = None) -> _Fused:
    """Record the model ops, legalize, fuse, and build graph.json from the fused main. `packed`
    weight fields (main parameters until here) are bound after the last constant fold, and their
    unpack ops fused into the matmuls that read them (dequantfuse.py)."""
    import tvm
    from tvm import relax

    from tvmpipe.compiler import dequantfuse, graphjson, lowfold, opmap, scanops

    prog = opmap.record_ops(mod["main"])
    mod = scanops.scans_to_reductions(mod)  # before DispatchSortScan, which would take them
    mod = tvm.transform.Sequential([
        relax.backend.DispatchSortScan(), relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
    ])(mod)
    refolded = relax.transform.FoldConstant()(mod)
    names.track_fold(mod["main"], refolded["main"])
    # anything this second fold still folds reads as its constant (a param), as in the first
    folded = lowfold.match_folded(mod["main"], refolded["main"])
    refolded, bound = dequantfuse.bind_packed(refolded, packed or {})
    fusion = opmap.Fusion(refolded["main"], prog, folded={**folded, **bound})
    mod = relax.transform.FuseOps()(refolded)
    mod, _ = dequantfuse.fuse_dequantize_matmul(mod, {opmap.key(c) for c in bound.values()})
    groups = fusion.groups(mod)
    mod = tvm.transform.Sequential([
        relax.transform.FuseTIR(), relax.transform.RewriteDataflowReshape(), relax.transform.DeadCodeElimination(),
    ])(mod)
    group_of = {opmap.key(g.main_var): g for g in groups}

    def op_of_var(var: Any) -> str | None:
        """The model op(s) behind a binding of the final main, for error messages."""
        g = group_of.get(opmap.key(var))
        if g is not None and g.op_vars + g.split_ops:
            return ", ".join(prog.ops[opmap.key(v)].op for v in g.op_vars + g.split_ops)
        k = opmap.key(fusion.canonical(var))
        owner = fusion.owner.get(k)
        hit = prog.ops.get(k) or (prog.ops.get(opmap.key(owner)) if owner is not None else None)
        return hit.op if hit else None

    built = graphjson.build_graph(mod["main"], names.get, op_of_var, value_of=lambda c: c)
    return _Fused(mod, built, fusion, prog, _calls_by_function(built, group_of))


def _schedule(fused: _Fused, prims: dict[str, Any], few_rows: bool = False) -> Any:
    """dlight schedules for every function; where a rule crashes on a function, the rules after it.

    dlight's reduction rules raise on some fused shapes (a layer_norm fused with the padding of
    Swin's windows at 64 px). One raising rule aborts `ApplyDefaultSchedule` for the whole module,
    so the module is retried function by function, and a function whose rule raises goes on to the
    next rule in the default order, down to Fallback, which schedules any function as plain thread
    blocks. A function no rule schedules is reported with its model ops, its graph node, and what
    each rule raised.
    """
    import tvm
    import tvm.s_tir.dlight as dl

    try:
        return dl.ApplyDefaultSchedule(*_rules(few_rows))(tvm.IRModule(prims))
    except Exception:  # noqa: BLE001 - TVM raises TVMError, TypeError, ...; retried per function below
        pass
    return tvm.IRModule({name: _schedule_one(fused, name, func, few_rows) for name, func in prims.items()})


def _schedule_one(fused: _Fused, name: str, func: Any, few_rows: bool = False) -> Any:
    """The first default rule that applies to `func` without raising, as ApplyDefaultSchedule picks."""
    import tvm
    import tvm.s_tir.dlight as dl

    try:
        return dl.ApplyDefaultSchedule(*_rules(few_rows))(tvm.IRModule({name: func}))[name]
    except Exception:  # noqa: BLE001 - which rule raised is found below, one rule at a time
        pass
    crashes = []
    rules = _rules(few_rows)
    for rule in rules:
        try:
            got = dl.ApplyDefaultSchedule(rule)(tvm.IRModule({name: func}))[name]
        except Exception as exc:  # noqa: BLE001 - TVM raises TVMError, TypeError, ...; try the next rule
            crashes.append(f"{type(rule).__name__}: {type(exc).__name__}: {one_line(exc)}")
            continue
        if got.attrs is not None and "tirx.is_scheduled" in got.attrs:  # this rule applied
            return got
    node, group = fused.calls[name]
    others = "" if len(crashes) == len(rules) else "; no other rule applies"
    raise UnsupportedOpError(_model_ops(fused, group, name), node,
                             f"TVM's dlight GPU scheduler fails on it ({'; '.join(crashes)}{others})")


def _model_ops(fused: _Fused, group: Any, name: str) -> str:
    from tvmpipe.compiler import opmap

    return ", ".join(fused.prog.ops[opmap.key(v)].op for v in group.op_vars + group.split_ops) or name


def _codegen(fused: _Fused, scheduled: Any, prims: dict[str, Any],
             target: Any) -> tuple[dict[str, KernelFunction], dict[str, FusedFunction], str]:
    """Launch lists, op programs and the CUDA source; rejects functions a launch list cannot run."""
    from tvmpipe.compiler import launches, opmap

    kernels: dict[str, KernelFunction] = {}
    ops: dict[str, FusedFunction] = {}
    device: dict[str, Any] = {}
    for name, (node_name, group) in fused.calls.items():
        model_ops = _model_ops(fused, group, name)
        try:
            lowered = launches.lower_function(name, scheduled[name], target)
        except launches.HostCodeError as exc:
            raise UnsupportedOpError(model_ops, node_name, f"{exc}; a flat launch list cannot express it") from None
        if group.split_ops:
            raise UnsupportedOpError(model_ops, node_name, "TVM lowers it to several functions, which "
                                     "ops.json cannot describe as one model op")
        kernels[name] = lowered.kernels
        device.update(lowered.device_funcs)
        ops[name] = fused.fusion.program(group, name)
        _check_arity(name, ops[name], prims[name])
    return kernels, ops, launches.cuda_source(device, target)


def _calls_by_function(built: Any, group_of: dict[int, Any]) -> dict[str, tuple[str, Any]]:
    """Function name -> (first graph node calling it, its fused group), for kernel-launching nodes."""
    from tvmpipe.compiler.opmap import key

    out: dict[str, tuple[str, Any]] = {}
    for n in built.nodes:
        if n.op != "tvm_op" or n.func_name == "__nop" or n.func_name in out:
            continue
        group = group_of.get(key(n.main_var))
        if group is None:
            raise CompileError(f"internal: graph node '{n.name}' calls '{n.func_name}', which no fused group explains")
        out[n.func_name] = (n.name, group)
    return out


def _check_arity(name: str, program: FusedFunction, prim: Any) -> None:
    """ops.json's calling convention must be the PrimFunc's: inputs then outputs, same count (an
    in-place call's PrimFunc takes its inputs only: its output is written over one of them)."""
    inplace = any("inplace" in op.attrs for op in program.ops)
    if program.num_inputs + (0 if inplace else program.num_outputs) != len(prim.params):
        raise CompileError(f"internal: '{name}' takes {len(prim.params)} arguments but its op program has "
                           f"{program.num_inputs} inputs + {program.num_outputs} outputs")


def compile_model(source: str, out_dir: str | Path, *, arch: str = DEFAULT_ARCH, batch: int | None = None,
                  dtype: str | None = None, seed: int = 0, omit_params: bool = False, overwrite: bool = False,
                  progress: Progress | None = None, name: str | None = None, decode: int | None = None,
                  chunk: int = 1, seq_len: int | None = None, generation: Any = None,
                  tokenizer: str | None = None, quantize: str | None = None, group_size: int | None = None,
                  kv: Any = None) -> Path:
    """`tvmpipe compile`: export SOURCE and write the bundle to `out_dir` (atomically)."""
    progress = progress or Progress()
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise CompileError(f"{out} already exists (pass --force to replace it)")
    if omit_params and decode is not None:  # known before the export: refused before it is paid for
        raise CompileError(_omit_decode(source))
    exported = export(source, arch=arch, batch=batch, dtype=dtype, seed=seed, progress=progress, name=name,
                      decode=decode, chunk=chunk, seq_len=seq_len, generation=generation, tokenizer=tokenizer,
                      quantize=quantize, group_size=group_size, kv=kv)
    if omit_params:
        check_omittable(exported)
    with progress.step("write", str(out)):
        path = exported.write(out, params_seed=seed if omit_params else None, overwrite=overwrite)
    return path


def _omit_decode(model: str) -> str:
    return (f"{model}: --omit-params does not apply to a decode step: its params hold compiled constants (cache "
            "positions, the attention mask's fill value) that generated values would replace; compile it with "
            "its params")


def check_omittable(exported: Exported) -> None:
    """Refuse `--omit-params` where generated values would change what the model computes, not only
    its weights: generate_params zeroes integer params (index tensors) and draws every float one at
    random, so a decode step's compiled constants (cache positions, the attention mask's fill value)
    would run the same kernels as a different model. Those bundles ship their params."""
    if exported.state:
        raise CompileError(_omit_decode(exported.model))
    params = exported.params
    specs = params.specs() if isinstance(params, GraphParams) else \
        [(n, str(a.dtype), tuple(a.shape)) for n, a in params.items()]
    for name, dtype, shape in specs:
        if not is_float(dtype):
            raise CompileError(f"{exported.model}: --omit-params would generate param '{name}' ({dtype} "
                               f"{list(shape)}), a constant the model computes with (generated integers are "
                               "zeros); compile it with its params")
