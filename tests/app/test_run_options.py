"""`tvmpipe run` / `sweep` / `python -m tvmpipe.job` with bad options and files (issue 14, "Options and
files"): each is one line naming the option or file, a non-zero exit, and nothing started or
half-written. "Nothing started" is checked by making the first thing that would start workers or
Ray fail the test."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest

import tvmpipe.app.connect as connect
from tvmpipe.app.run import write_outputs
from tvmpipe.cli import main
from tvmpipe.core import files
from tvmpipe.core.errors import TvmpipeError


@pytest.fixture
def nothing_starts(monkeypatch):
    """Opening a cluster (Ray or worker processes) fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("a cluster was opened: the bad option was not caught up front")

    monkeypatch.setattr(connect, "open_cluster", refuse)
    import tvmpipe.cluster.control.local as local

    monkeypatch.setattr(local, "local_ray", refuse)


def one_line_error(capsys, argv: list[str], *needles: str) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.mark.parametrize("option, value, message", [
    ("--progress-timeout", "-5", "must be > 0"),  # killed the supervisor thread; the run hung at a fault
    ("--progress-timeout", "0", "must be > 0"),
    ("--progress-timeout", "nan", "must be > 0"),
    ("--window", "0", "must be >= 1"),  # was taken as "default"
    ("--max-restarts", "-1", "must be >= 0"),
    ("--stages", "0", "must be >= 1"),
    ("--micro-batches", "0", "must be >= 1"),
    ("--cpus-per-stage", "-1", "must be >= 0"),
    ("--window", "two", "expected an integer"),
])
def test_bad_option_values_are_one_line_naming_the_option(capsys, nothing_starts, option, value, message):
    for command in ("run", "sweep"):
        if command == "sweep" and option in ("--stages", "--micro-batches"):
            continue  # the sweep's own forms are tested below
        argv = [command] + (["examples-not-needed"] if command == "sweep" else []) + ["--processes", option, value]
        if command == "sweep":
            argv += ["-o", "unused"]
        one_line_error(capsys, argv, option, message)


def test_the_job_checks_the_same_options(capsys):
    from tvmpipe.deploy.job import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--processes", "--progress-timeout", "-5"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--progress-timeout" in err[0] and "must be > 0" in err[0]


@pytest.mark.parametrize("argv, message", [
    (["--stages", "0..2"], "expected 1 <= A <= B"),
    (["--stages", "x"], "expected K or A..B"),
    (["--strategies", "fastest"], "expected a comma-separated list of equal, optimal"),
    (["--time-scale", "0"], "must be > 0"),
])
def test_sweep_option_forms(capsys, nothing_starts, argv, message):
    one_line_error(capsys, ["sweep", "b", "--processes", "-o", "r", *argv], message)


def test_library_refuses_what_would_kill_or_hang_the_supervisor():
    from tvmpipe.cluster import Pipeline, Timeouts

    with pytest.raises(TvmpipeError, match="timeouts.progress must be > 0"):
        Timeouts(progress=-5)
    with pytest.raises(TvmpipeError, match="timeouts.call must be > 0"):
        Timeouts(call=0)
    for kwargs, message in (({"window": 0}, "window must be >= 1"), ({"max_restarts": -1}, "max_restarts must be >= 0")):
        with pytest.raises(TvmpipeError, match=message):  # raised before any worker is launched
            Pipeline(example_bundle(), 2, launcher="no launcher needed", **kwargs)


def example_bundle():
    from tvmpipe.app.sources import builtin_example

    return builtin_example()


@pytest.mark.parametrize("option", ["--save-outputs", "--trace"])
def test_output_into_a_missing_directory_fails_before_any_stage_runs(capsys, tmp_path, nothing_starts, option):
    target = tmp_path / "no" / "such" / "out.npz"
    line = one_line_error(capsys, ["run", "--processes", option, str(target)], option, str(target.parent),
                          "does not exist")
    assert not (tmp_path / "no").exists(), line


def test_output_that_is_a_directory_is_refused(capsys, tmp_path, nothing_starts):
    one_line_error(capsys, ["run", "--processes", "--save-outputs", str(tmp_path)], "--save-outputs",
                   "is a directory")


def test_good_outputs_and_a_bad_trace_write_nothing(capsys, tmp_path, nothing_starts):
    """Was: the whole run, out.npz written, then a traceback for the trace."""
    out = tmp_path / "out.npz"
    one_line_error(capsys, ["run", "--processes", "--save-outputs", str(out), "--trace",
                            str(tmp_path / "missing" / "t.json")], "--trace")
    assert list(tmp_path.iterdir()) == []


def _valid_npz(path):
    np.savez(path, x=np.ones((1, 100), np.float32))
    return path.read_bytes()


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "random", "npy", "empty"])
def test_unreadable_inputs_archive_is_one_line_naming_it(capsys, tmp_path, nothing_starts, damage):
    path = tmp_path / "in.npz"
    data = _valid_npz(path)
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "corrupt":  # the zip directory intact, the member's bytes garbage
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
            z.writestr("x.npy", b"\x93NUMPY" + bytes(range(256)) * 4)
    elif damage == "random":
        path.write_bytes(np.random.default_rng(0).bytes(4096))
    elif damage == "npy":
        np.save(path.with_suffix(".npy"), np.ones(3))
        path.write_bytes(path.with_suffix(".npy").read_bytes())
    else:
        path.write_bytes(b"")
    line = one_line_error(capsys, ["run", "--processes", "--inputs", str(path)], str(path))
    assert "allow_pickle" not in line and "pickle" not in line.lower()


@pytest.mark.parametrize("content", [b"stages: [[0, 3]]\n", b"\xff\xfe\x00garbage"])
def test_plan_that_is_not_json_names_its_path(capsys, tmp_path, nothing_starts, content):
    plan = tmp_path / "plan.json"
    plan.write_bytes(content)
    one_line_error_or_problems(capsys, ["run", "--processes", "--plan", str(plan)], str(plan))


def one_line_error_or_problems(capsys, argv, needle):
    """A PlanError lists its problems one per line under a one-line head: the head names the file."""
    code = main(argv)
    _, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err and needle in err, err


def test_local_run_finds_a_bad_plan_before_ray_starts(capsys, tmp_path, nothing_starts):
    """A plan that is valid JSON but does not fit the graph: was found only once Ray had started."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"format": "tvmpipe-plan", "version": 1, "strategy": "manual", "stages": [[0, 2]]}))
    code = main(["run", "--local", "--plan", str(plan)])
    _, err = capsys.readouterr()
    assert code == 2 and "1 problem in plan: " in err and err.count("\n") == 1 and "Traceback" not in err


def test_write_outputs_is_atomic_on_a_full_disk(tmp_path, monkeypatch):
    """np.savez straight to the name left an unreadable 8 KiB out.npz when the disk filled."""
    import errno

    real = np.lib.format.write_array

    def fill_disk(fp, array, *args, **kwargs):
        fp.write(b"\0" * 8192)
        raise OSError(errno.ENOSPC, "No space left on device")

    outputs = [[np.ones((1, 10), np.float32)] for _ in range(3)]
    write_outputs(tmp_path / "keep.npz", outputs)
    monkeypatch.setattr(np.lib.format, "write_array", fill_disk)
    with pytest.raises(OSError):
        write_outputs(tmp_path / "out.npz", outputs)
    with pytest.raises(OSError):
        write_outputs(tmp_path / "keep.npz", outputs)  # an existing file stays as it was
    monkeypatch.setattr(np.lib.format, "write_array", real)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.npz"]  # no out.npz, no temporaries
    with np.load(tmp_path / "keep.npz") as z:
        assert z["output0"].shape == (3, 1, 10) and list(z["micro_batch"]) == [0, 1, 2]


def test_atomic_text_files_leave_nothing_on_failure(tmp_path):
    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with files.atomic_path(tmp_path / "t.json") as tmp:
            tmp.write_text("{half")
            raise Boom
    assert list(tmp_path.iterdir()) == []
    files.write_json(tmp_path / "t.json", {"a": np.float32(1.5), "b": np.arange(2)})
    assert json.loads((tmp_path / "t.json").read_text()) == {"a": 1.5, "b": [0, 1]}


def test_profile_trace_into_a_missing_directory_fails_before_profiling(capsys, tmp_path, monkeypatch):
    import tvmpipe.executor.runner as runner

    def refuse(*args, **kwargs):
        raise AssertionError("profiled before checking --trace")

    monkeypatch.setattr(runner.GraphRunner, "profile", refuse)
    one_line_error(capsys, ["profile", str(example_bundle()), "--trace", str(tmp_path / "no" / "t.json")],
                   "--trace", "does not exist")
