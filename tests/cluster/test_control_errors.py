"""Launcher errors cross process boundaries (Ray pickles an actor's exception back to the driver)."""

from __future__ import annotations

import pickle

import pytest

from tvmpipe.cluster.control.launchers import WorkerError, WorkerLost


@pytest.mark.parametrize("cls", [WorkerError, WorkerLost])
def test_worker_errors_survive_pickling(cls):
    back = pickle.loads(pickle.dumps(cls(2, "failed to start: bundle not found")))
    assert type(back) is cls and (back.stage, back.message) == (2, "failed to start: bundle not found")
    assert str(back) == "stage 2: failed to start: bundle not found"
