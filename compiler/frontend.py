"""Model sources -> one Relax `main` whose weights are bound as named constants.

Three kinds of SOURCE: an ONNX file, a torch.export program (.pt2), or a built-in model name.
Every importer ends the same way: the Relax module with weights as constants (so constant folding
can pre-transpose them instead of emitting transpose kernels) and a map from each bound constant to
the weight name, which the graph's null nodes carry. Big weights are bound as placeholders whose
value is read from the source tensor when the bundle is written (lazyweights.py).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tvmpipe.bundle.bundle import sha256_file
from tvmpipe.compiler.constnames import ConstNames
from tvmpipe.compiler.lazyweights import LazyWeights
from tvmpipe.compiler.errors import SourceError, one_line
from tvmpipe.compiler.models import build_builtin, get_builtin
from tvmpipe.compiler.boolcmp import bool_compares_as_int8
from tvmpipe.compiler.empties import drop_empty_concat_operands
from tvmpipe.compiler.negindex import normalize_negative_indices
from tvmpipe.compiler.tecalls import te_calls_to_ops


@dataclass
class Imported:
    """A model as a Relax module, ready for the export pipeline.

    `const_names` names each bound weight constant; `inputs` are the names of main's parameters,
    which become the graph inputs. `torch_module` is kept for built-in
    models so checks can compute the source model's own output.
    """

    mod: Any  # tvm.IRModule
    model: str
    source: dict[str, Any]
    inputs: list[str]
    input_shapes: list[tuple[int, ...]]
    input_dtypes: list[str]
    batch: int
    dtype: str
    const_names: ConstNames = field(default_factory=ConstNames)
    torch_module: Any = None
    state: list = field(default_factory=list)  # bundle.state.StatePair: lifted buffers, decode caches
    generation: Any = None  # bundle.state.GenerationSpec of a decode step
    weights: LazyWeights = field(default_factory=LazyWeights)
    native_dtype: str | None = None  # bfloat16/float16: the program was imported in float32 (_as_float32)
    tokenizer: list[Path] = field(default_factory=list)  # a checkpoint's tokenizer files, copied into the bundle
    output_names: list[str] = field(default_factory=list)  # a torch program's user outputs, as it names them
    # packed weight fields (compiler/packed.py): main parameter name -> the constant the fuse step binds
    packed: dict[str, Any] = field(default_factory=dict)


def load_source(source: str, batch: int | None = None, seed: int = 0, decode: int | None = None,
                chunk: int = 1, dtype: str | None = None, seq_len: int | None = None,
                generation: Any = None, tokenizer: str | None = None, quantize: str | None = None,
                group_size: int | None = None, kv: Any = None) -> Imported:
    """Import SOURCE in its own dtype. `batch` None means the file's own batch (files) or 1 (built-ins).
    With `decode` (a max context), SOURCE is a decoder and the program is its decode step.
    A checkpoint directory imports in `dtype` (default: its own); its forward pass takes `seq_len`
    tokens. A .pt2 with `generation` (genspec.Declared; or `decode`, its max context) is a stateful
    decode step whose generation section is declared from it (genspec.py). `kv`
    (decoders.KvOptions) is a decode step's KV layout: static (None) or paged."""
    if batch is not None and batch < 1:
        raise SourceError(f"--batch must be a positive integer, got {batch}")
    path = Path(source)
    if seq_len is not None and not (path.is_dir() and decode is None):
        raise SourceError("--seq-len is the forward pass's length of a checkpoint directory (without --decode)")
    if generation is not None and path.suffix != ".pt2":
        raise SourceError("--token-input, --position-input, --count-input and --logits-output declare a .pt2 "
                          "program's generation section")
    if tokenizer is not None and path.suffix != ".gguf":
        raise SourceError("--tokenizer names the tokenizer of a GGUF file (a checkpoint directory carries its own)")
    paged = kv is not None and kv.layout != "static"
    if paged and (decode is None or path.suffix in (".pt2", ".onnx")):
        raise SourceError("--kv paged applies to the decode step (--decode) of a built-in decoder, a checkpoint "
                          "directory or a GGUF file")
    if paged and dtype is not None:  # before anything is read (a source's own dtype: decoders._paged_layout)
        from tvmpipe.compiler.pagedkv import check_page_dtype

        check_page_dtype(dtype)
    if path.suffix == ".gguf":
        return _from_gguf(path, batch or 1, decode, chunk, dtype, tokenizer, kv)
    if (quantize is not None or group_size is not None) and not (path.is_dir() and decode is not None):
        raise SourceError("--quantize and --group-size quantize a checkpoint directory's decode step (DIR --decode)")
    if path.is_dir():
        return _from_checkpoint(path, batch or 1, decode, chunk, dtype, seq_len, quantize, group_size, kv)
    if path.suffix == ".pt2":
        imp = _from_pt2(path, batch)
        if generation is not None or decode is not None:
            from tvmpipe.compiler.genspec import Declared

            if chunk != 1:
                raise SourceError(f"{path}: --chunk is fixed by the program's token input; it takes no --chunk")
            imp.generation = _declare(imp, generation or Declared(max_context=decode), path)
        return imp
    if decode is not None:
        return _from_decoder(source, batch or 1, seed, decode, chunk, kv)
    if path.suffix == ".onnx":
        return _from_onnx(path, batch)
    if path.exists():
        raise SourceError(f"{source}: unknown model file type '{path.suffix}' (expected .onnx or .pt2)")
    return _from_builtin(source, batch or 1, seed)


# ---- torch ----------------------------------------------------------------------------------------

def _from_builtin(name: str, batch: int, seed: int) -> Imported:
    import torch

    spec = get_builtin(name)
    module = build_builtin(name, batch, seed)
    example = torch.zeros(spec.input_shape(batch), dtype=torch.float32)
    with warnings.catch_warnings():  # torch's own deprecation noise would bury the step lines
        warnings.simplefilter("ignore", FutureWarning)
        ep = torch.export.export(module, (example,))
    imp = _from_exported(ep, name, {"kind": "builtin", "name": name, "sha256": None, "seed": seed})
    imp.torch_module = module
    return imp


def _decode_source(max_context: int, chunk: int, spec: Any) -> dict[str, Any]:
    """bundle.json source.decode: the max context, the chunk, a paged step's page size and pool."""
    out: dict[str, Any] = {"max_context": max_context, **({"chunk": chunk} if chunk > 1 else {})}
    if spec.paged is not None:
        out["kv"] = {"layout": "paged", "page_size": spec.paged.page_size, "pages": spec.paged.pages}
    return out


def _from_decoder(name: str, batch: int, seed: int, max_context: int, chunk: int = 1, kv: Any = None) -> Imported:
    """A decoder's decode step (compiler/decoders.py), its caches declared as state."""
    from tvmpipe.compiler.decoders import KvOptions, export_decode_step

    kv = kv or KvOptions()
    ep, module, spec = export_decode_step(name, max_context, batch, seed, chunk, **kv.step_args())
    imp = _from_exported(ep, f"{name}_decode", {"kind": "decode", "name": name, "sha256": None, "seed": seed,
                                                 "decode": _decode_source(max_context, chunk, spec)},
                         extra_convert=kv.converters())
    if imp.inputs != spec.inputs:
        raise SourceError(f"internal: the decode step of {name} imported with inputs {imp.inputs}")
    imp.state = spec.state_pairs()
    imp.generation = spec.generation()
    imp.torch_module = module
    return imp


DEFAULT_SEQ_LEN = 64


def _from_checkpoint(path: Path, batch: int, decode: int | None, chunk: int, dtype: str | None,
                     seq_len: int | None, quantize: str | None = None, group_size: int | None = None,
                     kv: Any = None) -> Imported:
    """A Hugging Face checkpoint directory (compiler/checkpoint.py): with `decode` (a max context)
    its decode step, else its forward pass over `seq_len` tokens; in `dtype` (default: the
    checkpoint's own, half precision imported as such: compiler/importops.py). The model is built
    without its weights (compiler/hfmodel.py): each weight is bound as a placeholder read from the
    checkpoint when the bundle is written."""
    import torch

    from tvmpipe.compiler.checkpoint import CONFIG, ENCODERS, open_checkpoint
    from tvmpipe.compiler.decoders import KvOptions, decode_step_module, export_step
    from tvmpipe.compiler.hfmodel import build_model
    from tvmpipe.compiler.precision import norms_in_float32
    from tvmpipe.compiler.zoo import text_forward

    ckpt = open_checkpoint(path, decode is not None)
    want = dtype or ckpt.dtype
    if quantize is not None or group_size is not None:
        from tvmpipe.compiler import quantize as quant

        scheme, group = quantize or "int4", group_size or quant.DEFAULT_GROUP
        quant.check(scheme, group)
    built = build_model(ckpt, want)
    source = {"kind": "checkpoint", "name": ckpt.name, "sha256": None, "architecture": ckpt.architecture,
              "dtype": ckpt.dtype, "config_sha256": sha256_file(path / CONFIG)}
    if quantize is not None or group_size is not None:
        layers = quant.quantize_linears(built, scheme, group)
        source["quantize"] = {"scheme": scheme, "group_size": group, "layers": len(layers)}
    spec = None
    if decode is not None:
        kv = kv or KvOptions()
        module, spec = decode_step_module(built.model, decode, batch, chunk, **kv.step_args())
        ep = export_step(module, spec)
        source["decode"] = _decode_source(decode, chunk, spec)
        model = f"{ckpt.name}_decode"
    else:
        length = DEFAULT_SEQ_LEN if seq_len is None else seq_len
        _check_length(built.model, length)
        module = text_forward(built.model, ENCODERS.get(ckpt.architecture, "logits"))
        ids = torch.zeros((batch, length), dtype=torch.int64)
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            try:
                ep = torch.export.export(module, (ids, torch.ones_like(ids)))
            except Exception as exc:  # noqa: BLE001 - torch's exporter raises anything
                raise SourceError(f"{path}: torch.export cannot trace {ckpt.architecture}'s forward pass: "
                                  f"{type(exc).__name__}: {one_line(exc)}") from None
        source["seq_len"] = length
        model = ckpt.name
    imp = _from_exported(ep, model, source, files=built.sources_by_name(module), native=want, decompose=spec is None,
                         extra_convert=(kv or KvOptions()).converters() if spec is not None else None)
    imp.mod = norms_in_float32(imp.mod, imp.const_names, imp.weights, want)
    imp.dtype, imp.batch = want, batch
    if spec is not None:
        if imp.inputs != spec.inputs:
            raise SourceError(f"internal: the decode step of {path} imported with inputs {imp.inputs}")
        imp.state, imp.generation = spec.state_pairs(), spec.generation()
    imp.torch_module = module
    imp.tokenizer = list(ckpt.tokenizer_files)
    return imp


def _from_gguf(path: Path, batch: int, decode: int | None, chunk: int, dtype: str | None,
               tokenizer: str | None, kv: Any = None) -> Imported:
    """A GGUF file's decode step (compiler/ggufsource.py): quantized matrices kept packed, their
    fields read from the file when the bundle is written, dequantized in the matmul kernels; in
    float32, or `dtype` (float16/bfloat16: each weight unpacked in float32 and rounded once, the
    rest computed as a checkpoint of that dtype is). `kv` (decoders.KvOptions): static or paged
    caches, as a checkpoint's; the paged ops' converters join the packed unpack ops' (importops)."""
    import atexit
    import shutil
    import tempfile

    from tvmpipe.compiler.checkpoint import tokenizer_files
    from tvmpipe.compiler.decoders import KvOptions, decode_step_module, export_step
    from tvmpipe.compiler.ggufmodel import build_gguf_model
    from tvmpipe.compiler.ggufsource import open_gguf, write_tokenizer
    from tvmpipe.compiler.precision import norms_in_float32

    if decode is None:
        raise SourceError(f"{path}: a GGUF file compiles as a decode step: pass --decode")
    want = dtype or "float32"
    src = open_gguf(path)
    if tokenizer is not None:
        tok = tokenizer_files(Path(tokenizer))
        if not tok:
            raise SourceError(f"{tokenizer}: no tokenizer.json (--tokenizer names a tokenizer directory)")
    elif not src.has_tokenizer:
        raise SourceError(f"{path}: the file has no tokenizer (tokenizer.ggml.*); pass --tokenizer DIR with the "
                          "model's tokenizer files")
    else:
        tmp = Path(tempfile.mkdtemp(prefix="tvmpipe-gguf-tokenizer-"))
        atexit.register(shutil.rmtree, tmp, True)
        tok = write_tokenizer(src, tmp)
    kv = kv or KvOptions()
    built = build_gguf_model(src, want)
    module, spec = decode_step_module(built.model, decode, batch, chunk, **kv.step_args())
    ep = export_step(module, spec)
    source = {"kind": "gguf", "name": path.name, "sha256": None, "architecture": src.architecture,
              "gguf_types": dict(sorted(src.types.items())), "tensor_bytes": src.tensor_bytes,
              "decode": _decode_source(decode, chunk, spec)}
    imp = _from_exported(ep, f"{src.name}_decode", source, files=built.sources_by_name(module), native=want,
                         decompose=False, extra_convert=kv.converters())
    imp.mod = norms_in_float32(imp.mod, imp.const_names, imp.weights, want)
    imp.dtype, imp.batch = want, batch
    if imp.inputs != spec.inputs:
        raise SourceError(f"internal: the decode step of {path} imported with inputs {imp.inputs}")
    imp.state, imp.generation = spec.state_pairs(), spec.generation()
    imp.torch_module = module
    imp.tokenizer = list(tok)
    return imp


def _check_length(model: Any, length: int) -> None:
    """A forward pass's sequence length: positive, and within learned position embeddings."""
    if length < 1:
        raise SourceError(f"--seq-len must be a positive integer, got {length}")
    cfg = model.config
    limit = getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None)
    if limit is not None and length > limit:
        raise SourceError(f"--seq-len {length} exceeds the model's {limit} positions (config.json "
                          f"{'n_positions' if getattr(cfg, 'n_positions', None) else 'max_position_embeddings'})")


def _from_pt2(path: Path, batch: int | None) -> Imported:
    import torch

    if not path.is_file():
        raise SourceError(f"{path}: no such file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            ep = torch.export.load(str(path))
    except Exception as exc:  # torch raises many types for a bad archive
        raise SourceError(f"{path}: not a readable torch.export program (.pt2): {type(exc).__name__}: {exc}") from None
    imp = _from_exported(ep, _class_name(ep) or path.stem, {"kind": "torch", "name": path.name,
                                                             "sha256": sha256_file(path)})
    if batch is not None and imp.batch != batch:
        raise SourceError(f"{path}: the program was exported with batch {imp.batch}; --batch {batch} needs a "
                          "re-export (torch.export fixes static shapes)")
    return imp


def _declare(imp: Imported, declared: Any, path: Path) -> Any:
    """The generation section of a stateful .pt2 (genspec.declare), from its imported signature."""
    from tvmpipe.compiler.genspec import Tensor, declare

    inputs = [Tensor(n, tuple(s), d) for n, s, d in zip(imp.inputs, imp.input_shapes, imp.input_dtypes)]
    ret = imp.mod["main"].body.body.ty
    fields = list(ret.fields) if hasattr(ret, "fields") else [ret]
    names = list(imp.output_names) + [""] * (len(fields) - len(imp.output_names))
    outputs = [Tensor(n, tuple(int(d) for d in f.shape.values), str(f.dtype)) for n, f in zip(names, fields)]
    return declare(str(path), inputs, outputs, {p.input for p in imp.state}, {p.output for p in imp.state}, declared)


def _class_name(ep: Any) -> str | None:
    """The exported module's class (`MyModel`), from the root entry torch.export records in every
    node's `nn_module_stack`; a file named `model.pt2` should not make every bundle `model`."""
    for node in ep.graph.nodes:
        for fqn, cls in (node.meta.get("nn_module_stack") or {}).values():
            if fqn == "" and isinstance(cls, str) and cls:
                return cls.rsplit(".", 1)[-1]
    return None


def _from_exported(ep: Any, model: str, source: dict[str, Any], files: dict[str, Any] | None = None,
                   native: str | None = None, decompose: bool = True,
                   extra_convert: dict[str, Any] | None = None) -> Imported:
    """Import a torch.export program. `files` (a checkpoint's: {parameter name: CheckpointTensor})
    gives the weights by name instead of the program's own (unwritten) tensors; with them the
    program imports in its own precision (`native`: importops.py), and, with `decompose` False (a
    decode step: compiler/decoders.py's ops, each checked), as traced, without the second trace
    of `run_decompositions()`. Without `files`, a half-precision program is imported in float32
    (_as_float32) and converted back after folding. `extra_convert`: more importer convert-map
    entries (a paged step's ops: compiler/pagedops.py)."""
    import torch
    from tvm.relax.frontend.torch import from_exported_program

    from tvmpipe.compiler import importops, lift

    state: list = []
    sources: dict[str, Any] = {}
    if files is None:
        native = _low_precision(ep)
        if native is not None:
            ep, sources = _as_float32(ep, model)
        convert = None
    else:
        convert = importops.converters(native or "float32", decompose)
    if extra_convert:
        convert = {**(convert or {}), **extra_convert}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            # what from_exported_program does first; in-place buffer updates are listed only after it
            ep = ep.run_decompositions() if decompose else ep
            lifted = lift.lift_mutated_buffers(ep, model) if decompose and lift.mutates(ep) else None
            if lifted is None:
                mod = from_exported_program(ep, keep_params_as_input=True, unwrap_unit_return_tuple=True,
                                            run_ep_decomposition=False, custom_convert_map=convert)
            else:
                mod, state = lift.import_lifted(lifted)
    except SourceError:
        raise
    except Exception as exc:
        raise SourceError(f"TVM cannot import the torch program '{model}': {type(exc).__name__}: {exc}") from None
    by_var = None
    if files is not None:
        kind = torch.export.graph_signature.InputKind.PARAMETER
        params = [s for s in ep.graph_signature.input_specs if s.kind is kind]
        lost = [s.target for s in params if s.target not in files]
        if lost:
            raise SourceError(f"internal: {model}: parameter(s) {', '.join(lost[:3])} have no checkpoint tensor")
        by_var = {s.arg.name: files[s.target] for s in params}
    imp = _bind(mod, model, source, sources, by_var)
    if imp.packed:  # which params hold which packed matrix, in which format (tvmpipe inspect)
        from tvmpipe.compiler.packed import manifest

        imp.source["packed"] = manifest({n: by_var[n] for n in imp.packed})
    imp.native_dtype = native if files is None else None
    imp.state = state
    user = (torch.export.graph_signature.OutputKind.USER_OUTPUT, torch.export.graph_signature.OutputKind.LOSS_OUTPUT)
    imp.output_names = [getattr(s.arg, "name", "") for s in ep.graph_signature.output_specs if s.kind in user]
    return imp


def _low_precision(ep: Any) -> str | None:
    """'bfloat16' or 'float16' when the program's parameters (or inputs) are in that dtype."""
    import torch

    names = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
    dts = [t.dtype for t in ep.state_dict.values()]
    for spec in ep.graph_signature.input_specs:
        if spec.kind is torch.export.graph_signature.InputKind.USER_INPUT:
            for node in ep.graph.find_nodes(op="placeholder", target=spec.target):
                val = node.meta.get("val")
                if val is not None and hasattr(val, "dtype"):
                    dts.append(val.dtype)
    found = [names[d] for d in dts if d in names]
    return found[0] if found else None


def _as_float32(ep: Any, model: str) -> tuple[Any, dict[str, Any]]:
    """A bf16/fp16 program re-exported in float32, without a float32 copy of its weights.

    TVM 0.27's torch importer hard-codes `out_dtype="float32"` for matmul/linear, so a half
    precision program does not import (`R.add(p_bias, lv)`: bfloat16 vs float32). The program is
    unlifted, its low-precision parameters are swapped for `torch.empty` float32 tensors (never
    written, so never resident), its buffers are converted (small), and it is exported again with
    float32 example inputs. The import then binds each parameter's *original* tensor, converted to
    float32 lazily (lazyweights.py); export() converts the module back to the native dtype.
    Returns the float32 program and {Relax parameter name: original tensor}."""
    import torch

    low = (torch.bfloat16, torch.float16)
    try:
        gm = ep.module()
        originals: dict[str, Any] = {}
        for fqn, p in list(gm.named_parameters()):
            if p.dtype in low:
                originals[fqn] = p.detach()
                owner, _, leaf = fqn.rpartition(".")
                setattr(gm.get_submodule(owner) if owner else gm, leaf,
                        torch.nn.Parameter(torch.empty(p.shape, dtype=torch.float32), requires_grad=False))
        for fqn, b in list(gm.named_buffers()):
            if b.dtype in low:
                owner, _, leaf = fqn.rpartition(".")
                (gm.get_submodule(owner) if owner else gm).register_buffer(leaf, b.float())
        args, kwargs = ep.example_inputs or ((), {})
        cast = lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype in low else t  # noqa: E731
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            ep32 = torch.export.export(gm, tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()})
    except Exception as exc:  # noqa: BLE001 - torch's exporter raises anything
        raise SourceError(f"{model}: cannot re-export the half-precision torch program in float32 for TVM's "
                          f"importer: {type(exc).__name__}: {one_line(exc)}") from None
    sources = {}
    for spec in ep32.graph_signature.input_specs:
        if spec.kind is torch.export.graph_signature.InputKind.PARAMETER and spec.target in originals:
            sources[spec.arg.name] = originals[spec.target]
    return ep32, sources


# ---- onnx -----------------------------------------------------------------------------------------

_ONNX_DTYPES = {1: "float32", 10: "float16", 11: "float64", 6: "int32", 7: "int64", 9: "bool"}


def _from_onnx(path: Path, batch: int | None) -> Imported:
    import onnx

    if not path.is_file():
        raise SourceError(f"{path}: no such file")
    try:
        model = onnx.load(str(path))
    except Exception as exc:  # protobuf DecodeError and friends
        raise SourceError(f"{path}: not a readable ONNX model: {type(exc).__name__}: {exc}") from None
    if not model.graph.node:
        raise SourceError(f"{path}: the ONNX graph has no nodes (corrupt or empty model)")
    initializers = {i.name for i in model.graph.initializer}
    shape_dict: dict[str, list[int]] = {}
    dtype_dict: dict[str, str] = {}
    for vi in model.graph.input:
        if vi.name in initializers:
            continue
        ttype = vi.type.tensor_type
        dtype_dict[vi.name] = _ONNX_DTYPES.get(ttype.elem_type, "unsupported")
        if dtype_dict[vi.name] == "unsupported":
            raise SourceError(f"{path}: input '{vi.name}' has unsupported ONNX element type {ttype.elem_type}")
        dims = []
        for k, d in enumerate(ttype.shape.dim):
            if d.HasField("dim_value") and d.dim_value > 0:
                dims.append(d.dim_value)
            elif k == 0:
                dims.append(batch or 1)  # a symbolic leading dim is the batch
            else:
                raise SourceError(f"{path}: input '{vi.name}' dimension {k} is symbolic ('{d.dim_param}'); "
                                  "only the leading (batch) dimension may be")
        shape_dict[vi.name] = dims
    from tvm.relax.frontend.onnx import from_onnx

    from tvmpipe.compiler import onnxprep

    model = onnxprep.fold_constants(model, shape_dict)
    try:
        with onnxprep.locate_failure() as where:
            mod = from_onnx(model, shape_dict=shape_dict, dtype_dict=dtype_dict, keep_params_in_input=True)
    except Exception as exc:
        node = "" if not where.op_type else f" at node '{where.name}' ({where.op_type})" if where.name \
            else f" at an unnamed {where.op_type} node"
        raise SourceError(f"{path}: TVM's ONNX importer fails{node}: {type(exc).__name__}: {one_line(exc)}; "
                          "re-export the model without that construct or simplify that node") from None
    imp = _bind(mod, path.stem, {"kind": "onnx", "name": path.name, "sha256": sha256_file(path)})
    if batch is not None and imp.batch != batch:
        raise SourceError(f"{path}: the model has a static batch of {imp.batch}; --batch {batch} needs a "
                          "model with a symbolic (or matching) leading dimension")
    return imp


# ---- binding --------------------------------------------------------------------------------------

def _bind(mod: Any, model: str, source: dict[str, Any], sources: dict[str, Any] | None = None,
          files: dict[str, Any] | None = None) -> Imported:
    """Bind main's weight parameters as constants we create, so we know each constant's name.

    `sources` (a half-precision program imported in float32) gives, by parameter name, the original
    tensor a parameter's float32 value is computed from; `files` (a checkpoint's), by parameter
    name, the file tensor its value is read from when the bundle is written. A weight read as an
    embedding and as a tied LM head is stored once (tied.py)."""
    from tvmpipe.compiler.tied import share_tied_embeddings

    from tvm import relax

    mod, detached = relax.frontend.detach_params(mod)
    main = mod["main"]
    n_in = int(main.attrs["num_input"]) if main.attrs and "num_input" in main.attrs else len(main.params)
    weights = detached.get("main", [])
    param_vars = list(main.params[n_in:])
    if len(param_vars) != len(weights):
        raise SourceError(f"{model}: {len(param_vars)} weight parameters but {len(weights)} weight values")
    binding: dict[Any, Any] = {}
    const_names = ConstNames()
    lazy = LazyWeights()
    packed: dict[str, Any] = {}
    for var, value in zip(param_vars, weights):
        # big weights are placeholders valued from the source tensor at write time (lazyweights.py)
        if files and var.name in files and getattr(files[var.name], "fmt", None) is not None:
            # a packed weight's field stays a parameter of main until the fuse step binds it
            # (export._bind_packed): every fold before would compute its unpack ops as constants
            packed[var.name] = lazy.bind_file(files[var.name], str(var.ty.dtype))
            const_names.add(packed[var.name], var.name)
            continue
        if files and var.name in files:
            const = lazy.bind_file(files[var.name], str(var.ty.dtype))
        elif sources and var.name in sources:
            const = lazy.bind_float32(sources[var.name])
        else:
            const = lazy.bind(value if hasattr(value, "shape") and hasattr(value, "dtype") else np.asarray(value))
        binding[var] = const
        const_names.add(const, var.name)
    del weights, detached  # the placeholders' recipes hold the source tensors, nothing else does
    if binding:
        mod = relax.transform.BindParams("main", binding)(mod)
    mod = drop_empty_concat_operands(bool_compares_as_int8(te_calls_to_ops(mod)))
    mod = share_tied_embeddings(normalize_negative_indices(mod, const_names))
    inputs = list(mod["main"].params)[:n_in]
    try:
        shapes = [tuple(int(d) for d in v.ty.shape) for v in inputs]
    except TypeError:
        raise SourceError(f"{model}: input shapes {[str(v.ty) for v in inputs]} are symbolic; tvmpipe bundles "
                          "need static shapes (export with fixed sizes)") from None
    dtypes = [str(v.ty.dtype) for v in inputs]
    batch = shapes[0][0] if shapes and shapes[0] else 1
    float_dtypes = [d for d in dtypes if d.startswith("float")]
    return Imported(mod=mod, model=model, source=source, inputs=[v.name for v in inputs], input_shapes=shapes,
                    input_dtypes=dtypes, batch=batch, dtype=float_dtypes[0] if float_dtypes else "float32",
                    const_names=const_names, weights=lazy, packed=packed)
