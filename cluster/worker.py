"""StageWorker: one pipeline stage as a plain object, usable with or without Ray.

The worker builds its `Stage` (executor) once, warms it up, and listens for frames. Everything
per-run arrives as a `Wiring` (who sends it what, where to send its outputs, the epoch and the
first micro-batch): after a failure the driver re-wires every worker with a new epoch instead of
rebuilding stages, so a restart costs one stage build, not K.

Threads: one receiver per inbound edge (transport.Listener), one sender per outbound edge
(transport.Link), and micro-batches run strictly in sequence order, one at a time: by a compute
thread when inputs are large, so a stage receives micro-batch s+1 and sends s-1 while it computes
s; by the receiving thread itself when they are small, which saves a thread wake-up per hop.

Failures are not handled here, only reported: an exception in the stage is sent to the driver as
an `error` frame and the stage computes nothing more until it is re-wired; a broken inbound
connection is recorded in `status()` and reported too. The driver decides who is at fault (it can
see every worker) and re-wires.
"""

from __future__ import annotations

import os
from collections import deque
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from tvmpipe.bundle import load_bundle
from tvmpipe.bundle.pool import resize_pool
from tvmpipe.bundle.decode_layout import (FED, FEED_NEXT, FROM, SCORES_NAME, TOKEN_NAME, decode_layout, slot_layout,
                                          take_fed)
from tvmpipe.core.errors import TvmpipeError
from tvmpipe.cluster.wire import cudaipc, shm
from tvmpipe.cluster.wire.frames import DRIVER, Frame, FrameError, FrameLimits, payload_bytes
from tvmpipe.cluster.metrics import TIMELINE_KEPT
from tvmpipe.cluster.status import Progress, Span, WorkerStats, WorkerStatus
from tvmpipe.cluster.wire.tcp import INLINE_BYTES, Address, Link, Listener, Peer, tally
from tvmpipe.cluster.topology import Edge
from tvmpipe.executor import Stage
from tvmpipe.executor.errors import DeviceError
from tvmpipe.executor.inputs import random_feed
from tvmpipe.executor.sampler import SequenceExtras, SequenceStates, no_scores, sample_token


@dataclass
class StageSpec:
    """What a worker needs to build its stage; plain data so it crosses process boundaries.

    `bundle_path` must be readable where the worker runs (shared filesystem): the worker opens it in
    place and reads only its own tensors. Otherwise the launcher ships a `Shipment` (shipping.py):
    the small files and a weights slice with only the tensors of the stages on this node.
    `host` is the interface the data listener binds (None: the node's address, found by the actor).
    """

    index: int
    start: int
    end: int
    bundle_path: str
    backend: str = "reference"
    backend_opts: dict[str, Any] = field(default_factory=dict)
    host: str | None = "127.0.0.1"
    warmup: int = 1
    seed: int = 0
    state_slots: int = 0  # > 0: keep the declared state of the node range resident, this many sequence slots
    # a paged step's pool at run time (bundle.pool.resize_pool; the driver's choice, the same on every
    # stage: one page table for the pipeline); None: the pool the bundle was compiled with
    kv_pages: int | None = None


@dataclass
class Wiring:
    """One epoch of the data plane, as one worker sees it. `secret` is the run's data-plane key
    (handshake.py): it reaches the worker only this way, through the control plane."""

    run: str
    epoch: int
    first_seq: int
    inbound: dict[int, tuple[int, ...]]  # producer stage (or DRIVER) -> entries it sends here
    outbound: list[tuple[Edge, Address]]  # edges from this stage, with the consumer's address
    queue_depth: int = 8
    secret: bytes = field(default=b"", repr=False)
    # Upstream replay (driver.py): the first micro-batch each consumer (stage or DRIVER) takes from
    # this stage in this epoch, where it is below `first_seq`: the outputs for send_from[c] ..
    # first_seq - 1 are sent again from what this stage retained, before anything it computes.
    send_from: dict[int, int] = field(default_factory=dict)
    retain: int = 0  # how many of its last sends the stage keeps for that (0: none, driver replay)
    # Consumers (stage or DRIVER) on this worker's node whose edges go through a shared-memory ring
    # of `ring_slots` slots (shm.py; the driver decides from Ray node ids); every other edge is TCP.
    shm_to: frozenset[int] = frozenset()
    ring_slots: int = 0
    # Consumer stages on this node whose edges keep tensors on the GPU (cudaipc.py: both stages on
    # the cuda backend), through a ring of `ring_slots` device buffers.
    ipc_to: frozenset[int] = frozenset()
    # The token stage of a decode pipeline (bundle/decode_layout.py): the producer whose frames carry tokens fed
    # back from the sampling stage, and the first micro-batch it sends them for in this epoch (the
    # driver's first incomplete one: a step may take the token drawn by any incomplete micro-batch).
    feedback_from: int | None = None
    feedback_first: int = 0
    # The driver entries that travel along the chain of stages (topology.relay_inputs), with their
    # specs and names: a stage may take some only to pass them on.
    relayed: dict[int, tuple[Any, str]] = field(default_factory=dict)


def inbound_limits(entries: tuple[int, ...], specs: dict) -> FrameLimits:
    """The limits one producer's frames are read under: exactly the planned entries, shapes and
    dtypes (FrameLimits.exact), so a peer cannot make us allocate for anything else, nor more than
    one micro-batch of what the plan says it sends."""
    return FrameLimits.exact([(e, specs[e].dtype, tuple(specs[e].shape)) for e in entries])


def _name(stage: int) -> str:
    return "the driver" if stage == DRIVER else f"stage {stage}"


def _release(parts: dict[int, Frame], outputs: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Hand the shared-memory slots a micro-batch was read from back to their producers, once its
    outputs exist. An output that is a view of an input slot (a stage may pass a tensor through) is
    copied first: it is sent and retained after the slot has been reused."""
    slots = [f for f in parts.values() if f.release is not None]
    if not slots:
        return outputs
    for e, out in outputs.items():
        if any(np.may_share_memory(out, t) for f in slots for t in f.tensors.values()):
            outputs = {**outputs, e: out.copy()}
    for f in slots:
        f.release()
        f.release = None
    return outputs


@dataclass
class LocalBundle:
    """Where a worker reads its bundle when the launcher shipped it to this node instead of the
    worker reading `StageSpec.bundle_path` in place (control/shipping.py): the node's copy, whether
    it holds only some stages' weights, the bytes shipped, and how to give the copy up on close."""

    path: str
    partial: bool = False
    shipped_bytes: int = 0
    release: Callable[[], None] | None = None


class StageWorker:
    def __init__(self, spec: StageSpec, local: LocalBundle | None = None):
        t0 = time.time()
        self.spec = spec
        self.index = spec.index
        self._local = local
        path, partial = (local.path, local.partial) if local is not None else (spec.bundle_path, False)
        self.shipped_bytes = local.shipped_bytes if local is not None else 0  # what this worker was sent
        try:
            bundle = load_bundle(path, partial_weights=partial)
            if spec.kv_pages is not None:
                bundle = resize_pool(bundle, spec.kv_pages)
            self.stage = Stage(bundle, spec.start, spec.end, backend=spec.backend,
                               state_slots=spec.state_slots, **spec.backend_opts)
        except BaseException:
            self._release_local()
            raise
        wf = getattr(bundle.params, "file", None)  # a safetensors bundle: what this process read of it
        self.weights_bytes_read = wf.bytes_read if wf is not None else 0
        self.program = self.stage.program
        self.specs = dict(self.program.entry_specs)  # what inbound frames may carry
        self.names = dict(self.program.entry_names)
        self.build_s = time.time() - t0
        self._init_generation(bundle)
        t1 = time.time()
        feed = random_feed(self.program, spec.seed)
        paged = getattr(bundle.generation, "paged", None)
        for name in paged.inputs if paged is not None else ():  # a paged step's table: every row idle
            e = self.program.input_entries.get(name)
            if e in feed:
                feed[e] = np.full(feed[e].shape, paged.idle_value(name), dtype=feed[e].dtype)
        if self.stage.state is not None:  # warm up on slot 0, which the first sequence there resets
            feed = {e: v for e, v in feed.items() if e not in self.stage.state.inputs}
            self.specs[self.stage.slot_entry] = tag = slot_layout(bundle).spec
            feed[self.stage.slot_entry] = np.array([0] + [1] * (tag.shape[0] - 1), dtype=np.int64)
        with np.errstate(all="ignore"):  # random inputs: a cut may hand a norm's variance a negative number
            for _ in range(spec.warmup):
                self.stage.run(feed)
        self.warmup_s = time.time() - t1

        # One lock for the worker's state; the condition on it is for the few who wait (stop(), the
        # compute thread), and is only notified when someone does (`_waiting`): the per-micro-batch
        # path takes the plain lock.
        self._lock = threading.Lock()  # not reentrant: _drain releases it to compute
        self._cond = threading.Condition(self._lock)
        self._waiting = 0
        self._wiring: Wiring | None = None
        self._pending: dict[int, dict[int, Frame]] = {}  # seq -> producer -> frame
        self._next_from: dict[int, int] = {}  # producer -> next seq expected from it
        self._inbound: dict[int, FrameLimits] = {}  # producer -> what it sends
        self._admitted: set[int] = set()  # producers connected in this epoch (one connection each)
        self._links: list[tuple[Edge, Link, dict[int, str]]] = []  # with the names its frames carry
        self._data_links: list[tuple[Link, tuple[int, ...], dict[int, str]]] = []  # those that carry outputs
        self._feedback_link: Link | None = None  # sampling stage: to the token stage (bundle/decode_layout.py)
        self._compute: threading.Thread | None = None
        self._running = False  # connected: frames may be computed
        self._inline = False  # inputs are small: the receiving thread computes (see _on_frame)
        self._computing = False  # some thread holds the right to compute (one at a time, in order)
        self._busy: tuple[int, float] | None = None  # (seq, start time) while computing
        self._next_seq = 0
        # (seq, outputs) of the last `wiring.retain` micro-batches computed, in order: what a consumer
        # restarted after a fault takes again without this stage, or any before it, recomputing
        self._retained: deque[tuple[int, dict[int, np.ndarray]]] = deque()
        self._error: str | None = None
        self._error_seq: int | None = None  # the micro-batch whose own computation raised `_error`
        self._broken = False  # and whether that left the stage unable to go on (WorkerStatus.broken)
        self._peer_errors: list[str] = []
        self._expected = 0  # frames a micro-batch needs: one per producer, fed-back tokens apart
        # Token stage: seq -> the token drawn from that micro-batch (fed back), until a step takes it
        self._fed: dict[int, np.ndarray] = {}
        self._step_from = DRIVER  # the producer whose frames carry the step tag
        self._forward: tuple[int, ...] = ()  # driver entries passed on to the next stage (relay_inputs)
        self._unread: tuple[int, ...] = ()  # of those, the ones its own stage does not take
        # (epoch, seq, start, end) per micro-batch, wall clock; the newest TIMELINE_KEPT only
        self.events: deque[tuple[int, int, float, float]] = deque(maxlen=TIMELINE_KEPT)
        self.bytes_out: dict[int, int] = {}
        self.frames_out: dict[int, int] = {}
        self._listener = Listener(spec.host or "127.0.0.1", self._accept_hello, self._on_frame, self._on_close)
        if spec.backend == "cuda":
            self._listener.device_inbox = self._device_inbox

    def _init_generation(self, bundle: Any) -> None:
        """The stage's part in decoding (bundle.decode_layout): as the token stage it takes fed-back
        tokens (`_token_in`: the token input entry it overwrites), as the sampling stage it draws the
        next token from the logits (`_logits`). Either role reads the step tag, which is popped
        before the stage runs."""
        self._step_entry = self._token_entry = self._scores_entry = None
        self._states = SequenceStates()  # the penalties' tokens per sequence (the sampling stage's)
        self._vocab = 0
        self._batch = 1
        self._token_in = self._logits = None
        layout = decode_layout(bundle)
        if layout is None:
            return
        self._token_in, self._logits = layout.roles(bundle.graph, self.spec.start, self.spec.end)
        if self._token_in is None and self._logits is None:
            return
        self._step_entry, self._token_entry = layout.step, layout.drawn
        self._vocab = layout.vocab_size
        self._batch = layout.batch
        self.specs[self._step_entry] = layout.step_spec
        self.specs[self._token_entry] = layout.drawn_spec
        self.names[self._token_entry] = TOKEN_NAME
        self._scores_entry = layout.scores
        self.specs[self._scores_entry] = layout.scores_spec
        self.names[self._scores_entry] = SCORES_NAME

    # ---- control plane -----------------------------------------------------------------------------
    def address(self) -> Address:
        return self._listener.address

    def node(self) -> shm.Node:
        """Which node this worker runs on (shm.node_identity): the driver puts same-node edges on
        shared memory."""
        return shm.node_identity()

    def prepare(self, wiring: Wiring) -> None:
        """Drop the current epoch's data plane and expect `wiring`'s peers (connect() opens links).

        Two phases, so every worker expects the new epoch before any worker connects to it.
        """
        self.stop()
        shm.sweep(wiring.run, below_epoch=wiring.epoch)  # rings of older epochs a dead peer never opened
        with self._cond:
            have = self._retained_from()
            missing = [c for c, s in wiring.send_from.items() if s < wiring.first_seq and s < have]
            if missing:  # the driver's plan relies on outputs this stage no longer holds
                raise TvmpipeError(f"stage {self.index} cannot send micro-batches {min(wiring.send_from[c] for c in missing)}"
                                   f"..{wiring.first_seq - 1} again: it holds {have}..{self._next_seq - 1}")
            kept = [r for r in self._retained if r[0] < wiring.first_seq][-wiring.retain:] if wiring.retain else []
            self._retained = deque(kept, maxlen=wiring.retain or None)
            self._wiring = wiring
            self._pending.clear()
            self._next_from = {p: wiring.first_seq for p in wiring.inbound}
            if wiring.feedback_from is not None:
                self._next_from[wiring.feedback_from] = wiring.feedback_first
            self._expected = len([p for p in wiring.inbound if p != wiring.feedback_from])
            # kept: what this stage drew itself (no feedback edge) for micro-batches still incomplete
            self._fed = {m: t for m, t in self._fed.items() if m >= wiring.feedback_first}
            for e, (spec, name) in wiring.relayed.items():
                self.specs.setdefault(e, spec)
                self.names.setdefault(e, name)
            self._inbound = {p: inbound_limits(es, self.specs) for p, es in wiring.inbound.items()}
            self._step_from = next((p for p, es in wiring.inbound.items() if self._step_entry in es), DRIVER)
            # what it passes on unread (relay_inputs), and what of that its own stage does not take
            made = set(self.program.send_entries) | {self._token_entry, self._scores_entry}
            self._forward = tuple(sorted({e for edge, _ in wiring.outbound for e in edge.entries} - made))
            reads = set(self.program.input_entries.values()) | {self.stage.slot_entry, self._step_entry}
            self._unread = tuple(e for p, es in wiring.inbound.items() for e in es
                                 if e in wiring.relayed and e not in reads)
            self._admitted = set()
            self._listener.secret = wiring.secret or None
            self._next_seq = wiring.first_seq
            self._error = None
            self._error_seq = None
            self._broken = False
            self._peer_errors = []

    def pause(self) -> Progress:
        """Stop (see stop()) and say how far this stage got and what it can send again."""
        self.stop()
        with self._cond:
            return Progress(self.index, self._next_seq, self._retained_from())

    def _retained_from(self) -> int:
        """The first micro-batch of the unbroken run of retained ones that ends at _next_seq - 1."""
        first = self._next_seq
        for seq, _ in reversed(self._retained):
            if seq != first - 1:
                break
            first = seq
        return first

    def connect(self) -> None:
        """Open the outbound links of the prepared wiring and start computing.

        Small inputs (all of a micro-batch within transport.INLINE_BYTES) are computed by the
        receiving thread that completes them: one thread wake-up less per hop. Larger ones by a
        compute thread, so the next micro-batch's bytes arrive while this one computes.
        """
        w = self._wiring
        assert w is not None, "prepare() first"
        hello = Frame("hello", w.run, w.epoch, w.first_seq, self.index)
        for edge, addr in w.outbound:
            frame_bytes = payload_bytes([self.specs[e].nbytes for e in edge.entries])
            slots = w.ring_slots if edge.dst in w.shm_to and edge.carries_data else 0
            device_ring = None
            if edge.dst in w.ipc_to and edge.carries_data and self.spec.backend == "cuda":
                sizes = [(e, self.specs[e].nbytes) for e in edge.entries]
                device_ring = lambda sizes=sizes: cudaipc.DeviceRing(  # noqa: E731
                    self.stage.backend.dev, min(max(2, w.ring_slots), cudaipc.MAX_SLOTS), sizes)
            link = Link(tuple(addr), hello, w.secret, self._link_failed(edge.dst), depth=w.queue_depth,
                        ring_slots=slots, frame_bytes=frame_bytes, device_ring=device_ring)
            names = {e: self.names[e] for e in edge.entries}
            self._links.append((edge, link, names))
            if edge.dst != DRIVER and self._token_entry in edge.entries:
                self._feedback_link = link
            if edge.carries_data:
                self._data_links.append((link, edge.entries, names))
                start = w.send_from.get(edge.dst, w.first_seq)
                for seq, outputs in self._retained:  # upstream replay: sent again, in order, before new ones
                    if start <= seq < w.first_seq:
                        link.put(Frame("data", w.run, w.epoch, seq, self.index, {e: outputs[e] for e in edge.entries},
                                       names))
        inbound = sum(self.specs[e].nbytes for es in w.inbound.values() for e in es)
        with self._cond:
            self._inline = inbound <= INLINE_BYTES
            self._running = True
        # a thread either way: frames that arrived before connect() are waiting to be computed
        target = self._drain_once if self._inline else self._compute_loop
        self._compute = threading.Thread(target=target, daemon=True, name=f"stage{self.index}-compute")
        self._compute.start()

    def stop(self) -> None:
        """Stop computing and close every data connection; the stage and listener stay."""
        with self._cond:
            self._running = False
            self._cond.notify_all()
            while self._computing:  # a micro-batch in progress finishes (it cannot be interrupted)
                self._wait()
        if self._compute is not None:
            self._compute.join()
            self._compute = None
        self._release_pending()
        for _, link, _ in self._links:
            link.close(flush=False)
        tally(((edge.dst, link) for edge, link, _ in self._links), self.bytes_out, self.frames_out)
        self._links = []
        self._data_links = []
        self._feedback_link = None
        self._release_pending()
        self._listener.drop_connections()

    def _release_pending(self) -> None:
        """Hand back the slots of micro-batches that will not be computed in this epoch (the next
        prepare() drops them): a cuda-ipc consumer closes its handles, and so lets its producer
        free them, only once every note it took was released (cudaipc.py)."""
        with self._cond:
            frames = [f for parts in self._pending.values() for f in parts.values() if f.release is not None]
        for f in frames:
            release, f.release = f.release, None
            if release is not None:
                release()

    def install_sampling(self, sequence: int, extras: SequenceExtras,
                         tokenizer: tuple[str, tuple[int, ...]] | None = None) -> bool:
        """Sequence `sequence`'s sampling extras (its logit bias, the stop ids min_tokens rules out,
        its grammar), on the sampling stage, before its first step (executor.sampler.SequenceStates).
        `tokenizer` (tokenizer.json's text, eos ids): the one a grammar needs, sent once; False when
        a grammar came and this stage has none yet (the caller sends it)."""
        if self._logits is None:
            raise TvmpipeError(f"stage {self.index} does not draw tokens: sampling extras go to the sampling stage")
        if tokenizer is not None:
            self._states.set_tokenizer(tokenizer[0], self._vocab, tokenizer[1])
        return self._states.install(sequence, extras)

    def status(self) -> WorkerStatus:
        with self._cond:
            busy = self._busy
            return WorkerStatus(stage=self.index, pid=os.getpid(), epoch=self._wiring.epoch if self._wiring else None,
                                next_seq=self._next_seq, busy_seq=busy[0] if busy else None,
                                busy_for_s=time.time() - busy[1] if busy else 0.0,
                                error=self._error, error_seq=self._error_seq, broken=self._broken,
                                peer_errors=list(self._peer_errors),
                                paths=self.paths(),
                                devices=os.environ.get("CUDA_VISIBLE_DEVICES"))

    def paths(self) -> dict[int, str]:
        """Consumer -> the path ("shm" or "tcp") its data edge from this stage took in the current
        epoch (a link that only reports errors to the driver is not one)."""
        return {edge.dst: link.path for edge, link, _ in list(self._links) if edge.carries_data}

    def stats(self, since: int = 0) -> WorkerStats:
        """Traffic since the worker started (links still open are counted too) and the timeline of
        micro-batches `since` on: a sweep asks after every round of a pipeline that stays open for
        tens of thousands of micro-batches, and shipping every span each time cost the calibration
        worker 0.7 ms per micro-batch of CPU by the end of one sweep."""
        bytes_out = dict(self.bytes_out)
        frames_out = dict(self.frames_out)
        tally(((edge.dst, link) for edge, link, _ in self._links), bytes_out, frames_out)
        with self._cond:  # the computing thread appends
            events = [Span(*e) for e in self.events if e[1] >= since]
        return WorkerStats(stage=self.index, pid=os.getpid(), host=self.address()[0],
                           devices=os.environ.get("CUDA_VISIBLE_DEVICES"), build_s=self.build_s,
                           warmup_s=self.warmup_s, events=events, bytes_out=bytes_out, frames_out=frames_out,
                           paths=self.paths(),
                           weight_bytes=sum(self.program.entry_specs[e].nbytes for e in self.program.param_entries.values()),
                           weights_read=self.weights_bytes_read, shipped_bytes=self.shipped_bytes,
                           state_bytes=self.stage.state.resident_bytes if self.stage.state is not None else 0)

    def close(self) -> None:
        self.stop()
        self._listener.close()
        if self._wiring is not None:
            shm.sweep(self._wiring.run)
        self.stage.close()
        self._release_local()

    def _release_local(self) -> None:
        if self._local is not None and self._local.release is not None:
            self._local.release()
            self._local = None

    # ---- data plane --------------------------------------------------------------------------------
    def _accept_hello(self, peer: Peer) -> FrameLimits:
        w = self._wiring
        if w is None or peer.run != w.run or peer.epoch != w.epoch:
            raise FrameError(f"hello from stage {peer.stage} for run {peer.run} epoch {peer.epoch}: not the "
                             "current wiring")
        if peer.stage not in w.inbound:
            raise FrameError(f"stage {peer.stage} is not a producer of stage {self.index}")
        with self._lock:
            if peer.stage in self._admitted:
                raise FrameError(f"{_name(peer.stage)} is already connected in epoch {peer.epoch}")
            self._admitted.add(peer.stage)
        return self._inbound[peer.stage]

    def _device_inbox(self, peer: Peer, conn) -> "cudaipc.DeviceInbox | None":
        """A connection from another stage may carry cuda-ipc notes (the producer decides, from the
        wiring); the handles open in this stage's context."""
        if peer.stage == DRIVER:
            return None
        return cudaipc.DeviceInbox(self.stage.backend.dev, conn)

    def _on_frame(self, peer: Peer, frame: Frame) -> None:
        producer = peer.stage
        if frame.kind != "data":
            raise FrameError(f"{_name(producer)} sent a {frame.kind} frame; stages only take data")
        seq = frame.seq
        with self._lock:
            want = self._next_from[producer]
            fed_back = producer == self._wiring.feedback_from  # sent only for steps the driver flagged
            if seq < want if fed_back else seq != want:
                raise FrameError(f"{_name(producer)} sent micro-batch {seq}, expected {want}")
            self._next_from[producer] = seq + 1
            if fed_back:  # the token drawn from micro-batch seq
                self._fed[seq] = np.array(frame.tensors[self._token_entry], copy=True)
                if frame.release is not None:
                    frame.release()
                    frame.release = None
                self._bound_fed(producer)
            else:
                parts = self._pending.get(seq)
                if parts is None:
                    parts = self._pending[seq] = {}
                parts[producer] = frame
            if self._inline:
                self._drain()
            elif self._waiting:
                self._cond.notify_all()

    def _on_close(self, peer: Peer, error: Exception | None) -> None:
        if error is None:
            return
        message = f"input from {_name(peer.stage)} failed: {type(error).__name__}: {error}"
        with self._cond:
            self._peer_errors.append(message)
        self._report(self._next_seq, message)

    def _link_failed(self, dst: int):
        def on_error(exc: Exception) -> None:
            with self._cond:
                self._peer_errors.append(f"output to {_name(dst)} failed: {type(exc).__name__}: {exc}")
        return on_error

    def _report(self, seq: int, message: str) -> None:
        """Tell the driver (on the driver link, which every stage has) that something went wrong."""
        w = self._wiring
        for edge, link, _ in self._links:
            if edge.dst == DRIVER and w is not None:
                link.put(Frame("error", w.run, w.epoch, seq, self.index, error=message[:60000]))

    def _ready(self) -> bool:
        """The next micro-batch has a frame from every producer and, on the token stage, the token
        it takes from an earlier micro-batch has come back (_cond held)."""
        parts = self._pending.get(self._next_seq)
        if parts is None or len(parts) != self._expected:
            return False
        if self._token_in is not None:
            tag = parts[self._step_from].tensors.get(self._step_entry)
            if tag is not None and tag[FROM] >= 0 and int(tag[FROM]) not in self._fed:
                return False
        return True

    def _drain_once(self) -> None:
        with self._lock:
            self._drain()

    def _wait(self) -> None:
        """Wait on the condition (_lock held), counted so that notifiers know someone listens."""
        self._waiting += 1
        try:
            self._cond.wait()
        finally:
            self._waiting -= 1

    def _compute_loop(self) -> None:
        """The compute thread (large inputs): wait for the next micro-batch, run what is ready."""
        with self._cond:
            while True:
                while self._running and not (self._ready() and not self._computing):
                    self._wait()
                if not self._running:
                    return
                self._drain()

    def _drain(self) -> None:
        """Run every micro-batch whose inputs are complete, strictly in sequence order, unless
        another thread already holds the right to (_cond held; released while computing and
        sending). The right is given up in the same locked section that finds nothing ready, so
        a micro-batch completed meanwhile by a thread that found the right taken is never left
        waiting."""
        if self._computing:
            return
        self._computing = True
        try:
            while self._running and not self._error and self._ready():
                seq = self._next_seq
                parts = self._pending.pop(seq)
                self._busy = (seq, time.time())
                self._lock.release()
                try:
                    self._run(seq, parts)
                finally:
                    self._lock.acquire()
        finally:
            self._computing = False
            if self._waiting:
                self._cond.notify_all()

    def _bound_fed(self, producer: int) -> None:
        """Fed-back tokens kept: at most those a step in flight can take (_cond held). A step takes a
        token drawn at most `queue_depth` micro-batches before it, so older ones are dropped; a
        producer that sends more than that many ahead is refused (its connection closes)."""
        depth = self._wiring.queue_depth
        if len(self._fed) > 2 * depth:
            low = self._next_seq - depth
            self._fed = {m: t for m, t in self._fed.items() if m >= low}
            if len(self._fed) > 2 * depth:
                raise FrameError(f"{_name(producer)} sent {len(self._fed)} tokens ahead of micro-batch "
                                 f"{self._next_seq}; at most {2 * depth} can be in flight")

    def _take_step(self, feed: dict[int, np.ndarray]) -> list[int] | None:
        """Pop the step tag off a micro-batch's inputs (in place: the dict is this micro-batch's
        own) as plain ints; on the token stage, put the fed-back tokens in place of the driver's
        placeholders, in the rows the tag marks `fed` (every row of a batch-1 step that takes one)."""
        raw = feed.pop(self._step_entry, None)
        tag = raw.tolist() if raw is not None else None
        if self._token_in is not None and tag is not None and tag[FROM] >= 0:
            spec = self.specs[self._token_in]
            with self._lock:
                token = self._fed.pop(tag[FROM])
            feed[self._token_in] = take_fed(feed[self._token_in], tag[FED], token, spec)
        return tag

    def _run(self, seq: int, parts: dict[int, Frame]) -> None:
        """Compute one micro-batch and send its outputs (_cond not held, the right to compute held)."""
        w = self._wiring
        if len(parts) == 1:
            feed = next(iter(parts.values())).tensors
        else:
            feed = {}
            for f in parts.values():
                feed.update(f.tensors)
        device = [f.device for f in parts.values() if f.device is not None]
        try:
            passed = {e: feed[e] for e in self._forward}  # before the stage and the step tag take theirs
            for e in self._unread:
                del feed[e]
            tag = self._take_step(feed) if self._step_entry is not None else None
            feed_next = tag is not None and tag[FEED_NEXT]  # the driver asked for the draws to be fed back
            outputs = self.stage.run(feed, device=device)
            if self._logits is not None:
                scores = no_scores(self._batch)
                token = sample_token(outputs[self._logits], tag, self._vocab, self._batch, self._states, scores)
                outputs[self._token_entry] = token
                outputs[self._scores_entry] = scores
                if self._token_in is not None and feed_next:  # it reads the token too: no hop
                    with self._lock:
                        self._fed[seq] = token
                        self._bound_fed(self.index)
        except Exception as exc:  # any failure of the stage is reported, never raised in a thread
            _release(parts, {})
            message = f"micro-batch {seq}: {type(exc).__name__}: {exc}"
            with self._lock:
                self._busy = None
                self._error = message
                self._error_seq = seq
                # a device that failed (CUDA errors poison the context) or memory gone: the stage cannot
                # go on and is restarted; anything else is that micro-batch's own (the driver re-wires)
                self._broken = isinstance(exc, (DeviceError, MemoryError))
            self._report(seq, message)
            return
        if passed:
            outputs.update(passed)
        outputs = _release(parts, outputs)
        end = time.time()
        with self._lock:  # recorded before the outputs leave: once the driver has them, so has stats()
            self.events.append((w.epoch, seq, self._busy[1], end))
            self._busy = None
            self._next_seq = seq + 1
            if w.retain:
                self._retained.append((seq, outputs))
        ptrs = self.stage.send_pointers() if any(l.path == "cuda-ipc" for l, _, _ in self._data_links) else None
        for link, entries, names in self._data_links:
            if link is self._feedback_link and not feed_next:
                continue
            link.put(Frame("data", w.run, w.epoch, seq, self.index, {e: outputs[e] for e in entries}, names,
                           device=ptrs if link.path == "cuda-ipc" else None))
