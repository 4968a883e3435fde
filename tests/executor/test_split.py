"""Running the stages of a split one after another reproduces the whole graph bit for bit.

Every contiguous 2-way and 3-way split of each model, on the reference backend. Stages are fed
exactly as the pipeline feeds them: graph inputs from the driver, boundary entries from the
producing stage's outputs (skip connections straight to every consumer).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tests.support.executor_cases import CPU_MODELS, get_bundle
from tvmpipe.executor import Stage, feeds_by_entry, random_inputs


class StageCache:
    """Stages of one bundle by range, built once; a stage is deterministic, so its outputs are
    memoised by the exact bytes it was fed (the memo cannot hide a difference in what it gets)."""

    def __init__(self, bundle):
        self.bundle = bundle
        self.stages: dict[tuple[int, int], Stage] = {}
        self.memo: dict[tuple, dict[int, np.ndarray]] = {}

    def run(self, start: int, end: int, values: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        stage = self.stages.get((start, end))
        if stage is None:
            stage = self.stages[(start, end)] = Stage(self.bundle, start, end)
        feeds = {e: values[e] for e in stage.program.feed_entries}
        key = (start, end) + tuple((e, v.tobytes()) for e, v in sorted(feeds.items()))
        if key not in self.memo:
            self.memo[key] = stage.run(feeds)
        return self.memo[key]


def run_split(cache: StageCache, cuts: tuple[int, ...], inputs: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    n = len(cache.bundle.graph.nodes)
    bounds = (0,) + cuts + (n,)
    values = dict(inputs)
    for a, b in zip(bounds, bounds[1:]):
        sent = cache.run(a, b, values)
        consumers = cache.bundle.graph.consumers
        heads = set(cache.bundle.graph.head_entries)
        for e in sent:  # a stage sends only what a later stage or the driver needs
            assert e in heads or any(c >= b for c in consumers[e]), f"stage [{a}, {b}) sends unneeded entry {e}"
        values.update(sent)
    return values


@pytest.mark.parametrize("model", CPU_MODELS)
def test_splits_bit_identical(bundles, model):
    bundle = get_bundle(bundles, model)
    n = len(bundle.graph.nodes)
    inputs = feeds_by_entry(bundle, random_inputs(bundle, seed=3))
    cache = StageCache(bundle)
    whole = run_split(cache, (), inputs)
    heads = bundle.graph.head_entries
    for k in (1, 2):
        for cuts in itertools.combinations(range(1, n), k):
            got = run_split(cache, cuts, inputs)
            for h in heads:
                assert got[h].dtype == whole[h].dtype and got[h].shape == whole[h].shape
                assert got[h].tobytes() == whole[h].tobytes(), f"{model}: split at {cuts} changes head entry {h}"


def test_tiny_matches_formula(bundles):
    from tests.support.tiny_bundle import tiny_expected

    b = bundles["tiny"]
    x = np.random.default_rng(0).standard_normal((1, 4)).astype(np.float32)
    with Stage(b, 0, len(b.graph.nodes)) as s:
        out = s.run({0: x})
    np.testing.assert_allclose(out[5], tiny_expected(x, b.params), rtol=1e-6)


def test_repeat_runs_deterministic(bundles):
    b = bundles["convnet"]
    inputs = feeds_by_entry(b, random_inputs(b, seed=1))
    s = Stage(b, 0, len(b.graph.nodes))
    first = s.run(inputs)
    again = Stage(b, 0, len(b.graph.nodes)).run(inputs)
    second = s.run(inputs)
    for e in first:
        assert first[e].tobytes() == second[e].tobytes() == again[e].tobytes()
