"""Which of dlight's rules schedules a function, tried in order as compiler/export.py's
_schedule_one tries them (a rule that raises is passed over), on sm_90."""

from __future__ import annotations

from typing import Any, Sequence


def rule_taken(name: str, func: Any, rules: Sequence[Any]) -> str | None:
    """The class name of the first of `rules` that schedules `func`, or None."""
    import tvm
    import tvm.s_tir.dlight as dl

    from tvmpipe.compiler import launches

    for rule in rules:
        try:
            with launches.cuda_target("sm_90"):
                got = dl.ApplyDefaultSchedule(rule)(tvm.IRModule({name: func}))[name]
        except Exception:  # noqa: BLE001 - export goes on to the next rule too
            continue
        if got.attrs is not None and "tirx.is_scheduled" in got.attrs:
            return type(rule).__name__
    return None
