"""The strict fake PyCUDA (tests/fakecuda): the real PyCudaDevice and CudaBackend run over it, and
each CUDA rule it enforces catches its violation."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tvmpipe.executor import DeviceError, GraphRunner, Stage, feeds_by_entry, random_inputs


@pytest.fixture
def fake(fake_cuda):
    return fake_cuda


def outputs(r):
    return [r.get_output(i) for i in range(r.get_num_outputs())]


@pytest.mark.parametrize("model", ["tiny", "examples/mlp", "examples/cnn"])
def test_cuda_on_fake_equals_reference(fake, bundles, model):
    b = bundles[model]
    inputs = random_inputs(b, seed=5)
    ref, cuda = GraphRunner(b), GraphRunner(b, backend="cuda")
    ref.run(**inputs)
    cuda.run(**inputs)
    for want, got in zip(outputs(ref), outputs(cuda)):
        assert got.tobytes() == want.tobytes()
    cuda.close()
    assert not fake.violations


def stage_on_thread(bundle, **opts):
    """Build a stage on one thread (as a worker does), hand it back to the caller's thread."""
    box = {}
    t = threading.Thread(target=lambda: box.update(s=Stage(bundle, 0, len(bundle.graph.nodes), backend="cuda", **opts)))
    t.start()
    t.join()
    return box["s"]


def test_stage_built_on_one_thread_runs_on_others(fake, bundles):
    """Defect 1: a stage built on one thread runs micro-batches on others (no context left behind)."""
    b = bundles["examples/mlp"]
    feeds = feeds_by_entry(b, random_inputs(b, seed=1))
    stage = stage_on_thread(b, graphs=True)
    assert fake.Context.get_current() is None
    out = {}
    for _ in range(2):
        t = threading.Thread(target=lambda: out.update(stage.run(feeds)))
        t.start()
        t.join()
    assert out and not fake.violations
    ref = Stage(b, 0, len(b.graph.nodes)).run(feeds)
    assert all(out[e].tobytes() == ref[e].tobytes() for e in ref)
    stage.close()
    assert fake.Context.get_current() is None


def test_no_context_is_an_error(fake):
    fake.init()
    with pytest.raises(fake.LogicError, match=r"^cuMemAlloc failed: invalid device context$"):
        fake.mem_alloc(16)
    with pytest.raises(fake.LogicError, match=r"^explicit_context_dependent failed: invalid device context - "
                                              r"no currently active context\?$"):
        fake.Event()
    ctx = fake.Device(0).retain_primary_context()
    ctx.push()
    s = fake.Stream()
    t = threading.Thread(target=lambda: fake.memcpy_htod_async(0, np.zeros(4), s))
    errors = []
    t.run = (lambda run: lambda: errors.append(pytest.raises(fake.LogicError, run)))(t.run)
    t.start()
    t.join()
    assert "cuMemcpyHtoDAsync failed: invalid device context" in str(errors[0].value)
    fake.Context.pop()


@pytest.fixture
def ctx(fake):
    fake.init()
    c = fake.Device(0).retain_primary_context()
    c.push()
    yield c
    fake.Context.pop()


def test_host_read_before_synchronize(fake, ctx):
    s = fake.Stream()
    d = fake.mem_alloc(64)
    h = fake.pagelocked_empty((16,), np.float32)
    fake.memcpy_htod(int(d), np.arange(16, dtype=np.float32))
    fake.memcpy_dtoh_async(h, int(d), s)
    with pytest.raises(fake.RuleViolation, match="device-to-host copy into it is pending"):
        h.copy()
    s.synchronize()
    assert h.copy().tolist() == list(range(16))


def test_pinned_buffer_reused_before_synchronize(fake, ctx):
    s = fake.Stream()
    d = fake.mem_alloc(64)
    h = fake.pagelocked_empty((16,), np.float32)
    np.copyto(h, np.ones(16, np.float32))
    fake.memcpy_htod_async(int(d), h, s)
    with pytest.raises(fake.RuleViolation, match="host-to-device copy from it is pending"):
        np.copyto(h, np.zeros(16, np.float32))
    s.synchronize()
    np.copyto(h, np.zeros(16, np.float32))


def test_allocation_sizes_double_free_use_after_free(fake, ctx):
    with pytest.raises(fake.LogicError, match="cuMemAlloc failed: invalid argument"):
        fake.mem_alloc(0)
    d = fake.mem_alloc(64)
    with pytest.raises(fake.LogicError, match="cuMemcpyHtoD failed: invalid argument"):
        fake.memcpy_htod(int(d), np.zeros(17, np.float32))  # 68 bytes into 64
    d.free()
    with pytest.raises(fake.LogicError, match=r"device_allocation::free failed: invalid resource handle"):
        d.free()
    with pytest.raises(fake.LogicError, match="not inside one live allocation"):
        fake.memcpy_htod(int(d), np.zeros(4, np.float32))


def fake_module(fake, src, tmp_path):
    import subprocess

    from tests.support.fake_cuda import FAKE_ROOT

    (tmp_path / "k.cu").write_text(src)
    subprocess.run([str(FAKE_ROOT / "bin" / "nvcc"), "--cubin", "-arch=sm_90", "-o", str(tmp_path / "k.cubin"),
                    str(tmp_path / "k.cu")], check=True)
    return fake.module_from_buffer((tmp_path / "k.cubin").read_bytes())


KERNEL = ('extern "C" __global__ void __launch_bounds__(128) k(float* __restrict__ a, int n) {\n'
          '  __shared__ alignas(64) float buf[4096];\n}\n')


def test_shared_memory_limits_and_opt_in(fake, ctx, tmp_path):
    f = fake_module(fake, KERNEL, tmp_path).get_function("k")
    assert f.get_attribute(fake.function_attribute.SHARED_SIZE_BYTES) == 16384
    s = fake.Stream()
    args = np.zeros(2, np.int64).tobytes()[:12]
    # 16 KiB static + 40 KiB dynamic > 48 KiB: refused without the opt-in, though 40 KiB <= 48 KiB
    with pytest.raises(fake.LogicError, match="cuLaunchKernel failed: invalid argument - 40960 bytes of dynamic"):
        f._launch_kernel((1, 1, 1), (128, 1, 1), args, 40960, s)
    f.set_attribute(fake.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, 40960)
    with pytest.raises(fake.RuleViolation, match="no registered bundle"):  # launched: no bundle computes k
        f._launch_kernel((1, 1, 1), (128, 1, 1), args, 40960, s)
    with pytest.raises(fake.LogicError, match="cuFuncSetAttribute failed: invalid argument"):
        f.set_attribute(fake.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, 227 * 1024)


def test_launch_bounds_and_argument_bytes(fake, ctx, tmp_path):
    f = fake_module(fake, KERNEL, tmp_path).get_function("k")
    s = fake.Stream()
    with pytest.raises(fake.LogicError, match=r"256 threads > __launch_bounds__\(128\)"):
        f._launch_kernel((1, 1, 1), (256, 1, 1), bytes(12), 0, s)
    with pytest.raises(fake.LogicError, match="parameter buffer of 16 bytes, kernel k takes 12"):
        f._launch_kernel((1, 1, 1), (128, 1, 1), bytes(16), 0, s)


def test_capture_refuses_synchronous_calls(fake, ctx):
    import ctypes

    lib = ctypes.CDLL("libcuda.so.1")
    s = fake.Stream()
    d = fake.mem_alloc(16)
    h = ctypes.c_void_p(s.handle)
    assert lib.cuStreamBeginCapture_v2(h, 1) == 0
    with pytest.raises(fake.LogicError, match="cuMemcpyHtoD failed: operation not permitted when stream is capturing"):
        fake.memcpy_htod(int(d), np.zeros(4, np.float32))
    with pytest.raises(fake.LogicError, match="cuStreamSynchronize failed: operation not permitted"):
        s.synchronize()
    graph = ctypes.c_void_p()
    assert lib.cuStreamEndCapture(h, ctypes.byref(graph)) == 901  # the capture was invalidated


def test_backend_on_fake_closes_after_kernel_fault(fake, bundles):
    """Defect 5: a fault reported at close still frees, pops the context, and is raised."""
    b = bundles["examples/mlp"]
    stage = Stage(b, 0, len(b.graph.nodes), backend="cuda")
    prim = fake._primaries[0]
    prim.sticky = "an illegal memory access was encountered (injected)"
    with pytest.raises(DeviceError, match="closing the device"):
        stage.close()
    assert fake.Context.get_current() is None and not prim.allocs
    prim.sticky = None
    stage.close()  # idempotent


def test_params_loaded_after_build(fake, bundles):
    """Defect 3: load_params on the cuda backend uploads the new values."""
    b = bundles["examples/mlp"]
    inputs = random_inputs(b, seed=2)
    new = {n: (np.asarray(v) * 0.5).astype(v.dtype) for n, v in b.params.items()}
    ref, cuda = GraphRunner(b), GraphRunner(b, backend="cuda")
    for r in (ref, cuda):
        r.load_params(new)
        r.run(**inputs)
    assert all(g.tobytes() == w.tobytes() for g, w in zip(outputs(cuda), outputs(ref)))
    cuda.close()


def test_two_stages_one_process_two_threads(fake, bundles):
    b = bundles["examples/cnn"]
    n = len(b.graph.nodes)
    cut = b.graph.op_nodes[len(b.graph.op_nodes) // 2]
    feeds = feeds_by_entry(b, random_inputs(b, seed=3))
    s0, s1 = Stage(b, 0, cut, backend="cuda"), Stage(b, cut, n, backend="cuda")
    got = {}

    def run(s):
        for _ in range(3):
            vals = dict(feeds) | got
            got.update(s.run({e: vals[e] for e in s.program.feed_entries}))
    t0 = threading.Thread(target=run, args=(s0,))
    t0.start()
    t0.join()
    t1 = threading.Thread(target=run, args=(s1,))
    t1.start()
    t1.join()
    want = Stage(b, 0, n).run(feeds)
    assert all(got[h].tobytes() == want[h].tobytes() for h in b.graph.head_entries)
    s0.close()
    s1.close()


def test_static_plus_dynamic_shared_memory_opts_in(fake, tmp_path):
    """Defect 4: 16 KiB static + 40 KiB dynamic needs the opt-in although 40 KiB <= 48 KiB."""
    import subprocess

    from tests.support.fake_cuda import FAKE_ROOT
    from tvmpipe.executor.backend_cuda import PyCudaDevice

    (tmp_path / "k.cu").write_text(KERNEL)
    subprocess.run([str(FAKE_ROOT / "bin" / "nvcc"), "--cubin", "-arch=sm_90", "-o", str(tmp_path / "k.cubin"),
                    str(tmp_path / "k.cu")], check=True)
    dev = PyCudaDevice()
    with dev.current():
        f = dev.load((tmp_path / "k.cubin").read_bytes(), {"k": 40960})["k"]
        ptr = dev.alloc(64)
        with pytest.raises(fake.RuleViolation, match="no registered bundle"):  # the launch checks passed
            dev.launch(f, (1, 1, 1), (128, 1, 1), 40960, ptr.to_bytes(8, "little") + bytes(4))
        with pytest.raises(DeviceError, match="16384 bytes of static and 217088 bytes of dynamic"):
            dev.load((tmp_path / "k.cubin").read_bytes(), {"k": 212 * 1024})
    dev.close()


def test_visible_gpu_count_follows_cuda_visible_devices():
    """Defect 8: the local cluster's GPU count is what CUDA_VISIBLE_DEVICES leaves visible."""
    from tvmpipe.cluster.control.local import visible_count

    gpus = [f"GPU {i}: NVIDIA X (UUID: GPU-{i}aaa-bbbb)" for i in range(4)]
    assert visible_count(gpus, None) == 4
    assert visible_count(gpus, "") == 0
    assert visible_count(gpus, "2") == 1
    assert visible_count(gpus, "3,1") == 2
    assert visible_count(gpus, "0,7,1") == 1  # CUDA stops at the first invalid entry
    assert visible_count(gpus, "1,1") == 1
    assert visible_count(gpus, "GPU-2aaa,0") == 2
    assert visible_count(gpus, "-1") == 0


def test_use_after_close_and_foreign_pop(fake, bundles):
    """A closed stage refuses work with a DeviceError; a context left pushed inside a tvmpipe call
    is detected instead of popping someone else's."""
    b = bundles["examples/mlp"]
    feeds = feeds_by_entry(b, random_inputs(b, seed=1))
    stage = Stage(b, 0, len(b.graph.nodes), backend="cuda")
    stage.close()
    with pytest.raises(DeviceError, match="the CUDA device is closed"):
        stage.run(feeds)
    dev = Stage(b, 0, len(b.graph.nodes), backend="cuda").backend.dev
    other = fake.Context(fake._Primary(7))
    with pytest.raises(DeviceError, match="context stack was changed"):
        with dev.current():
            other.push()
    fake.Context.pop()  # the foreign context, then the device's own, left under it
    fake.Context.pop()
    dev.close()
    assert fake.Context.get_current() is None


def test_thread_exiting_with_a_context_is_caught(fake, ctx):
    import gc

    t = threading.Thread(target=lambda: ctx.push(), name="leaky")
    t.start()
    t.join()
    del t
    gc.collect()
    assert any("thread leaky exited with 1 context" in v for v in fake.violations)
    fake.violations.clear()
