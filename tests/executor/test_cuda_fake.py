"""The cuda backend's launch path on CPU: the real PyCudaDevice over the strict fake pycuda,
recorded (tests/support/recording_device.py)."""

from __future__ import annotations

import os
import shutil
import sys

import numpy as np
import pytest

from tests.support.recording_device import RecordingDevice, check_stage_launches, ranges
from tests.support.executor_cases import CPU_MODELS, get_bundle
from tvmpipe.executor import BackendUnavailable, Stage, feeds_by_entry, random_inputs
from tvmpipe.executor.cubin import compile_cubin


@pytest.mark.parametrize("model", CPU_MODELS)
def test_recorded_launches_match_bundle(fake_cuda, bundles, model):
    bundle = get_bundle(bundles, model)
    for start, end in ranges(len(bundle.graph.nodes)):
        check_stage_launches(bundle, start, end)


def test_graph_capture_replays(fake_cuda, bundles):
    bundle = bundles["skipnet"]
    feeds = feeds_by_entry(bundle, random_inputs(bundle))
    plain_dev, graph_dev = RecordingDevice(), RecordingDevice()
    plain = Stage(bundle, 0, len(bundle.graph.nodes), backend="cuda", device=plain_dev)
    graphed = Stage(bundle, 0, len(bundle.graph.nodes), backend="cuda", device=graph_dev, graphs=True)
    n0, m0 = len(plain_dev.calls), len(graph_dev.calls)
    plain.run(feeds)
    for _ in range(3):
        graphed.run(feeds)
    enqueued = plain_dev.calls[n0:-1]  # without the final sync
    calls = [translate(c, dict(zip(graph_dev.sizes, plain_dev.sizes))) for c in graph_dev.calls[m0:]]
    b, e = calls.index(("begin_capture",)), calls.index(("end_capture",))
    assert calls[b + 1:e] == enqueued, "the captured graph holds the same copies and launches"
    rest = calls[:b] + calls[e + 1:]
    assert rest == [("replay",), ("sync",)] * 3
    assert calls.count(("begin_capture",)) == 1


def translate(call: tuple, addr: dict[int, int]) -> tuple:
    """One device's call in the other's addresses (both allocate the same slots in the same order)."""
    out = []
    for v in call:
        if isinstance(v, int) and v in addr:
            v = addr[v]
        elif isinstance(v, bytes):
            for a, b in addr.items():
                v = v.replace(a.to_bytes(8, "little"), b.to_bytes(8, "little"))
        out.append(v)
    return tuple(out)


def test_profiled_run_times_each_kernel(fake_cuda, bundles):
    bundle = bundles["tiny"]
    stage = Stage(bundle, 0, len(bundle.graph.nodes), backend="cuda", device=RecordingDevice())
    _, timings = stage.run_profiled({0: np.ones((1, 4), np.float32)})
    assert [[k for k, _ in t.kernels] for t in timings] == [["dense_add_kernel", "dense_add_kernel_1"], [], ["scale_kernel"]]
    assert all(t.seconds == pytest.approx(sum(s for _, s in t.kernels)) for t in timings)


def test_bare_graph_refused(fake_cuda, fixtures_dir):
    from tvmpipe.bundle import load_bundle
    from tvmpipe.executor import ExecutorError

    b = load_bundle(fixtures_dir / "wrn_fc_nnvm.json")
    with pytest.raises(ExecutorError, match="no kernels.json launch list for node .* bare graph.json"):
        Stage(b, 0, len(b.graph.nodes), backend="cuda", device=RecordingDevice())


def test_no_pycuda_import_and_clear_error(bundles):
    import tvmpipe.executor.backend_cuda  # noqa: F401

    assert "pycuda" not in sys.modules
    try:
        import pycuda.driver  # noqa: F401
    except ImportError:
        with pytest.raises(BackendUnavailable, match="needs pycuda and an NVIDIA driver"):
            Stage(bundles["tiny"], 0, 6, backend="cuda")
    else:
        pytest.skip("pycuda is importable here")


@pytest.mark.skipif(shutil.which("nvcc") is None and not os.path.exists("/usr/local/bin/nvcc"),
                    reason="nvcc not installed")
def test_compile_cubin_cached(bundles, tmp_path):
    src = bundles["tiny"].cuda_source
    cubin = compile_cubin(src, "sm_90", cache_dir=tmp_path)
    assert cubin[:4] == b"\x7fELF"
    (cached,) = (tmp_path / "cubin").glob("*.cubin")
    stamp = cached.stat().st_mtime_ns
    assert compile_cubin(src, "sm_90", cache_dir=tmp_path) == cubin
    assert cached.stat().st_mtime_ns == stamp
    assert len(list((tmp_path / "cubin").glob("*.cubin"))) == 1
    compile_cubin(src, "sm_80", cache_dir=tmp_path)
    assert len(list((tmp_path / "cubin").glob("*.cubin"))) == 2


def test_graph_runner_copies_an_input_once_and_an_output_when_asked(fake_cuda, bundles, monkeypatch):
    """TVM's verbs on cuda: set_input copies the input into the page-locked buffer each run copies
    to the device, so run() copies nothing on the host (it used to copy the input again); outputs
    stay in their page-locked buffers until get_output copies the one asked for, once per run."""
    from tests.support.tiny_bundle import tiny_expected, tiny_params
    from tvmpipe.executor import GraphRunner

    x = np.random.default_rng(3).standard_normal((1, 4)).astype(np.float32)
    copied_into: list[int] = []
    real_copyto = np.copyto
    with GraphRunner(bundles["tiny"], backend="cuda", graphs=True) as r:
        staging = {id(h) for h in r.stage.backend.host_in.values()}
        monkeypatch.setattr(np, "copyto", lambda dst, src, **kw: (copied_into.append(id(dst)), real_copyto(dst, src, **kw))[1])
        reads: list[int] = []
        real_read = r.stage.backend.read
        monkeypatch.setattr(r.stage.backend, "read", lambda e: (reads.append(e), real_read(e))[1])
        r.set_input("x", x)
        assert [c for c in copied_into if c in staging] == [next(iter(staging))]
        x_orig, x[...] = x.copy(), 0  # the runner holds its own copy
        copied_into.clear()
        for _ in range(3):
            r.run()
        assert not [c for c in copied_into if c in staging], "run() copied an input that set_input had put in place"
        assert reads == []
        out = r.get_output(0)
        assert r.get_output(0) is out and len(reads) == 1
        np.testing.assert_allclose(out, tiny_expected(x_orig, tiny_params()), rtol=1e-6)
        r.run(x=2 * x_orig)
        np.testing.assert_allclose(out, tiny_expected(x_orig, tiny_params()), rtol=1e-6)  # a copy: the next run left it
        np.testing.assert_allclose(r.get_output(0), tiny_expected(2 * x_orig, tiny_params()), rtol=1e-6)
        assert len(reads) == 2
