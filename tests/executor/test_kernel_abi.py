"""Every planned launch's argument bytes against the kernel nvcc compiled: parameter offsets and
sizes from the cubin's EIATTR_KPARAM_INFO table, the total against the parameter bank size, block
sizes against `__launch_bounds__` and ptxas's register count, shared memory against the limits.

Needs nvcc (not a GPU). It is on the development VM (/usr/local/cuda-13.0, from NVIDIA's pip
wheels); a machine without it skips this module with that reason, because the toolkit cannot be
installed from the project's own files (the fake-driver tests check the same sizes against the
kernel signatures in kernels.cu, without nvcc)."""

from __future__ import annotations

import shutil
import struct

import pytest

from tests.support.cubin_elf import compile_and_read
from tvmpipe.executor.launch_plan import PlannedLaunch, build_launch_plan
from tvmpipe.executor.program import build_stage_program

NVCC = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if shutil.os.path.exists(p)), None)
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not installed (see the module docstring)")
REGS_PER_SM_BLOCK = 65536  # registers one block may use on sm_75..sm_90
OPTIN_SMEM = 227 * 1024
SIZE = {"int32": 4, "uint32": 4, "int64": 8, "uint64": 8, "float32": 4, "float64": 8}


@pytest.mark.parametrize("model", ["tiny", "examples/mlp", "examples/cnn"])
def test_launch_arguments_match_compiled_kernels(bundles, model, tmp_path):
    b = bundles[model]
    kernels = compile_and_read(NVCC, b.cuda_source, "sm_90", tmp_path)
    program = build_stage_program(b, 0, len(b.graph.nodes))
    ptrs = [0x7F0000000000 + (i << 20) for i in range(len(program.storage.slots))]
    plan = [p for p in build_launch_plan(program, ptrs) if isinstance(p, PlannedLaunch)]
    assert plan
    for p, l in zip(plan, program.launches):
        assert (p.kernel, p.node) == (l.kernel, l.node)
        k = kernels[p.kernel]
        assert sorted(k.params) == list(range(len(l.args))), f"{p.kernel}: parameter count"
        assert len(p.argbuf) == k.param_bytes, f"{p.kernel}: {len(p.argbuf)} argument bytes, kernel takes {k.param_bytes}"
        for i, a in enumerate(l.args):
            off, size = k.params[i]
            want = 8 if a.kind != "scalar" else SIZE[a.dtype]
            assert size == want, f"{p.kernel} parameter {i}: {size} bytes in the cubin, {want} packed"
            raw = p.argbuf[off:off + size]
            if a.kind == "scalar":
                fmt = {"int32": "i", "int64": "q", "uint32": "I", "uint64": "Q", "float32": "f", "float64": "d"}[a.dtype]
                assert struct.unpack("<" + fmt, raw)[0] == pytest.approx(a.value)
            else:
                assert int.from_bytes(raw, "little") == ptrs[a.slot], f"{p.kernel} parameter {i}: pointer"
        threads = p.block[0] * p.block[1] * p.block[2]
        assert threads <= min(1024, k.max_threads or 1024), f"{p.kernel}: block {p.block} > launch bounds {k.max_threads}"
        assert threads * k.registers <= REGS_PER_SM_BLOCK, f"{p.kernel}: {threads} threads x {k.registers} registers"
        assert k.static_smem + p.shared_mem <= OPTIN_SMEM
