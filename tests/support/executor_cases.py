"""The models the executor tests run over, and independent checks of a storage plan (written from
the rules, not from the planner's code: lifetimes are recomputed here from the steps).
"""

from __future__ import annotations

from tests.support.paths import EXAMPLES
from tvmpipe.bundle import Bundle
from tvmpipe.executor import StageProgram

CPU_MODELS = ("tiny", "skipnet", "convnet") + tuple(f"examples/{n}" for n in EXAMPLES)


def get_bundle(bundles: dict[str, Bundle], name: str) -> Bundle:
    """One of CPU_MODELS; every one is built (or committed), so a missing one is a failure, not a skip."""
    return bundles[name]


def alias_groups(program: StageProgram) -> dict[int, int]:
    """entry -> the entry that owns its bytes (following chains of __nop steps)."""
    root: dict[int, int] = {}
    for s in program.steps:
        if s.kind == "nop":
            root[s.outputs[0]] = root.get(s.inputs[0], s.inputs[0])
    return {e: root.get(e, e) for e in program.entry_specs}


def live_intervals(program: StageProgram) -> dict[int, tuple[int, int]]:
    """Per alias group root: [first step it must hold data, last step it must hold data], inclusive.

    Params live for the whole stage; fed entries from before step 0; sent entries to after the end.
    """
    n = len(program.steps)
    root = alias_groups(program)
    iv: dict[int, list[int]] = {}

    def touch(e: int, t: int) -> None:
        r = root[e]
        lo, hi = iv.get(r, [t, t])
        iv[r] = [min(lo, t), max(hi, t)]

    for e in program.param_entries.values():
        touch(e, -1)
        touch(e, n)
    for e in program.feed_entries:
        touch(e, -1)
    for i, s in enumerate(program.steps):
        for e in s.inputs + s.outputs:
            touch(e, i)
    for e in program.send_entries:
        touch(e, n)
    return {r: (lo, hi) for r, (lo, hi) in iv.items()}


def check_storage(program: StageProgram) -> None:
    """No two simultaneously-live tensors share a slot; __nop outputs share exactly their input's
    slot; every slot is big enough; workspaces and params never share with anything."""
    st = program.storage
    root = alias_groups(program)
    for e, spec in program.entry_specs.items():
        assert st.slots[st.entry_slot[e]].nbytes >= spec.nbytes, f"slot of entry {e} too small"
        assert st.entry_slot[e] == st.entry_slot[root[e]], f"__nop output {e} does not share its input's slot"
    iv = live_intervals(program)
    by_slot: dict[int, list[int]] = {}
    for r in iv:
        by_slot.setdefault(st.entry_slot[r], []).append(r)
    for slot, roots in by_slot.items():
        for i, a in enumerate(roots):
            for b in roots[i + 1:]:
                (a0, a1), (b0, b1) = iv[a], iv[b]
                assert a1 < b0 or b1 < a0, (f"entries {a} {iv[a]} and {b} {iv[b]} are live together "
                                            f"but share slot {slot}")
    ws = set(st.workspace_slot.values())
    assert not ws & set(st.entry_slot.values()), "a workspace shares a slot with a tensor"
    assert len(ws) == len(st.workspace_slot)
    params = {st.entry_slot[e] for e in program.param_entries.values()}
    others = {st.entry_slot[e] for e in program.entry_specs if root[e] not in program.param_entries.values()}
    assert not params & others, "a param shares a slot with an activation"
