"""CUDA IPC between cuda stages on one node (cluster/wire/cudaipc.py) over the strict fake PyCUDA, whose
IPC rules (tests/fakecuda/pycuda/driver.py "CUDA IPC") hold across the stage processes: outputs
byte-identical to the host path (TCP), and every stage-to-stage edge reports "cuda-ipc"."""

from __future__ import annotations

import os
import struct

import pytest

from tvmpipe.cluster.control.launchers import ProcessLauncher
from tvmpipe.cluster.driver import Pipeline
from tvmpipe.generation import Generator
from tvmpipe.cluster.wire.frames import DRIVER
from tvmpipe.executor import random_inputs
from tvmpipe.bundle import load_bundle

from tests.support.fake_cuda import fake_env, spawn_path
from tests.support.pipeline_harness import assert_bit_identical, run_killing


@pytest.fixture
def env(bundles, tmp_path):
    e = fake_env(tmp_path / "cubins", [bundles["mlp"], bundles["cnn"]])
    e["FAKE_PYCUDA_IPC_DIR"] = str(tmp_path / "ipc")
    e["FAKE_PYCUDA_IPC_WAIT_S"] = "20"
    return e


def exporter(path) -> int:
    """The pid that exported a fake IPC allocation or event (tests/fakecuda: its file's header)."""
    head = path.read_bytes()[:24]
    return struct.unpack_from("<Q", head, 16 if head[:8] == b"FKIPCMEM" else 8)[0]


def run(bundle, k, env, transport, batches, **kw):
    with spawn_path():
        pipe = Pipeline(bundle, k, backend="cuda", launcher=ProcessLauncher(env=env), transport=transport, **kw)
    with pipe:
        out = pipe.run(batches)
        paths = pipe.edge_paths()
    return out, paths


@pytest.mark.parametrize("model,k,graphs", [("mlp", 2, False), ("cnn", 3, False), ("cnn", 2, True)])
def test_cuda_ipc_equals_the_host_path(bundles, env, tmp_path, model, k, graphs):
    """graphs: the consumer's CUDA graph is captured without the host copy of its device-fed input."""
    batches = [random_inputs(load_bundle(bundles[model]), seed=20 + i) for i in range(5)]
    want, host_paths = run(bundles[model], k, env, "tcp", batches)
    assert set(host_paths.values()) == {"tcp"}
    got, paths = run(bundles[model], k, env, "auto", batches, window=2,  # 2 slots: backpressure is exercised
                     backend_opts={"graphs": graphs})
    assert_bit_identical(got, want)
    stage_edges = {e: p for e, p in paths.items() if DRIVER not in e}
    assert stage_edges and set(stage_edges.values()) == {"cuda-ipc"}, paths
    assert not os.listdir(tmp_path / "ipc"), "an exported allocation or event outlived the run"


def test_forced_host_path_on_cuda(bundles, env):
    batches = [random_inputs(load_bundle(bundles["mlp"]), seed=3)]
    _, paths = run(bundles["mlp"], 2, env, "shm", batches)
    assert "cuda-ipc" not in paths.values()


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_a_stage_killed_mid_run_recovers_on_cuda_ipc(bundles, env, tmp_path, transport):
    """cnn in 3 cuda stage processes, both stage edges on CUDA IPC, stage 1 SIGKILLed while frames
    stream: every output once, equal to the host path; after re-wiring the edges are cuda-ipc
    again (a dead importer's opens do not block its producer's free, as in CUDA) and nothing
    exported is left once the run ends."""
    from tvmpipe.cluster.control.launchers import Timeouts

    batches = [random_inputs(load_bundle(bundles["cnn"]), seed=40 + i) for i in range(24)]
    want, _ = run(bundles["cnn"], 3, env, "tcp", batches)
    with spawn_path(), Pipeline(bundles["cnn"], 3, backend="cuda", launcher=ProcessLauncher(env=env), window=3,
                                timeouts=Timeouts(progress=30), transport=transport) as pipe:  # restarts spawn too
        killed = []
        got = run_killing(pipe, batches, at=8, stage=1, before_kill=lambda: killed.append(pipe.status()[1].pid))
        assert pipe.restarts == [0, 1, 0]
        assert {p for e, p in pipe.edge_paths().items() if DRIVER not in e} == \
            {"cuda-ipc" if transport == "auto" else "tcp"}
    assert_bit_identical(got, want)
    # the killed process could not free what it exported (CUDA would, for a dead process): only its files remain
    assert {exporter(f) for f in (tmp_path / "ipc").glob("*")} <= {killed[0]} if transport == "auto" else True


def _ipc_frame(note):
    import numpy as np

    from tvmpipe.cluster.wire.frames import Frame

    return Frame("ipc", "r1", 0, 5, 0, {3: np.zeros((2, 4), np.float32)}, {3: "x"}, device=note)


def test_ipc_notes_round_trip_and_are_checked():
    """The ipc frame: header only, exact layout checked; the codec passes the note on as sent and the
    connection's device inbox decodes it and its offer; a lying note or offer is a one-line
    FrameError (nothing is opened or read)."""
    import msgpack

    from tvmpipe.cluster.wire import frames
    from tvmpipe.cluster.wire.cudaipc import DeviceInbox, Note, Offer
    from tvmpipe.cluster.wire.frames import FrameError, FrameLimits

    offer = Offer((b"m" * 64, b"n" * 64), (b"e" * 64, b"f" * 64), 4096)
    limits = FrameLimits.exact([(3, "float32", (2, 4))])
    data = frames.to_bytes(_ipc_frame(Note(0, offer)))
    h = frames.PREFIX.size
    frame, layout = frames.parse_header(data[h:], limits)
    assert frame.kind == "ipc" and Note.unpack(frame.device) == Note(0, offer)
    assert len(data) == h + frames.parse_prefix(data[:h], limits)
    with pytest.raises(FrameError, match="does not match|exact|layout|expected"):
        frames.parse_header(data[h:], FrameLimits.exact([(3, "float32", (2, 5))]))
    for bad in ([0, ["zz", "", 4096]], [0, [offer.pack()[0], "", 4096]], [99, None], ["0", None]):
        doc = msgpack.unpackb(data[h:])
        doc["ipc"] = bad
        with pytest.raises(FrameError, match="cuda-ipc"):
            DeviceInbox(dev=None, sock=None).take(frames.parse_header(msgpack.packb(doc), limits)[0].device,
                                                  layout.metas)
    inbox = DeviceInbox(dev=None, sock=None)
    with pytest.raises(FrameError, match="before the offer"):
        inbox.take(Note(0).pack(), layout.metas)
    inbox.mems, inbox.events = [1, 2], [None, None]
    with pytest.raises(FrameError, match="slot 1, expected slot 0"):
        inbox.take(Note(1).pack(), layout.metas)
    with pytest.raises(FrameError, match="second cuda-ipc offer"):
        inbox.take(Note(0, offer).pack(), layout.metas)


def test_generation_over_cuda_ipc_keeps_caches_resident(decode_bundle, tmp_path):
    """Stateful cuda stages in two processes on the fake: hidden states cross by CUDA IPC, the KV
    caches stay in each stage, and the tokens are the single-process loop's. The drawn token goes
    back from the last stage to stage 0 over TCP: 8 bytes of host memory, not a device output."""
    from tests.support.decode_bundle import runner_greedy
    from tvmpipe.cluster.driver import Pipeline

    prompts = [[5, 17, 3], [60], [1, 2, 3, 4]]
    want = [runner_greedy(load_bundle(decode_bundle), p, 5)[0] for p in prompts]
    env = fake_env(tmp_path / "cubins", [decode_bundle])
    env["FAKE_PYCUDA_IPC_DIR"] = str(tmp_path / "ipc")
    env["FAKE_PYCUDA_IPC_WAIT_S"] = "20"
    with spawn_path():
        pipe = Pipeline(decode_bundle, 2, backend="cuda", launcher=ProcessLauncher(env=env), slots=2)
    with pipe:
        res = Generator(pipe).generate_all(prompts, 5)
        paths = pipe.edge_paths()
    assert [r.tokens for r in res] == want
    assert {e: p for e, p in paths.items() if DRIVER not in e} == {(0, 1): "cuda-ipc", (1, 0): "tcp"}, paths
    assert not os.listdir(tmp_path / "ipc")
