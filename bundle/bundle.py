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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from tvmpipe.bundle.errors import BundleError, GraphError, Problem, ProblemCollector
from tvmpipe.bundle.graph import Graph
from tvmpipe.bundle.graph_reader import read_graph
from tvmpipe.bundle.manifests import FusedFunction, KernelFunction, Launch, parse_kernels, parse_ops
from tvmpipe.bundle.params import check_param_specs, check_params, generate_params, load_params_file, save_npz
from tvmpipe.bundle.state import GenerationSpec, StatePair, check_state, parse_generation, parse_state, state_buffers
from tvmpipe.bundle.weights import LazyParams, WeightsFile, save_safetensors

FORMAT = "tvmpipe-bundle"
FORMAT_VERSION = 2  # what write_bundle writes; version 1 bundles (no state, npz/.params weights) still load
READ_VERSIONS = (1, 2)
MANIFEST_KEYS = {"format", "version", "model", "source", "target", "batch", "dtype", "tvm_version",
                 "created_by", "params", "inputs", "files", "state", "generation", "tokenizer"}
V2_KEYS = {"state", "generation", "tokenizer"}
PARAMS_KEYS = {"file", "generated", "names", "sha256"}
PARAMS_SUFFIXES = (".safetensors", ".npz", ".params")
# Generated weights are for small shipped examples; a graph asking for more is corrupt or hostile.
MAX_GENERATED_PARAM_BYTES = 4 << 30
REQUIRED_FILES = ("graph.json", "kernels.cu", "kernels.json", "ops.json")
TOKENIZER_DIR = "tokenizer"  # where write_bundle puts a checkpoint's tokenizer files
# An HF-style tokenizer directory, as a checkpoint holds it and generation/text.py reads it: the
# tokenizer.json makes it one; the others are kept where present (the compiler copies these names).
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE, CHAT_TEMPLATE_FILE,
                   GENERATION_CONFIG_FILE)
_UNREADABLE = object()
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
    params_sha256: dict[str, str] | None = None  # per tensor, for a .safetensors weights file
    state: list[StatePair] = field(default_factory=list)
    generation: GenerationSpec | None = None
    tokenizer: str | None = None  # a directory in the bundle holding the source's tokenizer files
    version: int = FORMAT_VERSION

    @property
    def streams_params(self) -> bool:
        """Whether the weights file is read by tensor (safetensors), checked per tensor."""
        return bool(self.params_file) and self.params_file.endswith(".safetensors")

    def to_json(self) -> dict[str, Any]:
        params: dict[str, Any] = {"file": self.params_file,
                                  "generated": None if self.params_seed is None else {"seed": self.params_seed}}
        if self.param_names is not None:
            params["names"] = self.param_names
        if self.params_sha256 is not None:
            params["sha256"] = self.params_sha256
        out = {"format": FORMAT, "version": self.version, "model": self.model, "source": self.source,
               "target": self.target, "batch": self.batch, "dtype": self.dtype, "tvm_version": self.tvm_version,
               "created_by": self.created_by, "params": params, "inputs": self.inputs, "files": self.files}
        if self.version >= 2:
            out["state"] = [p.to_json() for p in self.state]
            out["generation"] = None if self.generation is None else self.generation.to_json()
            if self.tokenizer is not None:
                out["tokenizer"] = self.tokenizer
        return out


@dataclass
class Bundle:
    """A loaded bundle. A bare graph.json loads as a Bundle with `manifest=None` and no kernels/ops;
    loaded with its params file (a legacy deployment's graph.json + .params), `params_path` is set
    and the params tell its graph inputs from its weights."""

    path: Path
    graph: Graph
    manifest: Manifest | None = None
    kernels: dict[str, KernelFunction] = field(default_factory=dict)
    ops: dict[str, FusedFunction] = field(default_factory=dict)
    cuda_source: str = ""
    # Name -> array. A safetensors bundle's is a LazyParams: a tensor is read (and its checksum
    # verified) when it is looked up, so a stage reads only its own weights.
    params: Mapping[str, np.ndarray] = field(default_factory=dict)
    params_path: Path | None = None  # the params file a bare graph.json was loaded with

    @property
    def state(self) -> list[StatePair]:
        return list(self.manifest.state) if self.manifest else []

    @property
    def generation(self) -> GenerationSpec | None:
        return self.manifest.generation if self.manifest else None

    @property
    def tokenizer_dir(self) -> Path | None:
        """The bundle's tokenizer directory (a checkpoint's tokenizer.json, tokenizer_config.json,
        generation_config.json, ... as `tvmpipe compile DIR` copied them), or None."""
        if self.manifest is None or self.manifest.tokenizer is None:
            return None
        return self.path / self.manifest.tokenizer

    def param_nbytes(self, name: str) -> int:
        """A weight's bytes from the graph (no data read)."""
        return self.graph.entry_of(name).nbytes

    @property
    def weight_bytes(self) -> int:
        return sum(self.param_nbytes(n) for n in self.param_names)

    @property
    def state_bytes_per_slot(self) -> int:
        """Bytes of state one sequence slot holds (a micro-batch of `batch` sequences): the KV cache."""
        return sum(self.graph.entry_of(p.input).nbytes for p in self.state)

    @property
    def state_buffers(self) -> dict[str, int]:
        """Per state pair, the buffers a stage keeps for it per slot (state.state_buffers): 1 where
        the step may write the new value over the current one, else 2."""
        return state_buffers(self.graph, self.ops, self.kernels, self.state)

    @property
    def state_held_bytes(self) -> dict[str, int]:
        """Per state pair, what the stage holding it keeps per slot: its bytes x its buffers."""
        buffers = self.state_buffers
        return {p.name: self.graph.entry_of(p.input).nbytes * buffers[p.name] for p in self.state}

    @property
    def state_resident_bytes_per_slot(self) -> int:
        """What stages holding every pair keep per slot, together (state_held_bytes)."""
        return sum(self.state_held_bytes.values())

    @property
    def is_bare(self) -> bool:
        return self.manifest is None

    @property
    def knows_params(self) -> bool:
        """Whether this bundle says which null nodes are params (weights) and which are graph inputs."""
        return self.manifest is not None or self.params_path is not None

    @property
    def name(self) -> str:
        return self.manifest.model if self.manifest else self.path.stem

    @property
    def input_names(self) -> list[str]:
        """Null nodes fed per run. Unknown for a bare graph.json without params: then every arg node is listed."""
        if self.manifest is None:
            return [n for n in self._null_names() if n not in self.params]
        return list(self.manifest.inputs)

    @property
    def param_names(self) -> list[str]:
        if self.manifest is None:
            return [n for n in self._null_names() if n in self.params]
        return _param_names(self.graph, self.manifest)

    def _null_names(self) -> list[str]:
        return [self.graph.nodes[i].name for i in self.graph.null_nodes]

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

def load_bundle(path: str | Path, verify_checksums: bool = True, params: str | Path | None = None,
                partial_weights: bool = False) -> Bundle:
    """Load a bundle directory, or a bare graph.json file, cross-checking everything.

    Every file that can be read is parsed even when another is broken, so one BundleError lists
    all the problems; only the cross-checks that need a file wait for it to be readable.
    `params` is a bare graph.json's params file (.params as TVM <= 0.19 wrote it, or .npz): its
    names are the weights, the other null nodes the graph inputs. A bundle names its own.
    `partial_weights`: the safetensors file holds only some of the params (a slice shipped to one
    node, cluster/control/shipping.py); those it holds are checked, the others fail when looked up.
    """
    path = Path(path)
    if path.is_file() and path.suffix == ".json" and path.name != "bundle.json":
        graph = read_graph(path)
        if params is None:
            return Bundle(path=path, graph=graph)
        return Bundle(path=path, graph=graph, params=load_graph_params(graph, Path(params)), params_path=Path(params))
    if path.is_file() and path.name == "bundle.json":
        path = path.parent
    if not path.is_dir():
        raise BundleError([Problem(str(path), "", "", "no such bundle directory or graph.json file")])
    if params is not None:
        raise BundleError([Problem(str(params), "", "", f"a params file goes with a bare graph.json; the bundle "
                                                        f"{path} names its own params in bundle.json")])
    problems: list[Problem] = []
    manifest = _read_manifest(path / "bundle.json", problems)
    if manifest is None:
        raise BundleError(problems)
    _check_files(path, manifest, verify_checksums, problems)

    graph = None
    if (path / "graph.json").is_file():
        try:
            graph = read_graph(path / "graph.json")
        except GraphError as exc:
            problems.extend(exc.problems)
    cuda_source = None
    if (path / "kernels.cu").is_file():
        cuda_source = (path / "kernels.cu").read_text(encoding="utf-8", errors="replace")
    kernels = _parse_file(path / "kernels.json", parse_kernels, problems)
    ops = _parse_file(path / "ops.json", parse_ops, problems)
    params = {} if graph is None else _load_params(path, graph, manifest, problems, partial_weights)
    _cross_check(path, graph, kernels, ops, cuda_source, problems)
    if graph is not None and (manifest.state or manifest.generation):
        check_state(graph, manifest.inputs, manifest.state, manifest.generation, str(path / "bundle.json"), problems)
    if problems:
        raise BundleError(problems)
    return Bundle(path=path, graph=graph, manifest=manifest, kernels=kernels, ops=ops,
                  cuda_source=cuda_source, params=params)


def load_graph_params(graph: Graph, file: Path) -> dict[str, np.ndarray]:
    """A bare graph.json's params file, read and checked against the graph: every array names a
    null node and has its shape and dtype. Null nodes it leaves out are the graph inputs."""
    params = load_params_file(file)
    problems = check_params(graph, params, [n for n in params if graph.is_null_node(n)], str(file))
    if problems:
        raise BundleError(problems)
    return params


def _check_files(path: Path, m: Manifest, verify_checksums: bool, problems: list[Problem]) -> None:
    """Required files (and the params file) exist, and every bundle file has a matching sha256."""
    needed = REQUIRED_FILES + ((m.params_file,) if m.params_file else ())
    for name in needed:
        if not (path / name).is_file():
            problems.append(Problem(str(path / name), "", "", "missing required bundle file"))
        elif name == m.params_file and m.streams_params:
            if m.params_sha256 is None:  # checked per tensor, when a stage reads it: never whole in every process
                problems.append(Problem(str(path / "bundle.json"), "", "params.sha256",
                                        "a .safetensors weights file needs a sha256 per tensor"))
        elif name not in m.files:
            problems.append(Problem(str(path / "bundle.json"), "", f"files.{name}", "no sha256 for this bundle file"))
    if m.tokenizer is not None and not (path / m.tokenizer).is_dir():
        problems.append(Problem(str(path / m.tokenizer), "", "", "the tokenizer directory bundle.json names is missing"))
    elif m.tokenizer is not None and not (path / m.tokenizer / TOKENIZER_FILE).is_file():
        problems.append(Problem(str(path / m.tokenizer / TOKENIZER_FILE), "", "",
                                "missing: the tokenizer directory bundle.json names holds no tokenizer.json"))
    for name, want in m.files.items():
        f = path / name
        if not f.is_file():
            if name not in needed:  # a missing needed file is reported once, above
                problems.append(Problem(str(f), "", "", "listed in bundle.json files but missing"))
        elif verify_checksums and sha256_file(f) != want:
            problems.append(Problem(str(f), "", "", "sha256 differs from bundle.json: the file changed after export"))


def _parse_file(path: Path, parse: Callable[[Any, list[Problem], str], dict], problems: list[Problem]) -> dict | None:
    """kernels.json / ops.json parsed, or None when the file is missing or unreadable (reported elsewhere)."""
    if not path.is_file():
        return None
    obj = _read_json(path, problems)
    return None if obj is _UNREADABLE else parse(obj, problems, str(path))


def _read_json(path: Path, problems: list[Problem]) -> Any:
    """The decoded file, or _UNREADABLE (reported): JSON `null` is a value the parsers must judge."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad UTF-8, bad JSON, huge ints
        problems.append(Problem(str(path), "", "", f"not readable JSON: {exc}"))
        return _UNREADABLE


def _read_manifest(path: Path, problems: list[Problem]) -> Manifest | None:
    f = str(path)
    if not path.is_file():
        problems.append(Problem(f, "", "", "missing: not a tvmpipe bundle (no bundle.json)"))
        return None
    obj = _read_json(path, problems)
    if obj is _UNREADABLE:
        return None
    if not isinstance(obj, dict):
        problems.append(Problem(f, "", "", "top level must be a JSON object"))
        return None
    # Unknown keys and a wrong format/version are reported, but the other files are still checked.
    collector = ProblemCollector(f, problems)
    collector.unknown_keys(obj, MANIFEST_KEYS, "")
    if obj.get("format") != FORMAT:
        problems.append(Problem(f, "", "format", f"must be {FORMAT!r}, got {obj.get('format')!r}"))
    version = obj.get("version")
    if version not in READ_VERSIONS:
        problems.append(Problem(f, "", "version", f"unsupported format version {version!r} "
                                                  f"(this tvmpipe reads {', '.join(map(str, READ_VERSIONS))})"))
    elif version == 1:
        for k in sorted(V2_KEYS & set(obj)):
            problems.append(Problem(f, "", k, "needs format version 2"))
    before = len(problems)  # problems from here on leave no usable manifest
    for k, typ in (("model", str), ("source", dict), ("target", dict), ("dtype", str), ("inputs", list), ("files", dict), ("params", dict)):
        if not isinstance(obj.get(k), typ):
            problems.append(Problem(f, "", k, f"missing or not a {typ.__name__}"))
    if not _is_count(obj.get("batch")) or obj["batch"] < 1:
        problems.append(Problem(f, "", "batch", f"must be a positive integer, got {obj.get('batch')!r}"))
    if len(problems) > before:
        return None
    tokenizer = obj.get("tokenizer")
    if tokenizer is not None and not _plain_file_name(tokenizer):
        problems.append(Problem(f, "", "tokenizer", f"must be null or a directory name inside the bundle, got {tokenizer!r}"))
        tokenizer = None
    files = {}  # a bad entry is reported and left out: the other checksums still count
    for name, digest in obj["files"].items():
        if _bundle_file_name(name, tokenizer) and isinstance(digest, str):
            files[name] = digest
        else:
            problems.append(Problem(f, "", f"files.{name}", "must map a file name inside the bundle (or its tokenizer "
                                                            "directory) to its sha256 hex digest"))
    p = obj["params"]
    collector.unknown_keys(p, PARAMS_KEYS, "", prefix="params.")
    before = len(problems)
    if not all(isinstance(n, str) for n in obj["inputs"]):
        problems.append(Problem(f, "", "inputs", f"must be a list of node names, got {obj['inputs']!r}"))
    pfile, names, gen, sums = p.get("file"), p.get("names"), p.get("generated"), p.get("sha256")
    if pfile is not None and not (_plain_file_name(pfile) and pfile.endswith(PARAMS_SUFFIXES)):
        problems.append(Problem(f, "", "params.file", f"must be null or a .safetensors / .npz / .params file name "
                                                      f"inside the bundle, got {pfile!r}"))
    if sums is not None and not (isinstance(sums, dict) and all(isinstance(v, str) for v in sums.values())):
        problems.append(Problem(f, "", "params.sha256", "must map tensor names to sha256 hex digests"))
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        problems.append(Problem(f, "", "params.names", f"must be null or a list of node names, got {names!r}"))
    if gen is not None and not (isinstance(gen, dict) and set(gen) == {"seed"} and _is_count(gen["seed"])):
        problems.append(Problem(f, "", "params.generated", 'must be null or {"seed": <non-negative int>}'))
    if pfile is None and gen is None:
        problems.append(Problem(f, "", "params", "neither a params file nor generated weights"))
    state = parse_state(obj.get("state"), f, problems)
    generation = parse_generation(obj.get("generation"), f, problems)
    if len(problems) > before:
        return None
    return Manifest(model=obj["model"], source=obj["source"], target=obj["target"], batch=obj["batch"],
                    dtype=obj["dtype"], inputs=obj["inputs"], params_file=pfile,
                    params_seed=None if gen is None else gen["seed"], param_names=names,
                    tvm_version=obj.get("tvm_version"), created_by=obj.get("created_by", ""), files=files,
                    params_sha256=sums, state=state, generation=generation, tokenizer=tokenizer,
                    version=version if version in READ_VERSIONS else FORMAT_VERSION)


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _plain_file_name(name: Any) -> bool:
    """A name directly inside the bundle directory: bundle.json must not point outside it."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


def _bundle_file_name(name: Any, tokenizer: str | None) -> bool:
    """A file of the bundle: directly inside it, or directly inside its tokenizer directory."""
    if _plain_file_name(name):
        return True
    if tokenizer is None or not isinstance(name, str):
        return False
    head, _, rest = name.partition("/")
    return head == tokenizer and _plain_file_name(rest)


def _load_params(path: Path, graph: Graph, m: Manifest, problems: list[Problem],
                 partial: bool = False) -> dict[str, np.ndarray]:
    mfile = str(path / "bundle.json")
    unknown = [n for n in m.inputs + (m.param_names or []) if not graph.is_null_node(n)]
    for n in unknown:
        problems.append(Problem(mfile, "", "inputs/params.names", f"'{n}' is not a null node of graph.json"))
    if unknown:
        return {}
    names = _param_names(graph, m)
    fed = set(m.inputs) | set(names)
    for n in sorted(set(m.inputs) & set(names)):
        problems.append(Problem(mfile, "", "inputs/params.names", f"'{n}' is listed both as a graph input and as a param"))
    for i in graph.null_nodes:  # only reachable with params.names: by default every other null node is a param
        if graph.nodes[i].name not in fed:
            problems.append(Problem(mfile, "", "inputs/params.names",
                                    f"{graph.nodes[i].label()} is neither a graph input nor a param: nothing would feed it"))
    if m.params_file is None:
        need = sum(graph.entry_of(n).nbytes for n in names)
        if need > MAX_GENERATED_PARAM_BYTES:
            problems.append(Problem(mfile, "", "params.generated",
                                    f"generating weights would allocate {need} bytes, over the "
                                    f"{MAX_GENERATED_PARAM_BYTES}-byte limit: ship a params file instead"))
            return {}
        return generate_params(graph, names, m.params_seed or 0)
    if not (path / m.params_file).is_file():
        return {}  # reported by _check_files
    if m.streams_params:
        return _open_weights(path / m.params_file, graph, names, m.params_sha256 or {}, problems, partial)
    try:
        params = load_params_file(path / m.params_file)
    except BundleError as exc:
        problems.extend(exc.problems)
        return {}
    problems.extend(check_params(graph, params, names, str(path / m.params_file)))
    return params


def _open_weights(file: Path, graph: Graph, names: list[str], sums: dict[str, str],
                  problems: list[Problem], partial: bool = False) -> Mapping[str, np.ndarray]:
    """A safetensors weights file opened, its header checked against the graph (names, shapes,
    dtypes, offsets, size) and against bundle.json's checksums; no tensor data is read here."""
    try:
        wf = WeightsFile(file, sums)
    except BundleError as exc:
        problems.extend(exc.problems)
        return {}
    specs = {n: (t.dtype, t.shape) for n, t in wf.tensors.items()}
    if partial:
        wf.missing_hint = " (a slice with only the weights of the stages on this node)"
    problems.extend(check_param_specs(graph, specs, [n for n in names if n in specs] if partial else names, str(file)))
    for n in names:
        if n in specs and n not in sums:
            problems.append(Problem(str(file.parent / "bundle.json"), "", f"params.sha256.{n}", "no checksum for this tensor"))
    for n in sums:
        if n not in specs and not partial:
            problems.append(Problem(str(file.parent / "bundle.json"), "", f"params.sha256.{n}", "names no tensor of the weights file"))
    return LazyParams(wf, names)


def _cross_check(path: Path, graph: Graph | None, kernels: dict[str, KernelFunction] | None,
                 ops: dict[str, FusedFunction] | None, cuda_source: str | None, problems: list[Problem]) -> None:
    """Agreement between files; each check runs when the files it needs were readable (None: not)."""
    kfile, ofile, gfile = str(path / "kernels.json"), str(path / "ops.json"), str(path / "graph.json")
    if kernels is not None and cuda_source is not None:
        defined = defined_kernels(cuda_source)
        for fn, kf in kernels.items():
            for i, l in enumerate(kf.launches):
                if l.kernel not in defined:
                    problems.append(Problem(kfile, f"function '{fn}'", f"launches[{i}].kernel",
                                            f"kernel '{l.kernel}' is not defined in kernels.cu"))
    if graph is None:
        return
    for n in graph.nodes:
        if not n.launches_kernels:
            continue
        fn = n.func_name
        n_args = len(n.inputs) + n.num_outputs
        if kernels is not None and fn not in kernels:
            problems.append(Problem(gfile, n.label(), "attrs.func_name", f"function '{fn}' has no launch list in kernels.json"))
        elif kernels is not None:
            for i, l in enumerate(kernels[fn].launches):
                for k, a in enumerate(l.args):
                    if a.kind == "arg" and a.index >= n_args:
                        problems.append(Problem(kfile, f"function '{fn}'", f"launches[{i}].args[{k}]",
                                                f"argument {a.index} is out of range: {n.label()} passes {n_args} arguments"))
        if ops is not None and fn not in ops:
            problems.append(Problem(gfile, n.label(), "attrs.func_name", f"function '{fn}' has no op list in ops.json"))
        elif ops is not None and (ops[fn].num_inputs, ops[fn].num_outputs) != (len(n.inputs), n.num_outputs):
            problems.append(Problem(ofile, f"function '{fn}'", "num_inputs/num_outputs",
                                    f"says {ops[fn].num_inputs} in / {ops[fn].num_outputs} out but {n.label()} has "
                                    f"{len(n.inputs)} in / {n.num_outputs} out"))
    used = {n.func_name for n in graph.nodes if n.launches_kernels}
    for table, file in ((kernels, kfile), (ops, ofile)):
        for fn in table or {}:
            if fn not in used:
                problems.append(Problem(file, f"function '{fn}'", "", "not called by any graph.json node"))


# ---- writing -------------------------------------------------------------------------------------

def write_bundle(out_dir: str | Path, *, model: str, source: dict, target: dict, batch: int, dtype: str,
                 graph: dict, kernels: dict, ops: dict, cuda_source: str, inputs: list[str],
                 params: Mapping[str, np.ndarray] | None, params_seed: int | None = None,
                 tvm_version: str | None = None, overwrite: bool = False,
                 weights: tuple[Path, dict[str, str]] | None = None, params_format: str = "safetensors",
                 state: list[StatePair] | None = None, generation: GenerationSpec | None = None,
                 tokenizer: list[Path] | None = None) -> Path:
    """Write a bundle atomically: build and validate it in a temporary sibling, then rename.

    Weights come as `params` (a dict, written here as safetensors, or .npz with
    `params_format="npz"`), or as `weights`: a safetensors file the caller already streamed tensor
    by tensor (WeightsWriter) and its per-tensor checksums; it is moved into the bundle, not copied.
    `tokenizer` files (a checkpoint's) are copied into the bundle's TOKENIZER_DIR, checksummed in
    `files` like the others."""
    from tvmpipe import __version__

    out = Path(out_dir).resolve()
    if out.exists() and not overwrite:
        raise BundleError([Problem(str(out), "", "", "already exists (pass overwrite=True / --force to replace it)")])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a bundle is shared with stage actors and other users
    try:
        (tmp / "graph.json").write_text(json.dumps(graph, indent=1))
        (tmp / "kernels.json").write_text(json.dumps(kernels, indent=1))
        (tmp / "ops.json").write_text(json.dumps(ops, indent=1))
        (tmp / "kernels.cu").write_text(cuda_source)
        params_file, sums = None, None
        if weights is not None:
            params_file = "params.safetensors"
            shutil.move(str(weights[0]), tmp / params_file)
            sums = dict(weights[1])
        elif params is not None and params_format == "npz":
            params_file = "params.npz"
            save_npz(tmp / params_file, dict(params))
        elif params is not None:
            params_file = "params.safetensors"
            sums = save_safetensors(tmp / params_file, params)
        files = {f.name: sha256_file(f) for f in sorted(tmp.iterdir())
                 if f.is_file() and (f.name != params_file or sums is None)}
        if tokenizer:
            (tmp / TOKENIZER_DIR).mkdir()
            for src in tokenizer:
                shutil.copyfile(src, tmp / TOKENIZER_DIR / Path(src).name)
                files[f"{TOKENIZER_DIR}/{Path(src).name}"] = sha256_file(tmp / TOKENIZER_DIR / Path(src).name)
        manifest = Manifest(model=model, source=source, target=target, batch=batch, dtype=dtype, inputs=list(inputs),
                            params_file=params_file,
                            params_seed=params_seed if params is None and weights is None else None,
                            tvm_version=tvm_version, created_by=f"tvmpipe {__version__}", files=files,
                            params_sha256=sums, state=list(state or []), generation=generation,
                            tokenizer=TOKENIZER_DIR if tokenizer else None)
        (tmp / "bundle.json").write_text(json.dumps(manifest.to_json(), indent=1))
        try:
            load_bundle(tmp)  # never rename an invalid bundle into place
        except BundleError as exc:  # name the files the caller asked for, not the deleted temp dir
            raise BundleError([replace(p, file=p.file.replace(str(tmp), str(out), 1)) for p in exc.problems]) from None
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
