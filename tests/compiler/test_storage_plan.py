"""The graph.json storage plan: reuse only across non-overlapping lifetimes (no TVM needed)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tvmpipe.compiler.graphjson import GNode, plan_storage


def op(name: str, inputs: list[tuple[int, int]], n_out: int = 1, size: int = 256, nop: bool = False) -> GNode:
    return GNode("tvm_op", name, inputs, "__nop" if nop else f"f_{name}", [([size // 4], "float32")] * n_out)


def null(name: str, size: int = 256) -> GNode:
    return GNode("null", name, outputs=[([size // 4], "float32")])


def test_chain_reuses_storage_two_steps_back():
    nodes = [null("x"), op("a", [(0, 0)]), op("b", [(1, 0)]), op("c", [(2, 0)]), op("d", [(3, 0)])]
    assert plan_storage(nodes, heads=[(4, 0)]) == [0, 1, 2, 1, 2]


def test_inputs_params_and_heads_are_never_reused():
    nodes = [null("x"), null("w"), op("a", [(0, 0), (1, 0)]), op("b", [(2, 0)]), op("c", [(3, 0)]),
             op("d", [(4, 0)])]
    sids = plan_storage(nodes, heads=[(3, 0), (5, 0)])
    assert len({sids[0], sids[1], sids[3]}) == 3
    assert sids[3] not in (sids[0], sids[1], sids[2], sids[4], sids[5])


def test_nop_shares_its_input_storage_and_extends_its_life():
    nodes = [null("x"), op("a", [(0, 0)]), op("r", [(1, 0)], nop=True), op("b", [(0, 0)]), op("c", [(2, 0), (3, 0)])]
    sids = plan_storage(nodes, heads=[(4, 0)])
    assert sids[2] == sids[1]
    assert sids[3] != sids[1]  # a is still alive through its reshape when b is written


def test_very_different_sizes_do_not_share():
    nodes = [null("x"), op("a", [(0, 0)], size=4), op("b", [(1, 0)], size=4 << 20), op("c", [(2, 0)], size=4)]
    sids = plan_storage(nodes, heads=[(3, 0)])
    assert sids[3] == sids[1]  # small reuses small
    nodes = [null("x"), op("a", [(0, 0)], size=4), op("b", [(1, 0)], size=4), op("c", [(2, 0)], size=4 << 20)]
    sids = plan_storage(nodes, heads=[(3, 0)])
    assert sids[3] not in sids[:3]  # 1 MiB does not grow a 4-byte block (outside the match range)


@st.composite
def graphs(draw):
    n_null = draw(st.integers(1, 3))
    nodes = [null(f"in{i}", draw(st.sampled_from([64, 256, 1024]))) for i in range(n_null)]
    entries = [(i, 0) for i in range(n_null)]
    for k in range(draw(st.integers(1, 14))):
        if draw(st.booleans()) and k:
            src = draw(st.sampled_from(entries[n_null:] or entries))
            size = 4 * nodes[src[0]].outputs[src[1]][0][0]
            nodes.append(op(f"n{k}", [src], size=size, nop=True))
        else:
            ins = draw(st.lists(st.sampled_from(entries), min_size=1, max_size=3))
            n_out = draw(st.integers(1, 2))
            nodes.append(op(f"n{k}", ins, n_out, size=draw(st.sampled_from([64, 256, 1024, 8192]))))
        entries.extend((len(nodes) - 1, i) for i in range(len(nodes[-1].outputs)))
    heads = [(len(nodes) - 1, 0)] + draw(st.lists(st.sampled_from(entries[n_null:]), max_size=2))
    return nodes, heads


@settings(max_examples=200, deadline=None)
@given(graphs())
def test_no_two_live_tensors_share_storage(g):
    nodes, heads = g
    sids = plan_storage(nodes, heads)
    row = [0]
    for n in nodes:
        row.append(row[-1] + len(n.outputs))
    eid = lambda ref: row[ref[0]] + ref[1]  # noqa: E731
    owner = [nid for nid, n in enumerate(nodes) for _ in n.outputs]
    # follow __nop aliases to the entry that owns the memory
    root = list(range(row[-1]))
    for nid, n in enumerate(nodes):
        if n.func_name == "__nop":
            root[row[nid]] = root[eid(n.inputs[0])]
            assert sids[row[nid]] == sids[eid(n.inputs[0])]
    born = {r: owner[r] for r in set(root)}
    last = {r: owner[r] for r in set(root)}
    for nid, n in enumerate(nodes):
        for ref in n.inputs:
            last[root[eid(ref)]] = max(last[root[eid(ref)]], nid)
    for ref in heads:
        last[root[eid(ref)]] = len(nodes)
    for r in born:
        if nodes[owner[r]].op == "null":
            last[r] = len(nodes)
    roots = sorted(born)
    for i, a in enumerate(roots):
        for b in roots[i + 1:]:
            if sids[a] == sids[b]:
                first, second = (a, b) if born[a] <= born[b] else (b, a)
                assert born[second] > last[first], f"entries {first} and {second} share storage {sids[a]} while both live"
