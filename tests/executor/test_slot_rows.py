"""One row of a static batch's state slot reset alone (issue 24: a queued sequence takes the row of a
group whose sequence finished while its row-mates run on; docs/generation.md, "Static batches").

A batch-2 GPT-2 decode step (`tvmpipe compile gpt2 --decode --batch 2 --kv static`) as one stateful stage: a
step whose `__slot__` tag marks one row fresh resets that row of every cache and leaves the other
row's as it was, on the reference backend (NumPy buffers) and on the strict fake CUDA driver
(device buffers, reset by copies at the row's offset); a state whose leading axis is not the rows
is refused in one line naming the pair.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tvm")
pytest.importorskip("transformers")
pytestmark = [pytest.mark.tvm, pytest.mark.slow]


def _stage(bundle, backend: str):
    from tvmpipe.bundle import load_bundle
    from tvmpipe.executor import Stage

    b = load_bundle(bundle)
    return Stage(b, 0, len(b.graph.nodes), backend=backend, state_slots=2)


def _caches(stage) -> list[np.ndarray]:
    """Slot 1's current value of every state pair, on the host."""
    out = []
    for (_, e, _), pair in zip(stage.state.pairs, stage.state.buffers[1]):
        buf = pair[0]
        if isinstance(buf, np.ndarray):
            out.append(buf.copy())
            continue
        import pycuda.driver as drv

        spec = stage.program.entry_specs[e]
        host = np.empty(tuple(spec.shape), dtype=np.float32)
        with stage.backend.dev.current():
            drv.memcpy_dtoh(host, buf)
        out.append(host)
    return out


def _feed(stage, slot_tag: list[int], positions: list[int]) -> dict:
    from tvmpipe.executor.inputs import input_entry_ids

    ids = input_entry_ids(stage.bundle)
    return {ids["input_ids"]: np.array([[5], [9]], dtype=np.int64),
            ids["position"]: np.array(positions, dtype=np.int64), stage.slot_entry: np.array(slot_tag)}


def _check_row_reset(stage) -> None:
    stage.run(_feed(stage, [1, 1, 1], [0, 0]))  # both rows start: the whole slot
    stage.run(_feed(stage, [1, 0, 0], [1, 1]))
    before = _caches(stage)
    assert all(np.abs(c[:, :, :2]).max() > 0 for c in before)  # both rows wrote positions 0 and 1
    stage.run(_feed(stage, [1, 0, 1], [2, 0]))  # row 1 starts a new sequence, row 0 goes on at 2
    after = _caches(stage)
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a[0, :, :2], b[0, :, :2])  # row 0's history is kept...
        assert np.abs(a[0, :, 2]).max() > 0  # ...and it wrote its position 2
        assert np.abs(a[1, :, 0]).max() > 0 and not a[1, :, 1:].any()  # row 1: reset, then position 0 written


def test_a_fresh_row_resets_that_row_only_on_the_reference_backend(zoo_decoder):
    bundle, _ = zoo_decoder("gpt2", 2, kv="static")
    _check_row_reset(_stage(bundle, "reference"))


def test_a_fresh_row_resets_that_row_only_on_the_strict_fake_cuda_driver(zoo_decoder, tmp_path, monkeypatch):
    import sys

    from tests.support.fake_cuda import activate

    bundle, _ = zoo_decoder("gpt2", 2, kv="static")
    activate(monkeypatch, tmp_path, [bundle])
    import pycuda.driver as drv

    try:
        stage = _stage(bundle, "cuda")
        assert not isinstance(stage.state.buffers.get(1, [[None]])[0][0], np.ndarray)
        _check_row_reset(stage)
        assert not drv.violations
    finally:
        for name in [m for m in sys.modules if m == "pycuda" or m.startswith("pycuda.")]:
            del sys.modules[name]


def test_a_row_reset_needs_the_rows_on_the_state_s_leading_axis(zoo_decoder):
    from tvmpipe.bundle import load_bundle
    from tvmpipe.bundle.decode_layout import slot_layout
    from tvmpipe.executor.errors import InputError

    two, _ = zoo_decoder("gpt2", 2, kv="static")
    one, _ = zoo_decoder("gpt2", kv="static")
    assert slot_layout(load_bundle(two)).row_reset and not slot_layout(load_bundle(one)).row_reset
    assert slot_layout(load_bundle(two)).spec.shape == (3,) and slot_layout(load_bundle(one)).spec.shape == (2,)
    stage = _stage(two, "reference")
    stage.run(_feed(stage, [1, 1, 1], [0, 0]))
    with pytest.raises(InputError) as e:  # three rows named, the caches have two
        stage.run(_feed(stage, [1, 0, 1, 0], [1, 1]))
    msg = str(e.value)
    assert "\n" not in msg and "state pair 'layer0.k' [2, 4, 20, 16] has no leading axis of the 3 rows" in msg, msg
    stage.run(_feed(stage, [1, 1, 1, 1], [0, 0]))  # every row fresh: the whole slot, whatever the count
