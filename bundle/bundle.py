"""A bundle directory as one checked object: manifest, graph, launch lists, op programs, params.

Loading cross-checks the files against each other and reports every problem at once; writing goes
through a temporary sibling directory that is validated before it is renamed into place, so a
crash or a bad export never leaves a half-written bundle where users look for one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tvmpipe.bundle.errors import BundleError, GraphError, Problem
from tvmpipe.bundle.graph import Graph, parse_graph_text
from tvmpipe.bundle.manifests import FusedFunction, KernelFunction, Launch, parse_kernels, parse_ops
from tvmpipe.bundle.params import check_params, generate_params, load_params_file, save_npz

FORMAT = "tvmpipe-bundle"
FORMAT_VERSION = 1
MANIFEST_KEYS = {"format", "version", "model", "source", "target", "batch", "dtype", "tvm_version",
                 "created_by", "params", "inputs", "files"}
PARAMS_KEYS = {"file", "generated", "names"}
_KERNEL_DEF = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(")


def defined_kernels(cuda_source: str) -> set[str]:
    """Kernel symbols a .cu file defines (`__global__ void [__launch_bounds__(n)] name(`)."""
    return set(_KERNEL_DEF.findall(cuda_source))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class Manifest:
    model: str
    source: dict[str, Any]
    target: dict[str, Any]
    batch: int
    dtype: str
    inputs: list[str]
    params_file: str | None = "params.npz"
    params_seed: int | None = None
    param_names: list[str] | None = None
    tvm_version: str | None = None
    created_by: str = "tvmpipe"
    files: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        params: dict[str, Any] = {"file": self.params_file,
                                  "generated": None if self.params_seed is None else {"seed": self.params_seed}}
        if self.param_names is not None:
            params["names"] = self.param_names
        return {"format": FORMAT, "version": FORMAT_VERSION, "model": self.model, "source": self.source,
                "target": self.target, "batch": self.batch, "dtype": self.dtype, "tvm_version": self.tvm_version,
                "created_by": self.created_by, "params": params, "inputs": self.inputs, "files": self.files}


@dataclass
class Bundle:
    """A loaded bundle. A bare graph.json loads as a Bundle with `manifest=None` and no kernels/ops."""

    path: Path
    graph: Graph
    manifest: Manifest | None = None
    kernels: dict[str, KernelFunction] = field(default_factory=dict)
    ops: dict[str, FusedFunction] = field(default_factory=dict)
    cuda_source: str = ""
    params: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def is_bare(self) -> bool:
        return self.manifest is None

    @property
    def name(self) -> str:
        return self.manifest.model if self.manifest else self.path.stem

    @property
    def input_names(self) -> list[str]:
        """Null nodes fed per run. Unknown for a bare graph.json: then every arg node is listed."""
        if self.manifest is None:
            return [self.graph.nodes[i].name for i in self.graph.null_nodes]
        return list(self.manifest.inputs)

    @property
    def param_names(self) -> list[str]:
        if self.manifest is None:
            return []
        return _param_names(self.graph, self.manifest)

    def input_nodes(self) -> list[int]:
        return [self.graph.node_index[n] for n in self.input_names]

    def launches_of(self, nid: int) -> list[Launch]:
        fn = self.graph.nodes[nid].func_name
        return self.kernels[fn].launches if fn in self.kernels else []

    def ops_of(self, nid: int) -> FusedFunction | None:
        return self.ops.get(self.graph.nodes[nid].func_name or "")


def _param_names(graph: Graph, m: Manifest) -> list[str]:
    if m.param_names is not None:
        return list(m.param_names)
    inputs = set(m.inputs)
    return [graph.nodes[i].name for i in graph.null_nodes if graph.nodes[i].name not in inputs]


# ---- loading -------------------------------------------------------------------------------------

def load_bundle(path: str | Path, verify_checksums: bool = True) -> Bundle:
    """Load a bundle directory, or a bare graph.json file, cross-checking everything."""
    path = Path(path)
    if path.is_file() and path.suffix == ".json" and path.name != "bundle.json":
        return Bundle(path=path, graph=_read_graph(path))
    if path.is_file() and path.name == "bundle.json":
        path = path.parent
    if not path.is_dir():
        raise BundleError([Problem(str(path), "", "", "no such bundle directory or graph.json file")])
    problems: list[Problem] = []
    manifest = _read_manifest(path / "bundle.json", problems)
    if manifest is None:
        raise BundleError(problems)
    for name, want in manifest.files.items():
        f = path / name
        if not f.is_file():
            problems.append(Problem(str(f), "", "", "listed in bundle.json files but missing"))
        elif verify_checksums and sha256_file(f) != want:
            problems.append(Problem(str(f), "", "", "sha256 differs from bundle.json: the file changed after export"))
    for required in ("graph.json", "kernels.cu", "kernels.json", "ops.json"):
        if not (path / required).is_file():
            problems.append(Problem(str(path / required), "", "", "missing required bundle file"))
    if problems:
        raise BundleError(problems)

    try:
        graph = _read_graph(path / "graph.json")
    except GraphError as exc:
        raise BundleError(exc.problems) from None
    cuda_source = (path / "kernels.cu").read_text(encoding="utf-8", errors="replace")
    kernels = parse_kernels(_read_json(path / "kernels.json", problems), problems, str(path / "kernels.json"))
    ops = parse_ops(_read_json(path / "ops.json", problems), problems, str(path / "ops.json"))
    params = _load_params(path, graph, manifest, problems)
    _cross_check(path, graph, manifest, kernels, ops, cuda_source, problems)
    if problems:
        raise BundleError(problems)
    return Bundle(path=path, graph=graph, manifest=manifest, kernels=kernels, ops=ops,
                  cuda_source=cuda_source, params=params)


def _read_graph(path: Path) -> Graph:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise GraphError([Problem(str(path), "", "", f"cannot read: {exc}")]) from None
    return parse_graph_text(text, source=str(path))


def _read_json(path: Path, problems: list[Problem]) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        problems.append(Problem(str(path), "", "", f"not readable JSON: {exc}"))
        return None


def _read_manifest(path: Path, problems: list[Problem]) -> Manifest | None:
    f = str(path)
    if not path.is_file():
        problems.append(Problem(f, "", "", "missing: not a tvmpipe bundle (no bundle.json)"))
        return None
    obj = _read_json(path, problems)
    if obj is None:
        return None
    if not isinstance(obj, dict):
        problems.append(Problem(f, "", "", "top level must be a JSON object"))
        return None
    before = len(problems)
    for k in obj:
        if k not in MANIFEST_KEYS:
            problems.append(Problem(f, "", k, f"unknown key (expected one of {sorted(MANIFEST_KEYS)})"))
    if obj.get("format") != FORMAT:
        problems.append(Problem(f, "", "format", f"must be {FORMAT!r}, got {obj.get('format')!r}"))
    if obj.get("version") != FORMAT_VERSION:
        problems.append(Problem(f, "", "version", f"unsupported format version {obj.get('version')!r} (this tvmpipe reads {FORMAT_VERSION})"))
    for k, typ in (("model", str), ("source", dict), ("target", dict), ("dtype", str), ("inputs", list), ("files", dict), ("params", dict)):
        if not isinstance(obj.get(k), typ):
            problems.append(Problem(f, "", k, f"missing or not a {typ.__name__}"))
    if not isinstance(obj.get("batch"), int) or obj.get("batch", 0) < 1:
        problems.append(Problem(f, "", "batch", f"must be a positive integer, got {obj.get('batch')!r}"))
    if len(problems) > before:
        return None
    p = obj["params"]
    for k in p:
        if k not in PARAMS_KEYS:
            problems.append(Problem(f, "", f"params.{k}", f"unknown key (expected one of {sorted(PARAMS_KEYS)})"))
    gen = p.get("generated")
    seed = None
    if gen is not None:
        if not (isinstance(gen, dict) and set(gen) == {"seed"} and isinstance(gen["seed"], int)):
            problems.append(Problem(f, "", "params.generated", 'must be null or {"seed": <int>}'))
        else:
            seed = gen["seed"]
    if p.get("file") is None and seed is None:
        problems.append(Problem(f, "", "params", "neither a params file nor generated weights"))
    return Manifest(model=obj["model"], source=obj["source"], target=obj["target"], batch=obj["batch"],
                    dtype=obj["dtype"], inputs=obj["inputs"], params_file=p.get("file"), params_seed=seed,
                    param_names=p.get("names"), tvm_version=obj.get("tvm_version"),
                    created_by=obj.get("created_by", ""), files=obj["files"])


def _load_params(path: Path, graph: Graph, m: Manifest, problems: list[Problem]) -> dict[str, np.ndarray]:
    unknown = [n for n in m.inputs + (m.param_names or []) if n not in graph.node_index or graph.nodes[graph.node_index[n]].is_op]
    for n in unknown:
        problems.append(Problem(str(path / "bundle.json"), "", "inputs/params.names", f"'{n}' is not a null node of graph.json"))
    if unknown:
        return {}
    names = _param_names(graph, m)
    if m.params_file is None:
        return generate_params(graph, names, m.params_seed or 0)
    try:
        params = load_params_file(path / m.params_file)
    except BundleError as exc:
        problems.extend(exc.problems)
        return {}
    problems.extend(check_params(graph, params, names, str(path / m.params_file)))
    return params


def _cross_check(path: Path, graph: Graph, m: Manifest, kernels: dict[str, KernelFunction],
                 ops: dict[str, FusedFunction], cuda_source: str, problems: list[Problem]) -> None:
    kfile, ofile, gfile = str(path / "kernels.json"), str(path / "ops.json"), str(path / "graph.json")
    defined = defined_kernels(cuda_source)
    used: set[str] = set()
    for n in graph.nodes:
        if not n.launches_kernels:
            continue
        fn = n.func_name
        used.add(fn)
        n_args = len(n.inputs) + n.num_outputs
        if fn not in kernels:
            problems.append(Problem(gfile, n.label(), "attrs.func_name", f"function '{fn}' has no launch list in kernels.json"))
        else:
            for i, l in enumerate(kernels[fn].launches):
                for k, a in enumerate(l.args):
                    if a.kind == "arg" and a.index >= n_args:
                        problems.append(Problem(kfile, f"function '{fn}'", f"launches[{i}].args[{k}]",
                                                f"argument {a.index} is out of range: {n.label()} passes {n_args} arguments"))
        if fn not in ops:
            problems.append(Problem(gfile, n.label(), "attrs.func_name", f"function '{fn}' has no op list in ops.json"))
        elif (ops[fn].num_inputs, ops[fn].num_outputs) != (len(n.inputs), n.num_outputs):
            problems.append(Problem(ofile, f"function '{fn}'", "num_inputs/num_outputs",
                                    f"says {ops[fn].num_inputs} in / {ops[fn].num_outputs} out but {n.label()} has "
                                    f"{len(n.inputs)} in / {n.num_outputs} out"))
    for fn, kf in kernels.items():
        if fn not in used:
            problems.append(Problem(kfile, f"function '{fn}'", "", "not called by any graph.json node"))
        for i, l in enumerate(kf.launches):
            if l.kernel not in defined:
                problems.append(Problem(kfile, f"function '{fn}'", f"launches[{i}].kernel",
                                        f"kernel '{l.kernel}' is not defined in kernels.cu"))
    for fn in ops:
        if fn not in used:
            problems.append(Problem(ofile, f"function '{fn}'", "", "not called by any graph.json node"))


# ---- writing -------------------------------------------------------------------------------------

def write_bundle(out_dir: str | Path, *, model: str, source: dict, target: dict, batch: int, dtype: str,
                 graph: dict, kernels: dict, ops: dict, cuda_source: str, inputs: list[str],
                 params: dict[str, np.ndarray] | None, params_seed: int | None = None,
                 tvm_version: str | None = None, overwrite: bool = False) -> Path:
    """Write a bundle atomically: build and validate it in a temporary sibling, then rename."""
    from tvmpipe import __version__

    out = Path(out_dir).resolve()
    if out.exists() and not overwrite:
        raise BundleError([Problem(str(out), "", "", "already exists (pass overwrite=True / --force to replace it)")])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        (tmp / "graph.json").write_text(json.dumps(graph, indent=1))
        (tmp / "kernels.json").write_text(json.dumps(kernels, indent=1))
        (tmp / "ops.json").write_text(json.dumps(ops, indent=1))
        (tmp / "kernels.cu").write_text(cuda_source)
        params_file = None
        if params is not None:
            params_file = "params.npz"
            save_npz(tmp / params_file, params)
        files = {f.name: sha256_file(f) for f in sorted(tmp.iterdir())}
        manifest = Manifest(model=model, source=source, target=target, batch=batch, dtype=dtype, inputs=list(inputs),
                            params_file=params_file, params_seed=params_seed if params is None else None,
                            tvm_version=tvm_version, created_by=f"tvmpipe {__version__}", files=files)
        (tmp / "bundle.json").write_text(json.dumps(manifest.to_json(), indent=1))
        load_bundle(tmp)  # never rename an invalid bundle into place
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
