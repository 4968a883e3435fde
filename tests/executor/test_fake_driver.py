"""The strict fake PyCUDA (tests/fakecuda): the real PyCudaDevice and CudaBackend run over it, and
each CUDA rule it enforces catches its violation."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

from fakecuda_env import activate
from tvmpipe.executor import DeviceError, GraphRunner, Stage, feeds_by_entry, random_inputs


@pytest.fixture
def fake(monkeypatch, tmp_path, bundle_dirs):
    activate(monkeypatch, tmp_path / "cache", bundle_dirs.values())
    import pycuda.driver as drv

    yield drv
    sys.modules.pop("pycuda.driver", None)
    sys.modules.pop("pycuda.kernels", None)
    sys.modules.pop("pycuda", None)


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
