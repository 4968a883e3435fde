"""The run directory: files appear complete or not at all, and results are never mixed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tvmpipe.deploy.rundir import RunDir, RunDirError, default_run_dir


def test_default_name_sorts_by_time_and_names_the_model(tmp_path):
    p = default_run_dir("resnet/18 v1", root=tmp_path, now=0)
    assert p.parent == tmp_path
    assert p.name.endswith("-resnet_18_v1") and p.name[:8].isdigit()


def test_existing_nonempty_dir_is_refused_unless_unique(tmp_path):
    first = RunDir.create(tmp_path / "r")
    first.write_json("a.json", {})
    with pytest.raises(RunDirError, match="already holds files"):
        RunDir.create(tmp_path / "r")
    second = RunDir.create(tmp_path / "r", unique=True)
    assert second.path == tmp_path / "r-1"
    assert RunDir.create(tmp_path / "r-1").path == second.path  # empty: reused


def test_writes_leave_no_temporaries_and_roundtrip(tmp_path):
    rd = RunDir.create(tmp_path / "r")
    rd.write_json("m.json", {"x": np.float32(1.5), "a": np.arange(2)})
    rd.write_npz("o.npz", {"output0": np.ones((2, 3), np.float32)})
    assert sorted(p.name for p in rd.path.iterdir()) == ["m.json", "o.npz"]
    assert json.loads((rd.path / "m.json").read_text()) == {"x": 1.5, "a": [0, 1]}
    np.testing.assert_array_equal(np.load(rd.path / "o.npz")["output0"], np.ones((2, 3)))


def test_failed_write_keeps_the_previous_file_and_no_temporary(tmp_path):
    rd = RunDir.create(tmp_path / "r")
    rd.write_json("m.json", {"v": 1})

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with rd.writing("m.json") as tmp:
            tmp.write_text('{"v": 2, "trunc')  # half-written when the writer dies
            raise Boom
    assert json.loads((rd.path / "m.json").read_text()) == {"v": 1}
    assert [p.name for p in rd.path.iterdir()] == ["m.json"]


def test_temporary_keeps_suffix_for_format_sniffing_writers(tmp_path):
    rd = RunDir.create(tmp_path / "r")
    with rd.writing("timeline.png") as tmp:
        assert tmp.suffix == ".png" and tmp.name.startswith(".") and tmp.parent == rd.path
        tmp.write_bytes(b"\x89PNG")
    assert rd.files() == ["timeline.png"]


def test_log_is_published_under_its_final_name_at_the_end(tmp_path):
    rd = RunDir.create(tmp_path / "r")
    rd.partial_log.write_text("line\n")
    assert rd.files() == ["job.log.partial"]
    rd.finish_log()
    assert rd.files() == ["job.log"]
