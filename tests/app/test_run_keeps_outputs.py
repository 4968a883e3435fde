"""`tvmpipe run --save-outputs` on a pipeline that really fails mid-run keeps the outputs that
completed, as the job does (the run directory's outputs.npz): bad input loses no data."""

from __future__ import annotations

import numpy as np

from tests.support.failing_bundle import poison_inputs, write_poison
from tvmpipe.cli import main


def test_failed_run_writes_the_completed_outputs(tmp_path, capsys):
    bundle = write_poison(tmp_path / "poison")
    np.savez(tmp_path / "in.npz", x=poison_inputs(6, bad=3))
    out = tmp_path / "out.npz"
    code = main(["run", str(bundle), "--processes", "--inputs", str(tmp_path / "in.npz"), "-n", "6",
                 "--max-restarts", "0", "--save-outputs", str(out), "--trace", str(tmp_path / "t.json")])
    err = capsys.readouterr().err
    assert code == 2 and "stage 1 failed" in err and "Traceback" not in err, err
    with np.load(out) as z:
        assert list(z["micro_batch"]) == [0, 1, 2] and z["output0"].shape[0] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.npz", "out.npz", "poison"]  # no trace, no temporaries
