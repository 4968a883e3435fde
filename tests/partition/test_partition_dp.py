"""The DP planner against brute force over every plan, on random small DAGs, with a naive
stage-cost reference (tests/support/random_graphs.py: Reference) so the range tables are checked too."""

from __future__ import annotations

import random

import pytest

from tests.support.random_graphs import Reference, brute_force, isclose, random_bundle, random_profile
from tvmpipe.partition import PartitionError, validate_plan
from tvmpipe.partition.devices import Link
from tvmpipe.partition.model import PipelineModel
from tvmpipe.partition.planners import OptimalPlanner, plan_optimal
from tvmpipe.partition.predict import predict

CASES = 120


def _setup(seed: int):
    rng = random.Random(seed)
    bundle, inputs, ws = random_bundle(rng, rng.randint(1, 12))
    profile = random_profile(rng, bundle)
    link = Link(bandwidth=rng.choice([1e6, 1e7, 1e9]), latency_us=rng.choice([0.0, 5.0]))
    return rng, bundle, inputs, ws, profile, link


@pytest.mark.parametrize("seed", range(CASES))
def test_tables_match_naive_reference(seed):
    rng, bundle, inputs, ws, profile, link = _setup(seed)
    model = PipelineModel.build(bundle, profile=profile, inputs=inputs, link=link)
    times = list(model.costs.time_us)
    ref = Reference(bundle, inputs, times, ws, link.bandwidth, link.latency_us)
    n = model.num_ops
    for a in range(n):
        for b in range(a + 1, n + 1):
            assert model.tables.recv[a, b] == ref.nbytes(ref.recv(a, b)), (a, b)
            assert model.tables.send[a, b] == ref.nbytes(ref.send(a, b)), (a, b)
            assert model.stage_memory(a, b) == ref.memory(a, b), (a, b)
            assert isclose(model.stage_time_us(a, b, 0.5), ref.time(a, b, 0.5))


@pytest.mark.parametrize("seed", range(CASES))
def test_dp_equals_brute_force(seed):
    rng, bundle, inputs, ws, profile, link = _setup(seed)
    base = PipelineModel.build(bundle, profile=profile, inputs=inputs, link=link)
    n = base.num_ops
    ref = Reference(bundle, inputs, list(base.costs.time_us), ws, link.bandwidth, link.latency_us)
    mems = sorted(ref.memory(a, b) for a in range(n) for b in range(a + 1, n + 1))
    for k in range(1, min(4, n) + 1):
        for variant in ("plain", "speeds", "caps", "both"):
            speeds = [rng.choice([0.5, 1.0, 2.0]) for _ in range(k)] if variant in ("speeds", "both") else [1.0]
            caps = [rng.choice(mems) for _ in range(k)] if variant in ("caps", "both") else [None]
            tol = rng.choice([0.0, 0.01, 0.2])
            model = PipelineModel.build(bundle, profile=profile, inputs=inputs, link=link,
                                        speeds=speeds, memory_caps=caps)
            want = brute_force(ref, k, model.stage_speeds(k), model.stage_caps(k), tol)
            if want is None:
                with pytest.raises(PartitionError, match="fits the memory caps"):
                    plan_optimal(model, k, tol)
                continue
            plan = plan_optimal(model, k, tol)
            validate_plan(bundle.graph, plan)
            got = predict(model, plan)
            assert got.fits_memory
            assert len(got.stages) == k
            best, fewest = want
            # the chosen plan is within tolerance of the brute-force optimum ...
            assert got.bottleneck_us <= best * (1 + tol) + 1e-9 * max(best, 1.0)
            assert got.bottleneck_us >= best * (1 - 1e-9)
            # ... and moves no more bytes than any plan within it
            assert got.bytes_moved == fewest
            if tol == 0.0:
                assert isclose(got.bottleneck_us, best)


@pytest.mark.parametrize("seed", range(40))
def test_one_planner_for_every_stage_count_equals_brute_force(seed):
    """A sweep plans K = 1..max with one OptimalPlanner (tables and the first pass shared, the second
    pass only over stages that fit under K's threshold): every K against brute force, in any order."""
    rng, bundle, inputs, ws, profile, link = _setup(10_000 + seed)
    base = PipelineModel.build(bundle, profile=profile, inputs=inputs, link=link)
    n = base.num_ops
    ref = Reference(bundle, inputs, list(base.costs.time_us), ws, link.bandwidth, link.latency_us)
    mems = sorted(ref.memory(a, b) for a in range(n) for b in range(a + 1, n + 1))
    kmax = min(5, n)
    speeds = [rng.choice([0.5, 1.0, 2.0]) for _ in range(kmax)]
    caps = [rng.choice(mems[len(mems) // 2:]) for _ in range(kmax)] if rng.random() < 0.5 else [None]
    tol = rng.choice([0.0, 0.01, 0.2])
    model = PipelineModel.build(bundle, profile=profile, inputs=inputs, link=link, speeds=speeds, memory_caps=caps)
    planner = OptimalPlanner(model, tol)
    order = list(range(1, kmax + 1))
    rng.shuffle(order)  # the shared first pass grows on demand: a later K must not depend on an earlier one
    for k in order:
        want = brute_force(ref, k, model.stage_speeds(k), model.stage_caps(k), tol)
        if want is None:
            with pytest.raises(PartitionError, match="fits the memory caps"):
                planner.plan(k)
            continue
        got = predict(model, planner.plan(k))
        best, fewest = want
        assert best * (1 - 1e-9) <= got.bottleneck_us <= best * (1 + tol) + 1e-9 * max(best, 1.0)
        assert got.bytes_moved == fewest
        assert planner.plan(k).stages == plan_optimal(model, k, tol).stages
