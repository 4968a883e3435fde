"""StageProgram: boundaries, launch bindings and the storage plan, on every CPU test model."""

from __future__ import annotations

import pytest

from tests.support.executor_cases import CPU_MODELS, check_storage, get_bundle
from tvmpipe.executor import ExecutorError, build_stage_program


def test_tiny_whole_graph(bundles):
    b = bundles["tiny"]
    p = build_stage_program(b, 0, len(b.graph.nodes))
    assert p.op_nodes == [3, 4, 5]
    assert p.input_entries == {"x": 0}
    assert p.param_entries == {"w": 1, "b": 2}
    assert p.recv_entries == [] and p.send_entries == [5]
    assert [s.kind for s in p.steps] == ["kernels", "nop", "kernels"]
    # __nop: the reshape output lives in the dense output's bytes
    assert p.storage.entry_slot[4] == p.storage.entry_slot[3]
    # the launch list, bound: args 0..2 are inputs, 3 the output; workspace; scalar by value
    l0, l1 = p.steps[0].launches
    st = p.storage
    assert [a.slot for a in l0.args] == [st.entry_slot[0], st.entry_slot[1], st.entry_slot[2],
                                         st.workspace_slot[("fused_dense_add_relu", 0)]]
    assert l1.args[0].slot == st.workspace_slot[("fused_dense_add_relu", 0)]
    assert (l1.args[1].entry, l1.args[2].kind, l1.args[2].value, l1.args[2].dtype) == (3, "scalar", 3, "int32")
    assert p.entry_specs[3] == ((1, 3), "float32")
    shape, dtype = p.entry_specs[0]
    assert (shape, dtype) == ((1, 4), "float32")


def test_tiny_boundaries(bundles):
    b = bundles["tiny"]
    first, second = build_stage_program(b, 0, 4), build_stage_program(b, 4, 6)
    assert first.send_entries == [3] and first.recv_entries == []
    assert second.recv_entries == [3] and second.send_entries == [5]
    assert second.param_names == [] and second.input_names == []
    # a stage of only null nodes runs nothing and needs nothing
    nulls = build_stage_program(b, 0, 3)
    assert nulls.steps == [] and nulls.feed_entries == [] and nulls.send_entries == []


def test_skipnet_boundaries(bundles):
    """Skip connections go straight to every consumer stage; a late consumer of the graph input
    receives it too; a __nop head produced early is sent as a graph output."""
    b = bundles["skipnet"]
    g = b.graph
    h1 = g.entry_id(g.node_index["dense1"])
    flat = g.entry_id(g.node_index["flat"])
    mix = g.node_index["mix"]
    p = build_stage_program(b, 0, g.node_index["dense2"])
    assert h1 in p.send_entries and flat in p.send_entries
    late = build_stage_program(b, mix, len(g.nodes))
    assert late.input_names == ["x"]
    split = g.node_index["split"]
    assert late.recv_entries == sorted([g.entry_id(split, 0), g.entry_id(split, 1),
                                        g.entry_id(g.node_index["dense3"])])


@pytest.mark.parametrize("model", CPU_MODELS)
def test_storage_plan_every_range(bundles, model):
    b = get_bundle(bundles, model)
    n = len(b.graph.nodes)
    for start in range(n):
        for end in range(start + 1, n + 1):
            check_storage(build_stage_program(b, start, end))


@pytest.mark.parametrize("model", CPU_MODELS)
def test_storage_is_reused(bundles, model):
    b = get_bundle(bundles, model)
    p = build_stage_program(b, 0, len(b.graph.nodes))
    acts = [s for s in p.storage.slots if s.kind == "activation"]
    produced = [e for s in p.steps if s.kind != "nop" for e in s.outputs]
    if len(produced) >= 4:
        assert len(acts) < len(produced) + len(p.feed_entries)


@pytest.mark.parametrize("model", CPU_MODELS)
def test_launches_match_bundle(bundles, model):
    b = get_bundle(bundles, model)
    g = b.graph
    p = build_stage_program(b, 0, len(g.nodes))
    for s in p.steps:
        if s.kind != "kernels":
            assert not s.launches
            continue
        want = b.kernels[s.func].launches
        assert [(l.kernel, l.grid, l.block, l.shared_mem) for l in s.launches] == \
               [(l.kernel, l.grid, l.block, l.shared_mem) for l in want]
        args = g.input_entry_ids(s.node) + list(g.node_entry_ids(s.node))
        for got, ref in zip(s.launches, want):
            for a, o in zip(got.args, ref.args):
                if o.kind == "arg":
                    assert a.entry == args[o.index] and a.slot == p.storage.entry_slot[args[o.index]]
                elif o.kind == "workspace":
                    assert a.slot == p.storage.workspace_slot[(s.func, o.index)]
                else:
                    assert (a.value, a.dtype) == (o.value, o.dtype)


def test_bad_ranges(bundles):
    b = bundles["tiny"]
    for start, end in [(0, 0), (3, 2), (-1, 3), (0, 7)]:
        with pytest.raises(ExecutorError, match=r"node range"):
            build_stage_program(b, start, end)
