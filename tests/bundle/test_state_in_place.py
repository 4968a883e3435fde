"""Which state pairs a stage may update in place (bundle.state.updated_in_place): one buffer a
sequence slot where the new value's element i depends on the old value's element i alone, two
buffers (read one, write the other) for any other form."""

from __future__ import annotations

import dataclasses

import pytest

from tvmpipe.bundle import load_bundle
from tvmpipe.bundle.manifests import Ref
from tvmpipe.bundle.state import updated_in_place


def _update(b, pair):
    """The fused function producing `pair`'s output, the index of its op reading the cache
    argument, and that argument's index."""
    g = b.graph
    node = g.nodes[g.entries[g.head_entries[pair.output]].node]
    e_in = g.entry_id(g.node_index[pair.input])
    arg = g.input_entry_ids(node.index).index(e_in)
    fn = b.ops[node.func_name]
    op = next(i for i, o in enumerate(fn.ops) if any(r.kind == "arg" and r.index == arg for r in o.inputs))
    return node.func_name, fn, op, arg


def test_a_decode_steps_cache_update_is_in_place(decode_bundle):
    """`where(arange(T) == pos, new, cache)`: every pair of the fixture, one buffer a slot."""
    b = load_bundle(decode_bundle)
    assert b.state_buffers == {p.name: 1 for p in b.state}
    assert b.state_resident_bytes_per_slot == b.state_bytes_per_slot
    name, fn, op, _ = _update(b, b.state[0])
    assert fn.ops[op].op == "where" and fn.outputs == [Ref("op", op)]


@pytest.mark.parametrize("edit", ["not elementwise", "read twice", "not the output", "other shape", "two launches"])
def test_any_other_update_keeps_two_buffers(decode_bundle, edit):
    """The cache read by a transpose, by a second op of the function, by an op whose result is not
    the function's output, or broadcast into a larger output, or a function of two kernel launches
    (the first could use the output as scratch): two buffers."""
    b = load_bundle(decode_bundle)
    pair = b.state[0]
    name, fn, op, arg = _update(b, pair)
    ops = list(fn.ops)
    rec = ops[op]
    if edit == "not elementwise":
        ops[op] = dataclasses.replace(rec, op="permute_dims")
    elif edit == "read twice":  # a second reader after the update (still the output)
        ops.append(dataclasses.replace(rec, op="negative", inputs=[Ref("arg", arg)]))
    elif edit == "not the output":
        ops.append(dataclasses.replace(rec, op="negative", inputs=[Ref("op", op)]))
    else:
        ops[op] = dataclasses.replace(rec, output_shapes=[[2, *rec.output_shapes[0]]])
    outputs = [Ref("op", len(ops) - 1)] if edit == "not the output" else fn.outputs
    edited = {**b.ops, name: dataclasses.replace(fn, ops=ops, outputs=outputs)}
    kf = b.kernels[name]
    kernels = {**b.kernels, name: dataclasses.replace(kf, launches=[*kf.launches, *kf.launches])}
    assert updated_in_place(b.graph, b.ops, b.kernels, pair)
    if edit == "two launches":
        assert not updated_in_place(b.graph, b.ops, kernels, pair)
    else:
        assert not updated_in_place(b.graph, edited, b.kernels, pair)
