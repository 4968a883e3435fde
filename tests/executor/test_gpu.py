"""The cuda backend on a real GPU: against the reference backend, with CUDA-graph replay, split.

Skipped cleanly without pycuda or a GPU. Models: the tiny handmade bundle, examples/mlp and
examples/cnn, plus any bundle directories listed in TVMPIPE_GPU_BUNDLES (colon-separated), e.g.
resnet18 and transformer from `tvmpipe compile`. float32 tolerance: rtol 1e-4, atol 1e-5 * max|ref|.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tvmpipe.bundle import load_bundle
from tvmpipe.executor import GraphRunner, Stage, feeds_by_entry, random_inputs

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def gpu():
    try:
        import pycuda.driver as cuda

        cuda.init()
        if cuda.Device.count() == 0:
            pytest.skip("no CUDA device")
    except Exception as exc:  # ImportError (no pycuda / no libcuda) or a driver error
        pytest.skip(f"no pycuda or GPU: {exc}")


def gpu_models(bundle_dirs) -> list[str]:
    names = [n for n in ("tiny", "examples/mlp", "examples/cnn") if n in bundle_dirs]
    return names + [p for p in os.environ.get("TVMPIPE_GPU_BUNDLES", "").split(":") if p]


@pytest.fixture
def model_bundles(bundle_dirs):
    return {name: load_bundle(bundle_dirs.get(name, Path(name))) for name in gpu_models(bundle_dirs)}


def outputs(runner: GraphRunner) -> list[np.ndarray]:
    return [runner.get_output(i) for i in range(runner.get_num_outputs())]


def test_cuda_matches_reference(model_bundles):
    for name, b in model_bundles.items():
        inputs = random_inputs(b, seed=4)
        ref, gpu = GraphRunner(b), GraphRunner(b, backend="cuda")
        ref.run(**inputs)
        gpu.run(**inputs)
        for want, got in zip(outputs(ref), outputs(gpu)):
            scale = max(1.0, float(np.abs(want).max()))
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale, err_msg=name)
        gpu.close()


def test_graph_replay_equals_plain_launches(model_bundles):
    for name, b in model_bundles.items():
        plain, graphed = GraphRunner(b, backend="cuda"), GraphRunner(b, backend="cuda", graphs=True)
        for seed in (1, 2):  # the second run replays the captured graph with new inputs
            inputs = random_inputs(b, seed=seed)
            plain.run(**inputs)
            graphed.run(**inputs)
            for a, g in zip(outputs(plain), outputs(graphed)):
                assert a.tobytes() == g.tobytes(), name
        plain.close()
        graphed.close()


def test_cuda_split_equals_whole(model_bundles):
    for name, b in model_bundles.items():
        n = len(b.graph.nodes)
        feeds = feeds_by_entry(b, random_inputs(b, seed=3))
        whole = Stage(b, 0, n, backend="cuda")
        want = whole.run(feeds)
        whole.close()
        cut = b.graph.op_nodes[len(b.graph.op_nodes) // 2]
        values = dict(feeds)
        for a, z in ((0, cut), (cut, n)):
            s = Stage(b, a, z, backend="cuda")
            values.update(s.run({e: values[e] for e in s.program.feed_entries}))
            s.close()
        for h in b.graph.head_entries:
            assert values[h].tobytes() == want[h].tobytes(), name


def test_cuda_profile_has_kernel_times(model_bundles):
    for name, b in model_bundles.items():
        r = GraphRunner(b, backend="cuda")
        r.set_input(**random_inputs(b))
        prof = r.profile(repeat=3)
        launched = [l.kernel for l in r.program.launches]
        assert [k.kernel for n in prof.nodes for k in n.kernels] == launched, name
        assert prof.kernel_total_us > 0 and prof.run_us > 0
        assert all(n.ops for n in prof.nodes if n.kernels), f"{name}: a profiled node maps to no model op"
        r.close()


def rescaled(param, rng) -> np.ndarray:
    """A floating `param` with each element times its own factor in [0.5, 1.5): the magnitudes the
    model was built for. Integer and bool params (index_tensor's indices, mask patterns) are
    shuffled instead: scaled indices would point past their tensor, which no backend defines, and a
    permutation keeps every index valid while moving it (the compiler once inlined such params in
    ops.json, so the reference ignored what load_params put there). Elements near the dtype's limit
    (an attention mask's finfo.max) keep their value instead of overflowing to inf. Always an array
    of the param's shape and dtype (a 0-d param stays a 0-d array, not a numpy scalar, which
    set_param rightly rejects)."""
    value = np.asarray(param)
    if not np.issubdtype(value.dtype, np.floating):
        return rng.permutation(value.reshape(-1)).reshape(value.shape)
    scaled = value * rng.uniform(0.5, 1.5, value.shape)
    scaled = np.where(np.abs(value) < np.finfo(value.dtype).max / 2, scaled, value)
    return np.asarray(scaled, dtype=value.dtype).reshape(value.shape)


def test_cuda_load_params_after_build(model_bundles):
    """load_params replaces the weights already on the device; the outputs follow the reference's,
    and on at least one model they changed (a relu can hide the change on a small one)."""
    changed = []
    for name, b in model_bundles.items():
        if not b.param_names:
            continue
        inputs = random_inputs(b, seed=6)
        rng = np.random.default_rng(6)
        new = {n: rescaled(b.params[n], rng) for n in b.param_names}
        ref, gpu = GraphRunner(b), GraphRunner(b, backend="cuda")
        gpu.run(**inputs)
        before = outputs(gpu)
        for r in (ref, gpu):
            r.load_params(new)
            r.run(**inputs)
        changed += [name] if any(a.tobytes() != g.tobytes() for a, g in zip(before, outputs(gpu))) else []
        for want, got in zip(outputs(ref), outputs(gpu)):
            scale = max(1.0, float(np.abs(want).max()))
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale, err_msg=name)
        gpu.close()
    assert changed, "load_params changed no model's outputs on the device"
