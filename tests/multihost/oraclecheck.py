"""A pipeline's outputs on the bed against the single-process oracle, which runs in the test process.

Bit for bit only where both sides compute with the same BLAS kernels in the same environment.
OpenBLAS picks its kernel when it loads, by CPU or by OPENBLAS_CORETYPE (and sums with as many
threads as OPENBLAS_NUM_THREADS says), and kernels round a float32 matmul differently in the last
bits: a test process with OPENBLAS_CORETYPE=Haswell on a SkylakeX-class CPU differed from the
hosts' SSH sessions, which do not inherit it, in 4 of examples/mlp's 60 output values.

- RayBed's hosts start every process with this process's environment (RayBed.env), so they run its
  kernels: compared bit for bit when the BLAS variables the oracle computes with are theirs too.
- The `ray up` machines (sshbed) run what their SSH logins start, in an environment of their own:
  compared within the tolerance `tvmpipe run` promises across hosts (oracle.ACROSS_HOSTS_RTOL of
  each output's scale, docs/cluster.md), with the largest difference printed and in the message.

Shapes (the number of micro-batches) and dtypes are compared exactly either way, and order still
shows: two micro-batches' outputs differ far beyond the tolerance.
"""

from __future__ import annotations

import os
from typing import Mapping

import numpy as np

from tvmpipe.app.oracle import ACROSS_HOSTS_RTOL, tolerance
from tvmpipe.cluster.control.environment import thread_env

# What selects a BLAS/OpenMP kernel or thread count (OPENBLAS_CORETYPE, OPENBLAS_NUM_THREADS, ...).
BLAS_PREFIXES = ("OPENBLAS_", "GOTO", "OMP_", "MKL_", "BLIS_", "NPY_")


def blas_environment(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(BLAS_PREFIXES)}


def oracle_environment() -> dict[str, str]:
    """The BLAS variables reference_outputs' child computes with: this process's, with the thread
    counts of worker_environment."""
    return blas_environment({**os.environ, **thread_env()})


def assert_matches_oracle(got: np.ndarray, want: np.ndarray, hosts_env: Mapping[str, str] | None,
                          what: str = "outputs") -> float:
    """`got` (the stages' outputs, one row per micro-batch) against `want` (the oracle's): bit for
    bit where `hosts_env`, the environment the stages ran in, has the oracle's BLAS variables, else
    (or None: not this process's, as over SSH) within the tolerance. Prints the largest difference
    and returns it."""
    assert got.shape == want.shape and got.dtype == want.dtype, \
        f"{what}: {got.dtype}{list(got.shape)} vs the oracle's {want.dtype}{list(want.shape)}"
    a, b = got.astype(np.float64), want.astype(np.float64)
    diff = float(np.max(np.abs(a - b), initial=0.0))
    scale = float(np.max(np.abs(b), initial=0.0))
    exact = hosts_env is not None and blas_environment(hosts_env) == oracle_environment()
    rtol = tolerance(want.dtype, ACROSS_HOSTS_RTOL)
    how = ("bit for bit (the hosts ran with this process's BLAS environment)" if exact else
           f"within rtol {rtol:g} and atol {rtol:g} x the scale (the hosts' BLAS kernels may differ from "
           "this process's)")
    note = (f"{what}: {int(np.sum(a != b))} of {a.size} values differ from the single-process run, largest "
            f"difference {diff:.3g} ({diff / scale if scale else 0.0:.3g} of the output's scale {scale:.3g}); "
            f"compared {how}; this process's BLAS environment: {oracle_environment()}")
    print(f"\n{note}")
    if exact:
        np.testing.assert_array_equal(got, want, err_msg=note)
    else:
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, err_msg=note)
    return diff
