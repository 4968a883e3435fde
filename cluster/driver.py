"""Pipeline: the driver. It owns the schedule, not the stages.

The driver keeps at most `window` micro-batches in flight (submit blocks beyond that), sends each
micro-batch's graph inputs straight to the stages that read them, and receives graph outputs
straight from the stages that produce them; activations flow stage to stage without it. Results
come back in submission order.

Faults. Every stage keeps a link to the driver, so a stage that dies or fails shows up here as a
closed connection or an `error` frame; a stall (nothing completes for `timeouts.progress` seconds)
triggers the same health check. The supervisor thread then asks every worker for its status,
restarts the ones that are dead, failed or stuck, re-wires the whole data plane under a new epoch
(frames of older epochs are refused everywhere) and replays every micro-batch that had not
completed. With `replay="upstream"` (the default) the replay starts from what the stages still hold:
every stage keeps the outputs of its last `window` micro-batches (all that can be incomplete, since
at most `window` are in flight), each surviving stage resumes where it stopped, and its consumers
take again from it only what they have not computed; only a restarted stage recomputes, from the
first micro-batch anyone after it still needs (`_resume_points`). With `replay="driver"` every stage
recomputes every incomplete micro-batch from the driver's inputs, which the driver keeps until
completion either way. Outputs are accepted only for
the next sequence numbers, so each is delivered exactly once and in order. A stage that fails more
than `max_restarts` times ends the run with a `PipelineError` naming it and its last error, carrying
the outputs that did complete.

With `replay="none"` (the default of a decode step, whose steps the generation layer replays
itself: it holds every sequence's tokens) nothing is replayed: every incomplete micro-batch is
delivered *lost* (`StepResult.lost`), and a step that takes the draws of a lost one is computed on
a placeholder token and delivered lost too. A step that raised on a stage that is alive (its
`WorkerStatus.error_seq`) is delivered with its `error`, and the stage is re-wired, not restarted:
a restart is for a stage that died, hung or broke (`WorkerStatus.broken`: its device failed, a
CUDA error that poisons the context), never for what one micro-batch holds. The driver keeps no
draws once they are delivered.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from tvmpipe.bundle import Bundle, load_bundle
from tvmpipe.bundle.decode_layout import FED, FEED_NEXT, FROM, STEP_NAME, no_step
from tvmpipe.bundle.pool import resize_pool
from tvmpipe.core.errors import TvmpipeError
from tvmpipe.cluster.wire import cudaipc, shm
from tvmpipe.cluster.wire.frames import DRIVER, Frame, FrameError, FrameLimits, contiguous, payload_bytes
from tvmpipe.cluster.control.launchers import Launcher, ProcessLauncher, Timeouts, WorkerError, WorkerLost
from tvmpipe.cluster.wire.handshake import new_secret
from tvmpipe.cluster.metrics import TIMELINE_KEPT, PipelineMetrics, RunRecord, compute_metrics
from tvmpipe.cluster.status import Progress, WorkerStats, WorkerStatus
from tvmpipe.cluster.topology import Edge, Topology, build_topology
from tvmpipe.cluster.wire.tcp import Address, Link, Peer, PolledListener, tally
from tvmpipe.cluster.worker import StageSpec, Wiring, inbound_limits
from tvmpipe.executor import kvpool
from tvmpipe.executor.checks import check_inputs
from tvmpipe.executor.kvpool import PoolSize
from tvmpipe.partition import Plan, checked_plan

Outputs = list[np.ndarray]
REPLAY_MODES = ("upstream", "driver", "none")


@dataclass(frozen=True)
class Replay:
    """One re-wiring after a fault: the epoch it began, the driver's first incomplete micro-batch,
    the stages restarted, and the micro-batch each stage computed from (upstream replay: survivors
    resume where they stopped; only what no stage still held is computed again)."""

    epoch: int
    first: int
    restarted: tuple[int, ...]
    resume: tuple[int, ...]


class PipelineError(TvmpipeError):
    """The run ended early. `stage` is the stage at fault (None if unknown), `last_error` its last
    error, and `completed` the outputs that completed and had not been returned yet, in order, from
    micro-batch `completed_from` on (for run(): all of that call's completed outputs, from 0)."""

    def __init__(self, message: str, stage: int | None = None, last_error: str | None = None,
                 completed: list[Outputs] | None = None, completed_from: int = 0):
        self.stage = stage
        self.last_error = last_error
        self.completed = list(completed or [])
        self.completed_from = completed_from
        super().__init__(message)


@dataclass(frozen=True)
class StepResult:
    """A completed micro-batch, as receive() returns it: `seq`, its `outputs` (the graph's heads;
    None for state and dropped heads), and on a decode pipeline `drawn`, the token each row drew on
    the sampling stage (0 where a row drew nothing, executor.sampler.NOT_FINITE where its logits
    were not finite; bundle.decode_layout), else None, and `scores`, each row's log probabilities
    ([batch, SCORES] floats, NaN where a row asked for none: executor.sampler.score_into). With
    replay="none", `lost` says the
    micro-batch was cut off by a fault (no outputs: its caller submits it again if it wants it),
    and `error` is the error its own computation raised (then it is lost too)."""

    seq: int
    outputs: Outputs | None
    drawn: list[int] | None = None
    lost: bool = False
    error: str | None = None
    scores: np.ndarray | None = None


@dataclass
class _Signal:
    """Something the supervisor must look at: a stage's report or a broken connection."""

    epoch: int
    stage: int
    message: str
    completed: int = -1  # a stall: micro-batches completed when it was noticed
    seq: int = -1  # an error frame's micro-batch


class Pipeline:
    """Run `bundle` as the pipeline `plan` (or K equal-op stages if an int) on stage workers.

    `launcher`: "ray" (actors in a placement group; needs `ray.init()` first), "process" (child
    processes on this machine, no Ray) or a Launcher instance. `host` is the interface the driver and
    (with the process launcher, or in local mode) the workers bind; None means this node's address
    and each worker's own node address, for multi-node clusters.

    `transport`: how frames cross an edge whose two ends run on one node (Ray node id, or the same
    host for processes): "auto" (shared memory for frames of shm.AUTO_MIN_BYTES and more), "shm"
    (shared memory for every such edge), "tcp" (never). Edges between nodes are always TCP.
    `edge_paths()` says what each edge took.

    `logits`: on a decode-step bundle, whether the stage that draws each token also sends the
    driver its logits (`generate(logits_log=...)`, the logits output of `get()`); False sends the
    token alone, and the logits output is None. `tvmpipe generate` streams tokens only and says
    False: a published decoder's logits are 128-600 KB a token. `scores`: whether it also sends
    each row's log probabilities (`StepResult.scores`, what the generation layer's logprobs read);
    False leaves them None (`tvmpipe generate` asks for none).
    """

    def __init__(self, bundle: Bundle | str | Path, plan: Plan | int, *, backend: str = "reference",
                 backend_opts: dict[str, Any] | None = None, window: int | None = None,
                 launcher: str | Launcher = "ray", placement: Any = None, timeouts: Timeouts = Timeouts(),
                 max_restarts: int = 3, host: str | None = "127.0.0.1", warmup: int = 1, seed: int = 0,
                 ship_bundle: bool = False, replay: str | None = None, transport: str = "auto",
                 slots: int | None = None, logits: bool = True, scores: bool = True,
                 kv_tokens: int | str | None = kvpool.AUTO):
        self.bundle = bundle if isinstance(bundle, Bundle) else load_bundle(bundle)
        self.plan = checked_plan(self.bundle, plan)  # K: equal cuts keeping state pairs whole
        self.topology: Topology = build_topology(self.bundle, self.plan, relay=backend != "cuda", logits=logits,
                                                 scores=scores)
        self.window = 2 * self.topology.num_stages if window is None else window
        if self.window < 1:
            raise TvmpipeError(f"window must be >= 1, got {self.window}")
        # Declared state (bundle.json `state`): every stage keeps its pairs resident, `slots` sequence
        # slots each (default: one per micro-batch the window admits)
        self.slots = (self.window if slots is None else slots) if self.bundle.state else 0
        if self.bundle.state and self.slots < 1:
            raise TvmpipeError(f"slots must be >= 1, got {self.slots}")
        # A paged step's pool at run time (executor/kvpool.py): kv_tokens tokens, or "auto" (the
        # default: every row at the max context, reduced to the stages' free memory, as tvmpipe
        # generate and serve size it; nothing for a step without a pool); None keeps the compiled
        # pool (--kv-pages; by default one row at the max context per compiled row, so a pipeline of
        # more slots than that preempts: what a test of preemption asks for). Every stage and the
        # scheduler (which reads self.bundle) get the same pages.
        self.kv_pool: PoolSize | None = None
        paged = self.bundle.generation is not None and self.bundle.generation.paged is not None
        if kv_tokens is not None and (paged or kv_tokens != kvpool.AUTO):
            memories = _pool_memories(backend, launcher, placement, len(self.plan.stages))
            needs = kvpool.stage_memory(self.bundle, self.plan.stages, memories)
            self.kv_pool = kvpool.size_pool(self.bundle, self.slots * self.topology.batch, needs, kv_tokens,
                                            kvpool.free_memory)
            self.bundle = resize_pool(self.bundle, self.kv_pool.pages)
            self.topology = build_topology(self.bundle, self.plan, relay=backend != "cuda", logits=logits,
                                           scores=scores)
        self._state_losses = 0  # restarts of a stage that held state (state_losses)
        if replay is None:  # a decode step's draws are fed back: the generation layer replays its steps
            replay = "none" if self.topology.layout is not None else "upstream"
        if replay not in REPLAY_MODES:
            raise TvmpipeError(f"replay must be one of {', '.join(REPLAY_MODES)}, got {replay!r}")
        self.replay = replay
        if transport not in shm.TRANSPORTS:
            raise TvmpipeError(f"transport must be one of {', '.join(shm.TRANSPORTS)}, got {transport!r}")
        self.transport = transport
        self.backend = backend
        self._pids: list[tuple[int, str | None]] = []  # (pid, CUDA_VISIBLE_DEVICES) per stage
        if max_restarts < 0:
            raise TvmpipeError(f"max_restarts must be >= 0, got {max_restarts}")
        self.timeouts = timeouts
        self.max_restarts = max_restarts
        self.run_id = uuid.uuid4().hex[:12]
        self._secret = new_secret()  # proves data-plane connections belong to this run (handshake.py)
        self.restarts = [0] * self.topology.num_stages
        self.errors: list[str] = []  # every failure the supervisor handled, for the report
        self.replays: list[Replay] = []  # every re-wiring after a fault: where each stage resumed
        self._head_stages = sorted({e.src for e in self.topology.inbound(DRIVER) if e.entries})
        self._head_from = {eid: e.src for e in self.topology.inbound(DRIVER) for eid in e.entries}
        missing = [h for h in self.topology.heads if h not in self._head_from and h not in self.topology.inputs.values()
                   and h not in self.topology.state_heads and h not in self.topology.dropped_heads]
        if missing or not self._head_stages:
            raise TvmpipeError(f"graph output entr(ies) {missing or self.topology.heads} are produced by no stage")
        self._expect = {e.src: inbound_limits(e.entries, self.topology.specs) for e in self.topology.inbound(DRIVER)}
        self._input_specs = {name: self.topology.specs[eid] for name, eid in self.topology.inputs.items()}
        self._feeds = [(e.dst, e.entries, {x: self.topology.names[x] for x in e.entries})
                       for e in self.topology.outbound(DRIVER)]

        # schedule state, guarded by _cond
        self._cond = threading.Condition()
        self._epoch = 0
        self._first = 0  # the first micro-batch the current epoch carries
        self._submitted = 0  # next sequence number to hand out
        self._completed = 0  # every micro-batch below this has all its outputs
        self._delivered = 0  # every micro-batch below this was returned to the caller
        self._inputs: dict[int, dict[int, np.ndarray]] = {}  # kept until completion, for replay
        self._partial: dict[int, dict[int, Frame]] = {}
        self._admitted: set[int] = set()  # stages connected in this epoch (one connection each)
        self._next_from: dict[int, int] = {}  # stage -> next micro-batch it must send in this epoch
        self._results: dict[int, Outputs] = {}
        # a decode pipeline's draws per completed micro-batch (one per row), until receive() delivers them
        self._drawn: dict[int, tuple[list[int], np.ndarray]] = {}  # seq -> (draws, scores)
        # replay="none": micro-batches cut off by a fault -> the error their own computation raised
        # (None: lost), until delivered; and every micro-batch lost lately, which later steps may name
        # as the source of their fed-back draws (bounded: a step takes draws at most a window back)
        self._lost: dict[int, str | None] = {}
        self._lost_seqs: set[int] = set()
        self._doomed: set[int] = set()
        self._failed_steps: dict[int, str] = {}  # replay="none": seq -> the error its step raised, this recovery  # submitted after a fault, taking a lost micro-batch's draws
        self.step_errors: list[str] = []  # steps that failed on a live stage (replay="none")
        self.submit_times: dict[int, float] = {}
        self.done_times: dict[int, float] = {}
        self._last_progress = time.time()
        self._fatal: PipelineError | None = None
        self._stall_seen: int | None = None  # a stall nobody was blamed for, at this many completed
        self._closing = False

        # data plane, guarded by _wire_lock (sending vs re-wiring)
        self._wire_lock = threading.Lock()
        self._sent = 0  # next sequence number to send in the current epoch
        self._feed_from: dict[int, int] = {}  # stage -> first micro-batch it takes inputs for, this epoch
        self._links: dict[int, Link] = {}
        self._node = shm.node_identity()
        self._nodes: list[shm.Node] = []  # each stage worker's, as of the last wiring
        self.bytes_out: dict[int, int] = {}  # per stage, of links already closed
        self.frames_out: dict[int, int] = {}
        self._signals: queue.Queue[_Signal | None] = queue.Queue()

        self.launcher = _make_launcher(launcher, placement, timeouts, ship_bundle)
        # Outputs are read by the thread waiting for them (get(), or submit() on a full window): a
        # hand-off from a receiving thread would cost a wake-up per micro-batch (PolledListener).
        self._listener = PolledListener(host or _node_ip(), self._accept_hello, self._on_frame, self._on_close,
                                        retains_frames=True, secret=self._secret)
        specs = [StageSpec(i, s, e, str(self.bundle.path), backend, dict(backend_opts or {}), host, warmup, seed,
                           self.slots if i in self.topology.stateful else 0,
                           self.kv_pool.pages if self.kv_pool is not None else None)
                 for i, (s, e) in enumerate(self.plan.stages)]
        self._addresses: list[Address] = []
        try:
            self._addresses = self.launcher.start(specs)
            self._wire(0, 0)
        except BaseException:
            self._listener.close()
            self.launcher.shutdown()
            raise
        self._supervisor = threading.Thread(target=self._supervise, daemon=True, name="tvmpipe-supervisor")
        self._supervisor.start()
        if hasattr(self.launcher, "watch_control"):  # the Ray launcher: a lost head ends the run
            self.launcher.watch_control(self._control_lost)

    # ---- public API ------------------------------------------------------------------------------
    def check_inputs(self, inputs: Mapping[str, Any]) -> dict[int, np.ndarray]:
        """Graph inputs by name -> by entry id, each of exactly the graph's shape and dtype; else
        InputError listing what the graph takes. Nothing is sent before this passes."""
        if self.topology.layout is not None and STEP_NAME not in inputs:
            # a plain run of a decode step: the driver's tokens, nothing fed back or drawn
            inputs = {**inputs, STEP_NAME: no_step(self.topology.batch)}
        checked = check_inputs(inputs, self._input_specs)
        return {eid: contiguous(checked[name]) for name, eid in self.topology.inputs.items()}

    def submit(self, inputs: Mapping[str, Any]) -> int:
        """Queue one micro-batch; blocks while `window` are in flight. Returns its sequence number."""
        return self._submit_checked(self.check_inputs(inputs))

    def get(self, timeout: float | None = None) -> Outputs:
        """The outputs of the next micro-batch in submission order (blocking); a PipelineError for
        one lost to a fault (replay="none": submit it again)."""
        result = self.receive(timeout)
        if result.lost:
            raise PipelineError(f"micro-batch {result.seq} was lost to a fault"
                                + (f": {result.error}" if result.error else " (replay='none' does not replay it)"))
        return result.outputs

    def receive(self, timeout: float | None = None) -> StepResult:
        """The next micro-batch in submission order, once complete (blocking): its sequence number,
        its outputs and, on a decode pipeline, the token each row drew on the sampling stage."""
        deadline = None if timeout is None else time.time() + timeout
        while True:
            with self._cond:
                if self._delivered < self._completed:
                    seq = self._delivered
                    self._delivered += 1
                    if seq in self._lost:
                        return StepResult(seq, None, None, True, self._lost.pop(seq))
                    drawn = self._drawn.pop(seq, None)
                    return StepResult(seq, self._results.pop(seq), None if drawn is None else drawn[0],
                                      scores=None if drawn is None else drawn[1])
                if self._fatal is not None:
                    raise self._fatal_with_results()
                if self._delivered >= self._submitted:
                    raise TvmpipeError("get(): no micro-batch is in flight")
                left = None if deadline is None else deadline - time.time()
                if left is not None and left <= 0:
                    raise TimeoutError(f"micro-batch {self._delivered} not done within {timeout} s")
            self._listener.pump(self._get_can_return, min(left, 1.0) if left is not None else 1.0)

    def _get_can_return(self) -> bool:
        return self._delivered < self._completed or self._fatal is not None or self._closing

    def _window_open(self) -> bool:
        return self._submitted - self._completed < self.window or self._fatal is not None or self._closing

    def results(self) -> Iterator[Outputs]:
        """Outputs of every micro-batch submitted so far, in order, as each completes."""
        while True:
            with self._cond:
                if self._delivered >= self._submitted:
                    return
            yield self.get()

    def run(self, batches: list[Mapping[str, Any]]) -> list[Outputs]:
        """Run micro-batches (dicts of graph inputs by name) and return their outputs, in order.

        Every micro-batch is checked before the first is sent. On failure the PipelineError carries
        the outputs of this call's micro-batches that completed (`completed_from` is relative to it).
        """
        checked = [self.check_inputs(b) for b in batches]
        with self._cond:
            if self._delivered != self._submitted:
                raise TvmpipeError("run() while streamed micro-batches are still undelivered: get() them first")
        outputs: list[Outputs] = []
        try:
            for arrays in checked:
                self._submit_checked(arrays)
            for _ in checked:
                outputs.append(self.get())
        except PipelineError as exc:
            exc.completed = outputs + exc.completed
            exc.completed_from = 0
            raise
        return outputs

    @property
    def submitted(self) -> int:
        """Micro-batches submitted so far (the next one gets this sequence number)."""
        return self._submitted

    @property
    def in_flight(self) -> int:
        """Micro-batches submitted and not yet returned by get() / receive(); submit() blocks while
        `window` of them have not completed."""
        return self._submitted - self._delivered

    @property
    def state_losses(self) -> int:
        """How many times a stage that keeps state was restarted: every slot's state there is gone
        (a generation loop rebuilds its sequences' caches). It moves before the restarted stage
        computes anything, so a micro-batch submitted after it moved sees fresh state."""
        return self._state_losses

    @property
    def ready(self) -> int:
        """Completed micro-batches whose outputs get() would return without waiting."""
        return self._completed - self._delivered

    @property
    def addresses(self) -> list[Address]:
        """Data-plane addresses: every stage worker's listener, then the driver's."""
        return [*self._addresses, self._listener.address]

    def record(self, since: int = 0) -> RunRecord:
        """What was measured so far: driver timings and every worker's spans of micro-batches `since`
        on, and byte counts since the start."""
        stats = self.launcher.call_all("stats", [(since,)] * self.topology.num_stages)
        with self._wire_lock:
            bytes_out, frames_out = dict(self.bytes_out), dict(self.frames_out)
            tally(self._links.items(), bytes_out, frames_out)
        with self._cond:
            done = {s: t for s, t in self.done_times.items() if s >= since}
            submitted = {s: self.submit_times[s] for s in done}
        g = self.bundle.graph
        return RunRecord(
            stages=list(self.plan.stages), ops=self.plan.op_counts(g),
            batch=self.bundle.manifest.batch if self.bundle.manifest else 1,
            submit_times=submitted, done_times=done,
            worker_stats=[s if isinstance(s, WorkerStats) else None for s in stats],
            edges=[(e.src, e.dst, self.topology.edge_bytes(e)) for e in self.topology.edges if e.carries_data],
            driver_bytes_out=bytes_out, driver_frames_out=frames_out,
            restarts=list(self.restarts), errors=list(self.errors))

    def metrics(self) -> PipelineMetrics:
        return compute_metrics(self.record())

    def install_sampling(self, sequence: int, extras: Any, tokenizer: tuple[str, tuple[int, ...]] | None = None) -> bool:
        """Install a sequence's sampling extras (executor.sampler.SequenceExtras: its logit bias, the
        stop ids min_tokens rules out, its grammar) on the sampling stage, before its first step: a
        control-plane call that returns once the stage holds them. False when they hold a grammar and
        the stage has no tokenizer for it: call again with `tokenizer` (tokenizer.json's text, the eos
        ids). WorkerError / WorkerLost if that stage cannot take them now (restarting): a step that
        needs them draws STATE_LOST and the generation layer installs them again."""
        if self.topology.sampler is None:
            raise TvmpipeError("install_sampling: this pipeline draws no tokens (not a decode step)")
        return self.launcher.call(self.topology.sampler, "install_sampling", sequence, extras, tokenizer)

    def status(self) -> list[WorkerStatus | str]:
        """Each worker's status, or the error a status call got."""
        return [s if isinstance(s, WorkerStatus) else str(s) for s in self.launcher.call_all("status")]

    def edge_paths(self) -> dict[tuple[int, int], str]:
        """(producer, consumer) -> "shm" or "tcp": the path each data edge took in the current epoch
        (DRIVER, -1, for the driver's end); a worker that cannot answer leaves its edges out."""
        paths: dict[tuple[int, int], str] = {}
        with self._wire_lock:
            for dst, link in self._links.items():
                paths[(DRIVER, dst)] = link.path
        for st in self.launcher.call_all("status"):
            if isinstance(st, WorkerStatus):
                for dst, path in st.paths.items():
                    paths[(st.stage, dst)] = path
        return paths

    def close(self) -> None:
        """Stop everything this pipeline started: links, workers (actors/processes), sockets."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._notify()
        self._signals.put(None)
        # Without a control plane the supervisor may hang in a Ray call: it is a daemon, leave it.
        lost = getattr(self.launcher, "control_lost", None)
        self._supervisor.join(timeout=0.1 if lost else self.timeouts.call + self.timeouts.start)
        with self._wire_lock:
            self._close_links()
        self.launcher.shutdown()
        self._listener.close()
        shm.sweep(self.run_id)  # rings on this node that a killed worker made and nobody opened

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- sending ---------------------------------------------------------------------------------
    def _submit_checked(self, arrays: dict[int, np.ndarray]) -> int:
        while not self._window_open():  # read outputs until one completes
            self._listener.pump(self._window_open, 1.0)
        with self._cond:
            while not self._window_open():  # another thread submitted meanwhile
                self._cond.wait(1.0)
            if self._fatal is not None:
                raise self._fatal_with_results()
            if self._closing:
                raise TvmpipeError("the pipeline is closed")
            if self._submitted == self._completed:  # idle until now: the stall clock starts here
                self._last_progress = time.time()
            seq = self._submitted
            self._submitted += 1
            if self._lost_seqs:
                arrays = self._unfeed_lost(seq, arrays)
            self._inputs[seq] = arrays
            self.submit_times[seq] = time.time()
        with self._wire_lock:
            self._pump()
        return seq

    def _unfeed_lost(self, seq: int, arrays: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        """A step submitted after a fault that takes the draws of a micro-batch the fault cut off
        (_cond held): those draws never come, so it takes the placeholder tokens the caller sent
        and is delivered lost (the caller rebuilds from what it received)."""
        step = self.topology.step_entry
        if step is None or step not in arrays or int(arrays[step][FROM]) not in self._lost_seqs:
            return arrays
        tag = arrays[step].copy()
        tag[FROM] = -1
        tag[FED] = 0
        tag[FEED_NEXT] = 0
        self._doomed.add(seq)
        self._lost_seqs.add(seq)  # and a step that takes its draws is lost in turn
        return {**arrays, step: tag}

    def _pump(self) -> None:
        """Send, in order, every submitted micro-batch not yet sent in this epoch (_wire_lock held)."""
        with self._cond:
            todo = [(s, self._inputs[s]) for s in range(self._sent, self._submitted) if s in self._inputs]
            self._sent = self._submitted
            epoch = self._epoch
        links, start = self._links, self._feed_from
        for seq, arrays in todo:
            for dst, entries, names in self._feeds:
                link = links.get(dst)
                if link is None:  # a re-wiring failed part-way: the next one resends from its first
                    continue
                if seq >= start.get(dst, 0):  # below: the stage computed it before the fault
                    link.put(Frame("data", self.run_id, epoch, seq, DRIVER, {x: arrays[x] for x in entries}, names))

    # ---- receiving -------------------------------------------------------------------------------
    def _accept_hello(self, peer: Peer) -> FrameLimits:
        with self._cond:
            if peer.run != self.run_id or peer.epoch != self._epoch or peer.stage not in self._expect:
                raise FrameError(f"hello from stage {peer.stage} run {peer.run} epoch {peer.epoch} is not for this "
                                 f"pipeline (run {self.run_id} epoch {self._epoch})")
            if peer.stage in self._admitted:
                raise FrameError(f"stage {peer.stage} is already connected in epoch {peer.epoch}")
            self._admitted.add(peer.stage)
            self._next_from[peer.stage] = self._first
        return self._expect[peer.stage]

    def _on_frame(self, peer: Peer, frame: Frame) -> None:
        if frame.kind == "error":
            self._signals.put(_Signal(peer.epoch, peer.stage, frame.error or "unspecified error", seq=frame.seq))
            return
        if frame.kind != "data":
            raise FrameError(f"stage {peer.stage} sent a {frame.kind} frame to the driver")
        seq = frame.seq
        with self._cond:
            if peer.epoch != self._epoch:
                return  # a stale epoch's output: its micro-batch is replayed
            want = self._next_from[peer.stage]
            if seq != want or seq >= self._submitted:  # raised: this connection closes, logged
                what = "was never submitted" if seq >= self._submitted else f"expected {want}"
                raise FrameError(f"stage {peer.stage} sent outputs of micro-batch {seq}, which {what}")
            self._next_from[peer.stage] = seq + 1
            if seq < self._completed:
                return  # a replayed micro-batch: already delivered, drop it
            self._partial.setdefault(seq, {})[peer.stage] = frame
            while len(self._partial.get(self._completed, ())) == len(self._head_stages):
                seq = self._completed
                parts = self._partial.pop(seq)
                inputs = self._inputs.pop(seq)
                if seq in self._doomed:  # it took the draws of a lost micro-batch: computed on a placeholder
                    self._doomed.discard(seq)
                    self._lost[seq] = None
                else:
                    self._results[seq] = [parts[self._head_from[h]].tensors[h] if h in self._head_from
                                          else inputs.get(h) for h in self.topology.heads]  # state, dropped heads: None
                    if self.topology.sampler is not None:
                        sent = parts[self.topology.sampler].tensors
                        scores = sent.get(self.topology.layout.scores)
                        self._drawn[seq] = (sent[self.topology.token_entry].tolist(),
                                            None if scores is None else np.array(scores, copy=True))
                self.done_times[seq] = self._last_progress = time.time()
                self._completed += 1
                if len(self.done_times) > TIMELINE_KEPT:
                    old = next(iter(self.done_times))
                    del self.done_times[old], self.submit_times[old]
            self._cond.notify_all()  # a submit() waiting for the window

    def _notify(self) -> None:
        """Wake everyone waiting for a fatal error or closing (_cond held)."""
        self._cond.notify_all()
        self._listener.wake()

    def _on_close(self, peer: Peer, error: Exception | None) -> None:
        if not self._closing and peer.epoch == self._epoch:
            why = f"{type(error).__name__}: {error}" if error else "connection closed"
            self._signals.put(_Signal(peer.epoch, peer.stage, f"link to the driver lost ({why})"))

    def _link_failed(self, epoch: int, stage: int):
        def on_error(exc: Exception) -> None:
            self._signals.put(_Signal(epoch, stage, f"driver could not send to it: {type(exc).__name__}: {exc}"))
        return on_error

    # ---- wiring and recovery ---------------------------------------------------------------------
    def _wire(self, epoch: int, first_seq: int, resume: list[int] | None = None) -> None:
        """Connect every edge for `epoch`: all workers expect it first, then all connect. Stage i
        computes from resume[i] (default: `first_seq`, the driver's first incomplete micro-batch)
        and sends each consumer what it needs from that consumer's own resume point on."""
        topo = self.topology
        resume = resume or [first_seq] * topo.num_stages
        start = lambda i: first_seq if i == DRIVER else resume[i]  # noqa: E731
        addr = lambda i: self._listener.address if i == DRIVER else self._addresses[i]  # noqa: E731
        retain = self.window if self.replay == "upstream" else 0
        nodes = self.launcher.call_all("node")
        _raise_first(nodes)
        self._nodes = nodes
        node = lambda i: self._node if i == DRIVER else nodes[i]  # noqa: E731
        if self.backend == "cuda":  # CUDA IPC needs two processes (cudaipc.py): stages may share one
            # and both ends must see the same GPUs: a handle of a device the importer cannot see
            # does not open (Ray gives each GPU actor its own CUDA_VISIBLE_DEVICES)
            self._pids = [(s.pid, s.devices) if isinstance(s, WorkerStatus) else (-1 - i, None)
                          for i, s in enumerate(self.launcher.call_all("status"))]
        path = {(e.src, e.dst): self._path(e, node) for e in topo.edges}  # each edge's, decided once
        via = lambda i, kind: frozenset(e.dst for e in topo.outbound(i) if path[e.src, e.dst] == kind)  # noqa: E731
        # the feedback edge carries tokens from the driver's first incomplete micro-batch on: a step
        # the token stage computes may take the token of any incomplete one (bundle/decode_layout.py)
        fb = topo.feedback if topo.feedback is not None and topo.feedback[0] != topo.feedback[1] else None
        send_from = lambda e: first_seq if (e.src, e.dst) == fb else start(e.dst)  # noqa: E731
        relayed = {e: (topo.specs[e], topo.names[e]) for es in topo.relayed for e in es}
        wirings = [Wiring(self.run_id, epoch, resume[i], {e.src: e.entries for e in topo.inbound(i)},
                          [(e, addr(e.dst)) for e in topo.outbound(i)], queue_depth=self.window + 1,
                          secret=self._secret, send_from={e.dst: send_from(e) for e in topo.outbound(i)},
                          retain=retain, shm_to=via(i, "shm"), ring_slots=self.window, ipc_to=via(i, "cuda-ipc"),
                          feedback_from=fb[0] if fb and i == fb[1] else None,
                          feedback_first=first_seq,
                          relayed=relayed)
                   for i in range(topo.num_stages)]
        self._feed_from = {i: resume[i] for i in range(topo.num_stages)}
        _raise_first(self.launcher.call_all("prepare", [(w,) for w in wirings]))
        _raise_first(self.launcher.call_all("connect"))
        for e in topo.outbound(DRIVER):
            hello = Frame("hello", self.run_id, epoch, resume[e.dst], DRIVER)
            try:
                shared = path[e.src, e.dst] == "shm"
                self._links[e.dst] = Link(self._addresses[e.dst], hello, self._secret, self._link_failed(epoch, e.dst),
                                          depth=self.window + 1, ring_slots=self.window if shared else 0,
                                          frame_bytes=self._edge_payload(e))
            except OSError as exc:
                raise WorkerLost(e.dst, f"the driver cannot connect to it: {exc}") from None

    def _edge_payload(self, edge: Edge) -> int:
        return payload_bytes([self.topology.specs[x].nbytes for x in edge.entries])

    def _path(self, edge: Edge, node: Callable[[int], shm.Node]) -> str:
        """"cuda-ipc", "shm" or "tcp" for `edge`, from the transport option, the backend and the two
        ends' node ids (and processes: CUDA IPC is between two)."""
        if not edge.carries_data or (edge.src, edge.dst) == self.topology.feedback:
            return "tcp"  # the feedback edge: 8 bytes a step, host memory (not a device output)
        two = (edge.src != DRIVER and edge.dst != DRIVER and len(self._pids) > max(edge.src, edge.dst)
               and self._pids[edge.src][0] != self._pids[edge.dst][0]
               and self._pids[edge.src][1] == self._pids[edge.dst][1])
        same = node(edge.src).same(node(edge.dst))
        if cudaipc.eligible(self.backend, same, two, two, self.transport):
            return "cuda-ipc"
        if not shm.usable(self.run_id):
            return "tcp"
        return shm.choose(self.transport, same, self._edge_payload(edge))

    def _close_links(self) -> None:
        """Close the driver's outbound links (_wire_lock held), keeping their byte counts."""
        for link in self._links.values():
            link.close(flush=False)
        tally(self._links.items(), self.bytes_out, self.frames_out)  # closed: nothing is in progress
        self._links = {}

    def _supervise(self) -> None:
        tick = min(1.0, self.timeouts.progress / 4)
        while True:
            try:
                signal = self._signals.get(timeout=tick)
            except queue.Empty:
                signal = None
            with self._cond:
                if self._closing:
                    return
                waited = time.time() - self._last_progress
                stalled = self._submitted > self._completed and waited > self.timeouts.progress
                stale = signal is not None and signal.epoch != self._epoch
                completed = self._completed
            if stale or (signal is None and not stalled):
                continue
            if signal is None:
                signal = _Signal(self._epoch, -1, f"no micro-batch completed for {self.timeouts.progress:.0f} s", completed)
            try:
                self._recover(signal)
            except Exception as exc:  # the supervisor must end the run, never die silently
                fatal = exc if isinstance(exc, PipelineError) else PipelineError(
                    f"recovery from '{signal.message}' failed: {type(exc).__name__}: {exc}", None, str(exc))
                with self._cond:
                    self._fatal = fatal
                    self._notify()
                return

    def _diagnose(self, signal: _Signal) -> dict[int, str]:
        """Which stages must be restarted, and why: dead or unresponsive, failed, or stuck. With
        replay="none", a live stage whose own step raised is not among them unless its device broke:
        that step is noted in `_failed_steps` (seq -> error) and delivered with its error."""
        failed: dict[int, str] = {}
        busy: dict[int, WorkerStatus] = {}
        self._failed_steps = {}
        for i, st in enumerate(self.launcher.call_all("status")):
            if isinstance(st, WorkerError):
                failed[i] = st.message
            elif st.error:
                if self.replay == "none" and st.error_seq is not None and not st.broken:
                    self._failed_steps[st.error_seq] = st.error
                    self.step_errors.append(f"stage {i}: {st.error}")
                else:
                    failed[i] = st.error
            elif st.busy_seq is not None:
                busy[i] = st
        if not failed and not self._failed_steps and signal.stage >= 0:
            failed[signal.stage] = signal.message  # it reported a fault it did not survive cleanly
        if not failed and not self._failed_steps and busy:  # a stall: the stage computing longest holds it up
            i = max(busy, key=lambda j: busy[j].busy_for_s)
            failed[i] = (f"micro-batch {busy[i].busy_seq} has run for {busy[i].busy_for_s:.1f} s "
                         f"({signal.message})")
        return failed

    def _held_up_by(self, signal: _Signal) -> dict[int, str]:
        """A stall with nobody dead, failed or computing: re-check progress before blaming anyone.

        If anything completed since the stall was noticed (a stage that was paused has caught up),
        it is over. Otherwise look again one progress timeout later; if nothing has moved by then,
        the stage furthest behind (fewest micro-batches computed; the earliest on a tie) holds the
        pipeline up: it is restarted and every incomplete micro-batch replays. So a run fails only
        with a stage named (after max_restarts), never with "stalled" alone."""
        with self._cond:
            if self._completed > signal.completed or self._submitted == self._completed:
                self._stall_seen = None
                return {}
            if self._stall_seen != self._completed:
                self._stall_seen = self._completed
                self._last_progress = time.time()
                return {}
            self._stall_seen = None
        behind = [(st.next_seq, i) for i, st in enumerate(self.launcher.call_all("status"))
                  if not isinstance(st, WorkerError)]
        if not behind:
            return {}
        seq, i = min(behind)
        return {i: f"waits at micro-batch {seq} while no stage is busy, failed or dead ({signal.message})"}

    def _recover(self, signal: _Signal) -> None:
        while True:
            failed = self._diagnose(signal)
            if not failed and not self._failed_steps:
                failed = self._held_up_by(signal)
            if not failed and not self._failed_steps:  # progress resumed, or a second look is due
                return
            for stage, why in failed.items():
                # The host matters on a multi-node cluster: a dead node or a cut link is what to look at.
                host = self._addresses[stage][0] if stage < len(self._addresses) else "?"
                self.errors.append(f"stage {stage} (host {host}): {why}")
                self.restarts[stage] += 1
                if self.restarts[stage] > self.max_restarts:
                    raise PipelineError(f"stage {stage} failed {self.restarts[stage]} times (host {host}, "
                                        f"max_restarts={self.max_restarts}); last error: {why}", stage, why)
            try:
                self._rewire(sorted(failed))
                return
            except WorkerError as exc:  # a restart or re-wiring failed: that stage failed again
                signal = _Signal(self._epoch, exc.stage, exc.message)

    def _rewire(self, restart: list[int]) -> None:
        """New epoch: drop the data plane, restart `restart`, wire again, replay what is incomplete
        (replay="none": deliver it lost instead, with the errors of the steps that raised)."""
        with self._wire_lock:
            with self._cond:
                self._epoch += 1
                epoch = self._epoch
                if any(i in self.topology.stateful for i in restart):
                    # before anything is computed on the fresh stage, and before anything is delivered
                    # lost: a caller that sees what the fault cut off sees that the caches went with it
                    self._state_losses += 1
                if self.replay == "none":
                    self._cut_off()
                first = self._completed
                self._first = first
                self._partial.clear()
                self._admitted.clear()
                self._sent = first
            self._close_links()
            self._listener.drop_connections()
            for i in restart:
                self._addresses[i] = self.launcher.restart(i)
            # after the restarts: a stuck stage is gone, so no pause waits for its micro-batch to end
            paused = self.launcher.call_all("pause") if self.replay == "upstream" else []
            resume = self._resume_points(first, restart, paused)
            self.replays.append(Replay(epoch, first, tuple(restart), tuple(resume)))
            self._wire(epoch, first, resume)
            with self._cond:
                self._last_progress = time.time()
            self._pump()

    def _cut_off(self) -> None:
        """replay="none" (_cond held): every incomplete micro-batch completes lost, carrying the
        error its own step raised if it did; the caller resubmits what it wants. They are
        remembered a while as lost, for the steps submitted after this that would take their
        draws (_unfeed_lost)."""
        for n in range(self._completed, self._submitted):
            self._lost[n] = self._failed_steps.get(n)
            self._lost_seqs.add(n)
            self._inputs.pop(n, None)
            self._doomed.discard(n)
            self.done_times[n] = time.time()
        self._completed = self._submitted
        low = self._submitted - 4 * self.window - 8  # a step takes draws at most a window back
        self._lost_seqs = {n for n in self._lost_seqs if n >= low}
        self._notify()

    def _resume_points(self, first: int, restart: list[int], paused: list[Any]) -> list[int]:
        """Where each stage computes from in the new epoch (see the module docstring).

        Consumers come after their producers (stages are contiguous node ranges), so walking from the
        last stage back, each one's needs are known: the earliest micro-batch any consumer of it takes
        (the driver takes from `first`). A surviving stage resumes where it stopped if it still holds
        its outputs back to that point; otherwise (and a restarted one always) it computes from there.
        Surviving producers are never behind their consumers (a consumer computed only what they had
        sent), so every edge is served from retained outputs or by a stage that computes."""
        n = self.topology.num_stages
        if self.replay != "upstream":
            return [first] * n
        resume = [first] * n
        for i in reversed(range(n)):
            need = min((first if e.dst == DRIVER else resume[e.dst] for e in self.topology.outbound(i)
                        if e.carries_data), default=first)
            p = paused[i] if i < len(paused) else None
            if i in restart or not isinstance(p, Progress) or p.retained_from > need:
                resume[i] = need
            else:
                resume[i] = max(p.next_seq, need)
        return resume

    def _control_lost(self, why: str) -> None:
        """The cluster's head is gone (launcher's watch thread): nothing can be restarted, and Ray
        will end this process soon; end the run now, so the caller can still save what completed."""
        with self._cond:
            self.errors.append(why)
            if self._fatal is None:
                self._fatal = PipelineError(f"the cluster's control plane is gone: {why}", None, why)
            self._notify()

    def _fatal_with_results(self) -> PipelineError:
        """The fatal error, handing over every completed, undelivered output (_cond held): each
        output leaves the pipeline once, through get() or through one raised error."""
        f = self._fatal
        first = self._delivered
        completed = [self._results.pop(s) for s in range(first, self._completed) if s in self._results]
        self._lost.clear()
        self._delivered = self._completed
        return PipelineError(str(f), f.stage, f.last_error, completed, first)


def _raise_first(results: list[Any]) -> None:
    for r in results:
        if isinstance(r, WorkerError):
            raise r


def _pool_memories(backend: str, launcher: str | Launcher, placement: Any, k: int) -> list[str]:
    """Which memory each of `k` stages holds its pool in, as executor/kvpool.py names them:
    reference stages the host's (every stage on this host shares it), cuda stages their GPU's (a
    process launcher's `devices`, round robin; under a local Ray, stage i on GPU i x its share:
    stages with a share of one GPU share it). On a Ray cluster we joined (`placement.grows`) a
    stage may run on another node, whose memory this process cannot read ("remote": it does not
    limit the default; the stage checks its own when it starts). The simulated backend holds none."""
    if backend == "simulated":
        return ["none"] * k
    if getattr(placement, "grows", False):
        return [f"remote:{i}" for i in range(k)]
    if backend != "cuda":
        return [kvpool.HOST] * k
    devices = getattr(launcher, "devices", None)
    if devices:
        return [f"cuda:{devices[i % len(devices)].split(',')[0]}" for i in range(k)]
    share = getattr(placement, "gpus", None) or 1.0
    return [f"cuda:{int(i * min(share, 1.0))}" for i in range(k)]


def _make_launcher(launcher: str | Launcher, placement: Any, timeouts: Timeouts, ship_bundle: bool) -> Launcher:
    if launcher == "process":
        return ProcessLauncher(timeouts, ship_bundle=ship_bundle)
    if launcher == "ray":
        from tvmpipe.cluster.control.ray_actors import RayLauncher
        from tvmpipe.cluster.control.placement import Placement

        return RayLauncher(placement or Placement(), timeouts, ship_bundle=ship_bundle)
    if isinstance(launcher, str):
        raise TvmpipeError(f"unknown launcher {launcher!r} (ray, process, or a Launcher object)")
    return launcher


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()

