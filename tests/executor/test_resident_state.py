"""State a stage keeps resident is held once (executor/program.py `resident_state`).

A Stage with state slots points each state pair's input and output at SlotState's own buffers
before every run, so the storage plan gives those entries no bytes: before, every backend also
allocated a static cache's input and output a slot of their own (and cuda page-locked host
buffers), which no run read. The zoo's GPT-2 static step at batch 2 as one stateful stage: its
cache entries take no bytes of the storage plan (which is smaller by at least the caches' output
bytes, which the fed plan keeps to the end of a run), nothing is staged through
the host for them on the strict fake PyCUDA, and the greedy tokens and logits equal the
single-process loop's (executor/decode_loop.py, which feeds the caches as ordinary inputs).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tvm")
pytestmark = pytest.mark.tvm

B = 2
PROMPTS = [[5, 17, 3], [7, 8, 60]]
NEW = 6


def _greedy_on_stage(stage, bundle) -> tuple[list[list[int]], list[np.ndarray]]:
    """Greedy steps through `stage` (state slot 0, fresh at the first step): the loop greedy_decode
    runs, with the caches held by the stage."""
    feeds = stage.program.input_entries
    seqs = [list(p) for p in PROMPTS]
    logs = []
    for pos in range(len(PROMPTS[0]) + NEW - 1):
        inputs = {feeds["input_ids"]: np.array([[s[pos]] for s in seqs], np.int64),
                  feeds["position"]: np.full(B, pos, np.int64),
                  stage.slot_entry: np.array([0] + [int(pos == 0)] * B, np.int64)}
        logits = stage.run(inputs)[bundle.graph.head_entries[0]].reshape(B, -1)
        logs.append(logits.copy())
        if pos + 1 >= len(PROMPTS[0]):
            for b in range(B):
                seqs[b].append(int(logits[b].argmax()))
    return [s[len(PROMPTS[0]):] for s in seqs], logs


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_static_caches_are_held_once_by_a_stateful_stage(zoo_decoder, backend, monkeypatch, tmp_path):
    from tvmpipe.bundle import load_bundle
    from tvmpipe.executor.decode_loop import greedy_decode
    from tvmpipe.executor.program import build_stage_program
    from tvmpipe.executor.stage import Stage

    path = zoo_decoder("gpt2", B, kv="static")[0]
    b = load_bundle(path)
    assert b.state and all(p.scope == "slot" for p in b.state)
    want = greedy_decode(b, PROMPTS, NEW)
    if backend == "cuda":
        from tests.support.fake_cuda import activate

        activate(monkeypatch, tmp_path / "cubins", [path])
        import pycuda.driver as drv
    n = len(b.graph.nodes)
    fed = build_stage_program(b, 0, n)
    stage = Stage(b, 0, n, backend, state_slots=2)
    held = {stage.program.input_entries[p.input] for p in b.state} | {b.graph.head_entries[p.output] for p in b.state}
    assert stage.program.resident == held
    plan = stage.program.storage
    assert {plan.slots[plan.entry_slot[e]].nbytes for e in held} == {0}  # one shared empty slot
    # the fed plan keeps the caches' outputs to the end of the run (nothing reuses them): at least
    # that much is saved (the inputs' bytes are reused by later activations there, in part)
    outputs = sum(fed.entry_specs[b.graph.head_entries[p.output]].nbytes for p in b.state)
    assert fed.storage.total_bytes() - plan.total_bytes() >= outputs > 0
    if backend == "cuda":
        assert not held & (set(stage.backend.host_in) | set(stage.backend.host_out))
    tokens, logs = _greedy_on_stage(stage, b)
    stage.close()
    assert tokens == want.tokens
    for a, c in zip(want.logits, logs):
        np.testing.assert_allclose(c, a, rtol=1e-5, atol=1e-5)
    if backend == "cuda":
        assert not drv.violations
