"""What the fake driver knows about a module: read from the fake cubin (bin/nvcc) only.

* each kernel's parameter table, static shared memory and `__launch_bounds__`, parsed from the CUDA
  source's `extern "C" __global__` definitions (independent of kernels.json, which the backend packs
  from);
* what each kernel computes: the source is looked up among the bundles named in
  $FAKE_PYCUDA_BUNDLES (colon-separated directories), and the last launch of a fused function runs
  the reference backend's implementation of that function (reference_ops.run_function) on the
  device bytes its pointer operands address. So a pipeline on the fake device computes the same
  numbers as the reference backend, and a wrong pointer, size or copy shows up as wrong numbers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass, field

MAGIC = b"FAKECUBIN1\n"
SCALAR = {"int": 4, "int32_t": 4, "unsigned": 4, "uint32_t": 4, "int64_t": 8, "long": 8, "uint64_t": 8,
          "float": 4, "double": 8, "half": 2, "bool": 1, "char": 1, "signed char": 1, "short": 2}
ELEM = {"float": 4, "half": 2, "int": 4, "double": 8, "int64_t": 8, "char": 1, "signed char": 1, "uchar": 1,
        "float4": 16, "float2": 8, "half2": 4, "int4": 16, "uint": 4, "bool": 1, "short": 2}
DEF = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\((\d+)\) )?(\w+)\(([^)]*)\)\s*\{')
SHARED = re.compile(r"__shared__ (?:alignas\((\d+)\) )?([\w ]+?) \w+\[(\d+)\];")


@dataclass
class KernelInfo:
    name: str
    params: list[tuple[int, int, bool]]  # (offset, size, is_pointer)
    argbytes: int
    max_threads: int
    static_smem: int


@dataclass
class ModuleInfo:
    arch: str
    source: str
    kernels: dict[str, KernelInfo]
    emulation: "Emulation | None" = None


def read_fake_cubin(data: bytes) -> ModuleInfo:
    if not bytes(data).startswith(MAGIC):
        raise ValueError("not a fake cubin")
    doc = json.loads(bytes(data)[len(MAGIC):])
    src = doc["source"]
    kernels = {}
    defs = list(DEF.finditer(src))
    for i, m in enumerate(defs):
        body = src[m.end():defs[i + 1].start() if i + 1 < len(defs) else len(src)]
        params, off = [], 0
        for p in [p.strip() for p in m.group(3).split(",") if p.strip()]:
            ptr = "*" in p
            size = 8 if ptr else SCALAR[" ".join(p.split()[:-1]).replace("const ", "")]
            off = (off + size - 1) // size * size
            params.append((off, size, ptr))
            off += size
        smem = 0
        for s in SHARED.finditer(body):
            align = int(s.group(1) or 1)
            smem = (smem + align - 1) // align * align + ELEM.get(s.group(2).strip(), 4) * int(s.group(3))
        kernels[m.group(2)] = KernelInfo(m.group(2), params, off, int(m.group(1) or 1024), smem)
    return ModuleInfo(doc["arch"], src, kernels, Emulation.find(src))


@dataclass
class FuncEmu:
    name: str
    fn: object  # FusedFunction (ops.json)
    launches: list  # kernels.json launches
    arg_specs: list[tuple[tuple[int, ...], str]]  # inputs then outputs: (shape, dtype)
    n_inputs: int


@dataclass
class Emulation:
    """Kernel symbol -> (function, launch index) of one bundle, and per-stream progress."""

    by_kernel: dict[str, tuple[FuncEmu, int]] = field(default_factory=dict)

    _cache = {}

    @classmethod
    def find(cls, source: str) -> "Emulation | None":
        key = hashlib.sha256(source.encode()).hexdigest()
        if key not in cls._cache:
            cls._cache[key] = None
            from tvmpipe.bundle import load_bundle

            for d in bundle_dirs():
                if hashlib.sha256((d / "kernels.cu").read_bytes()).hexdigest() == key:
                    cls._cache[key] = cls.of(load_bundle(d))
                    break
        return cls._cache[key]

    @classmethod
    def of(cls, bundle) -> "Emulation":
        g = bundle.graph
        em = cls()
        for nid in g.op_nodes:
            node = g.nodes[nid]
            f = node.func_name
            if not node.launches_kernels or f not in bundle.kernels:
                continue
            if any(v[0].name == f for v in em.by_kernel.values()):
                continue
            entries = g.input_entry_ids(nid) + list(g.node_entry_ids(nid))
            specs = [(tuple(g.entries[e].shape), g.entries[e].dtype) for e in entries]
            fe = FuncEmu(f, bundle.ops.get(f), bundle.kernels[f].launches, specs, len(g.input_entry_ids(nid)))
            for i, l in enumerate(fe.launches):
                em.by_kernel.setdefault(l.kernel, (fe, i))
        return em


def bundle_dirs():
    """$FAKE_PYCUDA_BUNDLES: bundle directories, or directories searched for them (for bundles a
    test writes later, e.g. a pytest --basetemp)."""
    from pathlib import Path

    for d in filter(None, os.environ.get("FAKE_PYCUDA_BUNDLES", "").split(os.pathsep)):
        d = Path(d)
        if (d / "bundle.json").is_file():
            yield d
        elif d.is_dir():
            yield from (p.parent for p in sorted(d.rglob("bundle.json")) if (p.parent / "kernels.cu").is_file())


FMT = {"int32": "i", "int64": "q", "uint32": "I", "uint64": "Q", "float32": "f", "float64": "d"}


def decode(launch, argbuf: bytes) -> list:
    fmt = "@" + "".join(FMT[o.dtype] if o.kind == "scalar" else "P" for o in launch.args)
    return list(struct.unpack(fmt, argbuf))
