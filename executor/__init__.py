"""tvmpipe.executor: run a bundle's graph nodes, whole or as a stage of a pipeline.

    program = build_stage_program(bundle, start, end)   # what a node range needs and sends
    stage = Stage(bundle, start, end, backend="reference"|"cuda"|"simulated")
    sent = stage.run({entry_id: array, ...})             # keyed by entry id, both ways
    runner = GraphRunner(bundle); runner.run(x=x); runner.get_output(0)

Backends are imported lazily (pycuda only inside the cuda backend).
"""

from tvmpipe.executor.backend import StepTiming, make_backend
from tvmpipe.executor.errors import BackendUnavailable, DeviceError, ExecutorError, InputError, UnsupportedOpError
from tvmpipe.executor.extract import boundary_input_name, extract_bundle
from tvmpipe.executor.inputs import (feeds_by_entry, input_entry_ids, npz_micro_batches, random_inputs,
                                     random_micro_batches)
from tvmpipe.executor.profile import Profile
from tvmpipe.executor.program import BoundLaunch, BoundOperand, EntrySpec, StageProgram, Step, build_stage_program
from tvmpipe.executor.runner import GraphRunner
from tvmpipe.executor.stage import Stage
from tvmpipe.executor.storage import Slot, StoragePlan

__all__ = [
    "StepTiming", "make_backend",
    "BackendUnavailable", "DeviceError", "ExecutorError", "InputError", "UnsupportedOpError",
    "boundary_input_name", "extract_bundle",
    "feeds_by_entry", "input_entry_ids", "npz_micro_batches", "random_inputs", "random_micro_batches",
    "Profile",
    "BoundLaunch", "BoundOperand", "EntrySpec", "StageProgram", "Step", "build_stage_program",
    "GraphRunner", "Stage", "Slot", "StoragePlan",
]
