"""Launch-list extraction from TVM's host code, on functions that launch several kernels.

With dlight's Fallback rule alone, log_softmax and layer_norm become three kernels that pass
reductions through host-allocated workspaces: the case a flat launch list must get exactly right.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("tvm")
pytestmark = pytest.mark.tvm


def lower_single_op(make_op, shapes: list[tuple[int, ...]]):
    """Legalize one Relax op, schedule it with dlight Fallback only, and lower it to a launch list."""
    import tvm
    import tvm.s_tir.dlight as dl
    from tvm import relax

    from tvmpipe.compiler.launches import cuda_source, cuda_target, lower_function

    bb = relax.BlockBuilder()
    args = [relax.Var(f"a{i}", relax.TensorType(s, "float32")) for i, s in enumerate(shapes)]
    with bb.function("main", args):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(make_op(*args)))
        bb.emit_func_output(out)
    target = cuda_target("sm_90")
    with target:
        mod = tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
                                        relax.transform.FuseOps(), relax.transform.FuseTIR()])(bb.get())
        mod = dl.ApplyDefaultSchedule(dl.gpu.Fallback())(mod)
    (name, func), = [(gv.name_hint, f) for gv, f in mod.functions.items() if gv.name_hint != "main"]
    lowered = lower_function(name, func, target)
    return lowered, cuda_source(lowered.device_funcs, target)


def kernel_params(src: str, kernel: str) -> list[str]:
    m = re.search(rf"__global__ void __launch_bounds__\(\d+\) {kernel}\(([^)]*)\)", src)
    assert m, f"{kernel} not defined"
    return [p.strip() for p in m.group(1).split(",")]


def check_abi(lowered, src: str, n_args: int) -> None:
    """Every operand is in range and every kernel takes exactly as many parameters as it is given."""
    kf = lowered.kernels
    for launch in kf.launches:
        assert len(kernel_params(src, launch.kernel)) == len(launch.args)
        assert launch.threads <= 1024 and min(launch.grid) >= 1
        for a in launch.args:
            if a.kind == "arg":
                assert 0 <= a.index < n_args
            elif a.kind == "workspace":
                assert 0 <= a.index < len(kf.workspaces)
    # each workspace is written by one kernel and read by a later one
    for j in range(len(kf.workspaces)):
        users = [i for i, l in enumerate(kf.launches) if any(a.kind == "workspace" and a.index == j for a in l.args)]
        assert len(users) >= 2, f"workspace {j} used by launches {users}"


def test_log_softmax_fallback_gives_three_kernels_and_two_workspaces():
    from tvm import relax

    lowered, src = lower_single_op(lambda x: relax.op.nn.log_softmax(x), [(1, 1000)])
    kf = lowered.kernels
    assert [l.kernel for l in kf.launches] == ["log_softmax_kernel", "log_softmax_kernel_1", "log_softmax_kernel_2"]
    assert [(w.nbytes, w.dtype, w.shape) for w in kf.workspaces] == [(4, "float32", (1,)), (4, "float32", (1,))]
    assert all(l.shared_mem == 0 for l in kf.launches)
    # the input (arg 0) is read by all three; only the last kernel writes the output (arg 1)
    assert all({"kind": "arg", "index": 0} in [{"kind": a.kind, "index": a.index} for a in l.args] for l in kf.launches)
    writers = [i for i, l in enumerate(kf.launches) if any(a.kind == "arg" and a.index == 1 for a in l.args)]
    assert writers == [2]
    check_abi(lowered, src, n_args=2)


def test_layer_norm_fallback_gives_three_kernels():
    from tvm import relax

    lowered, src = lower_single_op(lambda x, g, b: relax.op.nn.layer_norm(x, g, b, axes=[-1]),
                                   [(1, 128, 768), (768,), (768,)])
    kf = lowered.kernels
    assert len(kf.launches) == 3
    assert [w.nbytes for w in kf.workspaces] == [512, 512]  # per-row statistics, 128 rows x float32
    writers = [i for i, l in enumerate(kf.launches) if any(a.kind == "arg" and a.index == 3 for a in l.args)]
    assert writers == [2]
    check_abi(lowered, src, n_args=4)


def test_full_rule_set_gives_one_kernel_per_function(compiled):
    kernels = compiled("mlp").exported.kernels["functions"]
    assert all(len(f["launches"]) == 1 and f["workspaces"] == [] for f in kernels.values())
    launch = kernels["log_softmax"]["launches"][0]
    assert launch["args"] == [{"arg": 1}, {"arg": 0}]  # kernel params are sorted by name: output first


def test_scalars_and_dynamic_shared_memory_from_host_code():
    """Immediate operands become typed scalars; the last launch value under use_dyn_shared_memory is bytes."""
    from tvm.script import tirx as T

    from tvmpipe.compiler.launches import read_launches

    @T.prim_func
    def host(x: T.Buffer((4,), "float32"), y: T.Buffer((4,), "float32")):
        T.call_ffi_kernel("k", x.data, y.data, T.int32(0), T.int64(7), 2, 32, 65536,
                          launch_params=["blockIdx.x", "threadIdx.x", "tirx.use_dyn_shared_memory"], ret_ty="int32")

    kf = read_launches("host", host)
    assert kf.to_json() == {"workspaces": [], "launches": [{
        "kernel": "k", "grid": [2, 1, 1], "block": [32, 1, 1], "shared_mem": 65536,
        "args": [{"arg": 0}, {"arg": 1}, {"scalar": 0, "dtype": "int32"}, {"scalar": 7, "dtype": "int64"}]}]}


def test_float_scalars_keep_their_width():
    """A float64 immediate is packed in 8 bytes, so kernels.json must say float64 (issue 12, defect 7)."""
    from tvm.script import tirx as T

    from tvmpipe.compiler.launches import read_launches

    @T.prim_func
    def host(x: T.Buffer((4,), "float32")):
        T.call_ffi_kernel("k", x.data, T.float32(0.5), T.float64(0.25), 1, 32,
                          launch_params=["blockIdx.x", "threadIdx.x"], ret_ty="int32")

    args = read_launches("host", host).to_json()["launches"][0]["args"]
    assert args[1:] == [{"scalar": 0.5, "dtype": "float32"}, {"scalar": 0.25, "dtype": "float64"}]


def test_host_loops_and_symbolic_grids_are_not_flat():
    from tvm.script import tirx as T

    from tvmpipe.compiler.launches import HostCodeError, read_launches

    @T.prim_func
    def looped(x: T.Buffer((4,), "float32")):
        for _ in range(3):
            T.call_ffi_kernel("k", x.data, 1, 32, launch_params=["blockIdx.x", "threadIdx.x"], ret_ty="int32")

    @T.prim_func
    def symbolic(x: T.handle):
        n = T.int32()
        X = T.match_buffer(x, (n,), "float32")
        T.call_ffi_kernel("k", X.data, (n + 31) // 32, 32, launch_params=["blockIdx.x", "threadIdx.x"], ret_ty="int32")

    with pytest.raises(HostCodeError, match=r"host code has a For"):
        read_launches("looped", looped)
    with pytest.raises(HostCodeError, match=r"blockIdx\.x is \(n \+ 31\) // 32, a value computed at run time"):
        read_launches("symbolic", symbolic)
