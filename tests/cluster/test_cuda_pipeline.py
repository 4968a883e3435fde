"""Whole pipelines on the cuda backend over the strict fake PyCUDA (tests/fakecuda), in worker
processes and Ray actors: the real worker threading, the real PyCudaDevice, CUDA's per-thread
context rule enforced. Outputs must equal the single-process run on the same fake, bit for bit (and
so the reference backend, whose ops the fake's kernels run)."""

from __future__ import annotations

import sys

import pytest

from tvmpipe.bundle import load_bundle
from tvmpipe.cluster.control.ray_actors import RayLauncher
from tvmpipe.cluster.driver import Pipeline
from tvmpipe.cluster.control.launchers import ProcessLauncher
from tvmpipe.cluster.control.placement import Placement
from tvmpipe.executor import random_inputs

from tests.support.fake_cuda import fake_env, spawn_path
from tests.support.pipeline_harness import assert_bit_identical

MODELS = ["mlp", "cnn", "resnet18", "transformer"]
SHARED_GPU = Placement(cpus=0.25, gpus=0.5)  # two stage processes share each (fake) GPU


@pytest.fixture(scope="module")
def model_dirs(bundles, tmp_path_factory):
    """mlp and cnn from examples/, resnet18 and transformer compiled with TVM (the compile extra)."""
    pytest.importorskip("tvm")
    from tvmpipe.compiler.export import compile_model

    out = {m: bundles[m] for m in ("mlp", "cnn")}
    for m in ("resnet18", "transformer"):
        out[m] = tmp_path_factory.mktemp(m) / "bundle"
        compile_model(m, out[m])
    return out


@pytest.fixture(scope="module")
def env(model_dirs, tmp_path_factory):
    return fake_env(tmp_path_factory.mktemp("cubins"), model_dirs.values())


@pytest.fixture(scope="module")
def oracle(model_dirs, env):
    """model -> (batches, outputs of the single-process run on the fake cuda backend), all models
    in one worker-like child (app/oracle.py's, spawned once); that the fake computes the reference
    backend's numbers is test_fake_driver.py's."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    from tvmpipe.app import oracle as single_process
    from tvmpipe.cluster.control.environment import scoped_environ, worker_environment

    batches = {m: [random_inputs(load_bundle(d), seed=10 + i) for i in range(3)] for m, d in model_dirs.items()}
    with scoped_environ(env), spawn_path(), worker_environment(), \
            ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        futures = {m: pool.submit(single_process._run, str(d), "cuda", {}, batches[m]) for m, d in model_dirs.items()}
        return {m: (batches[m], f.result()) for m, f in futures.items()}


@pytest.mark.parametrize("model", MODELS)
def test_process_pipelines_on_fake_cuda(model_dirs, env, oracle, model):
    batches, want = oracle[model]
    for k in (1, 2, 3):
        with spawn_path():
            pipe = Pipeline(model_dirs[model], k, backend="cuda", launcher=ProcessLauncher(env=env))
        with pipe:
            assert_bit_identical(pipe.run(batches), want)


@pytest.mark.ray
@pytest.mark.parametrize("model", MODELS)
def test_ray_pipelines_on_fake_cuda(ray_cluster, model_dirs, env, oracle, model):
    batches, want = oracle[model]
    for k in (1, 2, 3):
        launcher = RayLauncher(SHARED_GPU, env=env)
        with Pipeline(model_dirs[model], k, backend="cuda", backend_opts={"graphs": k == 2},
                      launcher=launcher) as pipe:
            assert_bit_identical(pipe.run(batches), want)


def test_worker_threads_on_fake_cuda(model_dirs, oracle, tmp_path, monkeypatch):
    """Defect 1: stages are built on the driver's thread (ThreadLauncher) and compute on their
    receiver / compute threads, where no context is current unless the backend makes it so. The
    two workers also share one process (two stages, one GPU, one primary context)."""
    from tests.support.fake_cuda import activate
    from tests.support.pipeline_harness import ThreadLauncher

    activate(monkeypatch, tmp_path, model_dirs.values())
    import pycuda.driver as drv

    for model in ("mlp", "cnn"):  # small inputs: computed on the receiver thread; large: compute thread
        batches, want = oracle[model]
        with Pipeline(model_dirs[model], 2, backend="cuda", launcher=ThreadLauncher(), max_restarts=0) as pipe:
            assert_bit_identical(pipe.run(batches), want)
    assert drv.Context.get_current() is None and not drv.violations
    for name in [m for m in sys.modules if m.startswith("pycuda")]:
        del sys.modules[name]
