"""The Ray launcher's ship path sends each node one shipment with only the weights of the stages
placed there (issue 25, "Distribution"); every actor reads only its own tensors of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.pipeline_harness import assert_bit_identical, case
from tests.support.synthetic_bundles import write_dense_stack
from tvmpipe.bundle import load_bundle
from tvmpipe.bundle.weights import DATA_ALIGN
from tvmpipe.cluster.control.ray_actors import RayLauncher
from tvmpipe.cluster.driver import Pipeline
from tvmpipe.cluster.control.placement import Placement
from tvmpipe.cluster.control.shipping import stage_param_names
from tvmpipe.partition import plan_equal_ops

pytestmark = pytest.mark.ray


def test_one_shipment_per_node_and_each_actor_reads_its_own(ray_cluster, tmp_path: Path):
    path = write_dense_stack(tmp_path / "stack", layers=6, width=32)
    bundle = load_bundle(path)
    plan = plan_equal_ops(bundle.graph, 3)
    inputs, want = case(path, 4)
    small = sum(p.stat().st_size for p in path.iterdir() if p.name != "params.safetensors")
    launcher = RayLauncher(Placement(cpus=0.25), ship_bundle=True)
    launcher.ship_same_node = True  # one machine: ship to the driver's node too
    with Pipeline(path, plan, launcher=launcher) as pipe:
        assert_bit_identical(pipe.run(inputs), want)
        stats = pipe.launcher.call_all("stats")
        shipped, tensors = dict(pipe.launcher.shipped), dict(pipe.launcher.shipped_tensors)
    assert len(shipped) == 1, "one node: one shipment, taken by all three actors"
    (node, nbytes), = shipped.items()
    assert set(tensors[node]) == set(bundle.param_names)
    assert small + bundle.weight_bytes < nbytes <= small + bundle.weight_bytes + DATA_ALIGN
    for i, (start, end) in enumerate(plan.stages):
        own = sum(bundle.param_nbytes(n) for n in stage_param_names(bundle, start, end))
        assert stats[i].shipped_bytes == nbytes and stats[i].weight_bytes == own
        assert own < stats[i].weights_read <= own + DATA_ALIGN, "only its own tensors (and the header) were read"


def test_stages_on_the_drivers_node_read_the_bundle_in_place(ray_cluster, tmp_path: Path):
    """ship_bundle on a node that can read the path: nothing is sent, each stage reads its tensors."""
    path = write_dense_stack(tmp_path / "stack", layers=4, width=16)
    bundle = load_bundle(path)
    plan = plan_equal_ops(bundle.graph, 2)
    inputs, want = case(path, 3)
    with Pipeline(path, plan, launcher="ray", placement=Placement(cpus=0.25), ship_bundle=True) as pipe:
        assert_bit_identical(pipe.run(inputs), want)
        stats = pipe.launcher.call_all("stats")
        assert pipe.launcher.shipped == {}
    for i, (start, end) in enumerate(plan.stages):
        own = sum(bundle.param_nbytes(n) for n in stage_param_names(bundle, start, end))
        assert stats[i].shipped_bytes == 0 and own < stats[i].weights_read <= own + DATA_ALIGN
