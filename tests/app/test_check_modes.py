"""`tvmpipe run --check`: the single-process oracle streamed stage by stage (default), whole, or
not at all; the output says what was checked (issue 25, "the driver never holds the whole model")."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.support.synthetic_bundles import write_dense_stack
from tvmpipe.app.oracle import reference_outputs
from tvmpipe.bundle import load_bundle
from tvmpipe.cli import main
from tvmpipe.executor.inputs import random_micro_batches
from tvmpipe.partition import plan_equal_ops


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Path:
    return write_dense_stack(tmp_path_factory.mktemp("stack") / "stack", layers=5, width=16)


def test_streamed_oracle_equals_the_whole_model_bit_for_bit(stack: Path):
    bundle = load_bundle(stack)
    batches = random_micro_batches(bundle, 3, 0)
    whole = reference_outputs(stack, batches)
    for k in (1, 2, 4):
        streamed = reference_outputs(stack, batches, stages=plan_equal_ops(bundle.graph, k).stages)
        assert len(streamed) == len(whole)
        for a, b in zip(streamed, whole):
            assert [x.tobytes() for x in a] == [y.tobytes() for y in b]


@pytest.mark.parametrize("check, words", [("streamed", "streamed stage by stage"), ("full", "whole model"),
                                          ("none", "nothing")])
def test_run_says_what_was_checked(stack: Path, capsys, check: str, words: str):
    code = main(["run", str(stack), "--stages", "2", "--processes", "-n", "3", "--check", check])
    out, err = capsys.readouterr()
    assert code == 0, (out, err)
    assert f"checked: " in out and words in out, out
    assert ("not checked" in out) == (check == "none"), out
    assert "weights resident" in out, out
    if check != "none":
        assert "outputs match single-process run: yes (3/3" in out, out
