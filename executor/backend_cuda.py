"""The `cuda` backend: the bundle's own kernels, launched through PyCUDA, one stream per stage.

Split in two so the launch path can be tested without a GPU:
  * `CudaBackend` (pure Python) touches no driver itself: it asks a device for memory, builds the
    launch plan (launch_plan.py: every kernel with its grid, block, shared memory and packed
    argument bytes, pointers resolved from the storage plan) and replays it each run;
  * `PyCudaDevice` is the only code that imports pycuda (when constructed): allocate, copy in/out,
    load the cubin, launch, synchronize, events, CUDA-graph capture. Tests run it over a strict fake
    `pycuda` package (tests/fakecuda) that enforces the driver's rules.
Fed entries are copied into page-locked host buffers by `write`; the H2D copies, the launches and the
D2H copies are all enqueued by `execute`, so with `graphs=True` one CUDA graph replays all of them.

Threads: CUDA keeps the current context per thread, and a pipeline worker builds its stage on one
thread and runs micro-batches on others (its compute thread, or the socket thread that completed a
micro-batch). So every entry point of the backend (build, execute, param writes, close) makes the
device's context current on the calling thread for its duration and pops it again (`dev.current()`);
no thread is ever left holding it (docs/executor.md, "Threads and the CUDA context").
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import weakref
from typing import Any, Iterator

import numpy as np

from tvmpipe.bundle import Bundle
from tvmpipe.bundle.dtypes import np_dtype
from tvmpipe.bundle.weights import BackgroundHash, LazyParams, WeightsFile, hash_lanes
from tvmpipe.executor.backend import StepTiming
from tvmpipe.executor.cubin import compile_cubin
from tvmpipe.executor.errors import BackendUnavailable, DeviceError, ExecutorError
from tvmpipe.executor.launch_plan import PlannedLaunch, build_launch_plan
from tvmpipe.executor.program import KERNELS, NOP, StageProgram

# Page-locked staging for param uploads: two buffers of this size at most (tens of MiB, so the
# copy engine streams while the next chunk is read from the file).
STAGING_BYTES = 32 << 20
# CUDA's default limit on a block's shared memory, static + dynamic; above it a kernel must opt in
# (MAX_DYNAMIC_SHARED_SIZE_BYTES), up to the device's MAX_SHARED_MEMORY_PER_BLOCK_OPTIN.
DEFAULT_SMEM_LIMIT = 48 * 1024


def cuda_unavailable() -> str | None:
    """Why the cuda backend cannot run here (no pycuda, no driver, no device), or None. The GPU
    benches print it and exit 0 on CPU machines (`make bench`), 1 with --require-gpu."""
    try:
        import pycuda.driver as cuda

        cuda.init()
        return None if cuda.Device.count() else "no CUDA device"
    except Exception as exc:  # noqa: BLE001 - ImportError (no pycuda / no libcuda) or a driver error
        return f"{type(exc).__name__}: {exc}"


class CudaBackend:
    name = "cuda"

    def __init__(self, bundle: Bundle, program: StageProgram, device: Any = None, graphs: bool = False,
                 arch: str | None = None, staging_bytes: int = STAGING_BYTES):
        self.program = program
        self.staging_bytes = max(1, int(staging_bytes))
        missing = [f"node {s.node} '{s.name}' ('{s.func}')" for s in program.steps if s.kind == KERNELS and not s.launches]
        if missing:
            raise ExecutorError(f"no kernels.json launch list for {', '.join(missing[:5])}"
                                + (" ..." if len(missing) > 5 else "") + ": a bare graph.json runs only on the simulated backend")
        self.dev = device if device is not None else PyCudaDevice(arch=arch)
        self.graphs = graphs
        try:
            with self.dev.current():
                self._build(bundle, program)
        except BaseException:
            self.dev.close()
            raise

    def _build(self, bundle: Bundle, program: StageProgram) -> None:
        smem: dict[str, int] = {}
        for l in program.launches:
            smem[l.kernel] = max(smem.get(l.kernel, 0), l.shared_mem)
        self.funcs = self.dev.load(self.dev.compile(bundle.cuda_source), smem) if smem else {}
        self.ptrs = [self.dev.alloc(max(s.nbytes, 1)) for s in program.storage.slots]
        self.ptr = {e: self.ptrs[program.storage.entry_slot[e]] for e in program.entry_specs}
        self._upload_params(bundle, program)
        spec = program.entry_specs
        # a resident pool (program.resident: held by SlotState, on the device only) has no host staging
        self.host_in = {e: self.dev.host(spec[e].shape, np_dtype(spec[e].dtype)) for e in program.feed_entries
                        if e not in program.resident}
        self.host_out = {e: self.dev.host(spec[e].shape, np_dtype(spec[e].dtype)) for e in program.send_entries
                         if e not in program.resident}
        self.params = {e: name for name, e in program.param_entries.items()}
        self.plan = build_launch_plan(program, self.ptrs)
        self._state_entry: dict[int, int] = {}  # state slot buffer -> its entry
        self._bound: dict[int, int] = {}  # state entry -> the slot buffer it is bound to (bind_state)
        self._plans: dict[tuple, list] = {}  # launch plans by bindings
        self._graphs: dict[tuple | None, Any] = {}  # captured graphs by bindings (None: none bound)
        self._aliases: dict[int, set[int]] = {}
        # Fed entries that arrive on the device (cluster/wire/cudaipc.py): no host copy in; their
        # DeviceFeeds enqueue a wait on the producer's event and device-to-device copies instead.
        self.device_fed: frozenset[int] = frozenset()
        self._device_feeds: list[Any] = []

    def feed_device(self, feeds: list[Any]) -> None:
        """This run's entries that come from another process's device memory (each feed has
        `entries` and `enqueue(dev, ptr)`); every other fed entry comes through write(). A change of
        the set re-captures the CUDA graph (its host copies differ)."""
        fed = frozenset().union(*[f.entries for f in feeds]) if feeds else frozenset()
        if fed != self.device_fed:
            self.device_fed = fed
            self._graphs.clear()
        self._device_feeds = list(feeds)

    def _upload_params(self, bundle: Bundle, program: StageProgram) -> None:
        """A safetensors bundle's params go from the file to the device through page-locked
        staging buffers, 2 x `staging_bytes` in all (pread a chunk, async copy, the other buffer of
        its pair fills meanwhile): no host copy of the stage's weights ever exists. One pair per
        hash lane, so that as many tensors' checksums run at once (one sha256 is ~1.2 GB/s: on an
        H100 host, one pair uploaded at 0.9-1.1 GB/s against a 54 GB/s page-locked copy).
        Other bundles' arrays are copied as before."""
        params = bundle.params
        if not (isinstance(params, LazyParams) and hasattr(self.dev, "staging") and program.param_entries):
            for name, e in program.param_entries.items():
                self._upload_param(name, np.ascontiguousarray(params[name]))
            return
        largest = max(params.nbytes(n) for n in program.param_entries)
        pairs = min(hash_lanes(), len(program.param_entries))
        chunk = max(1, min(self.staging_bytes // pairs, largest))
        jobs = [(self.ptr[e], name) for name, e in program.param_entries.items()]
        pending: list = []  # checksums compared after the last upload (WeightsFile.verify)
        try:
            with self.dev.staging(chunk, 2 * pairs):
                self.dev.upload_staged(jobs, params.file, pending)
        except BaseException:
            params.settle(pending, compare=False)  # this error stands
            raise
        params.settle(pending)  # every checksum compared before the stage runs

    def _upload_param(self, name: str, value: np.ndarray) -> None:
        with self.dev.check(f"uploading param '{name}'"):
            self.dev.upload(self.ptr[self.program.param_entries[name]], value)

    def input_buffer(self, entry: int) -> np.ndarray | None:
        """Fed entry `entry`'s page-locked buffer, which every execute copies to the device (None for
        an entry that arrives on the device this run, or is not fed): see Stage.input_buffer."""
        return None if entry in self.device_fed else self.host_in.get(entry)

    def write(self, entry: int, value: np.ndarray) -> None:
        """A fed entry goes to its page-locked buffer (copied in by the next execute; nothing to do
        when `value` is that buffer, filled in place: Stage.input_buffer); a param is uploaded now,
        synchronously: the stream is idle between runs."""
        host = self.host_in.get(entry)
        if host is not None:
            if entry not in self.device_fed and value is not host:
                np.copyto(host, value)
            return
        if getattr(self.dev, "ctx", True) is None:
            raise DeviceError("the CUDA device is closed")
        name = self.params.get(entry)
        if name is None:
            raise ExecutorError(f"entry {entry} is neither fed to nor a param of nodes "
                                f"[{self.program.start}, {self.program.end})")
        with self.dev.current():
            self._upload_param(name, np.ascontiguousarray(value))

    # ---- resident state (executor/stage.py SlotState): device buffers, never through the host ----
    def free_memory(self) -> int:
        """Device memory still free (cuMemGetInfo), once the stage's weights are on it."""
        with self.dev.current():
            return self.dev.free_memory()

    def alloc_state(self, entry: int, fill: float) -> int:
        """A device buffer for one sequence slot's value of state entry `entry`, set to `fill`."""
        with self.dev.current():
            ptr = self.dev.alloc(max(self.program.entry_specs[entry].nbytes, 1))
        self._state_entry[ptr] = entry
        self.fill_state(ptr, fill)
        return ptr

    def resident(self, entries: set[int]) -> None:
        """State entries that neither come from nor go to the host: no staging copies for them."""
        for e in entries:
            self.host_in.pop(e, None)
            self.host_out.pop(e, None)

    def fill_state(self, ptr: int, fill: float, rows: list[int] | None = None, of: int = 1) -> None:
        """Set a state buffer to `fill`: all of it, or rows `rows` of its `of` along its leading
        axis (each row a contiguous span: a sequence that takes one row of a static batch)."""
        spec = self.program.entry_specs[self._state_entry[ptr]]
        with self.dev.current(), self.dev.check("resetting a state slot"):
            if rows is None:
                self.dev.upload(ptr, np.full(spec.shape, fill, dtype=np_dtype(spec.dtype)))
                return
            row = np.full(tuple(spec.shape)[1:], fill, dtype=np_dtype(spec.dtype))
            for r in rows:
                self.dev.upload(ptr + r * (spec.nbytes // of), row)

    def bind_state(self, entry: int, ptr: int) -> None:
        """Point `entry` (and every `__nop` view of it) at device buffer `ptr` for the next runs: the
        kernels read the slot's state and write its next value in place, no copy. A launch plan
        (and, with graphs, a captured graph) is built once per binding and kept."""
        self._bound[entry] = ptr

    def _alias_class(self, entry: int) -> set[int]:
        """`entry` and the entries that are `__nop` views of it, or it of them (same memory)."""
        if not self._aliases:
            links: dict[int, set[int]] = {}
            for st in self.program.steps:
                if st.kind == NOP:
                    a, b = st.inputs[0], st.outputs[0]
                    links.setdefault(a, set()).add(b)
                    links.setdefault(b, set()).add(a)
            self._aliases = links
        seen, todo = {entry}, [entry]
        while todo:
            for n in self._aliases.get(todo.pop(), ()):
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        return seen

    def _current_plan(self) -> tuple[Any, list]:
        """(key, launch plan) for the current state bindings (the plain plan when none)."""
        if not self._bound:
            return None, self.plan
        key = tuple(sorted(self._bound.items()))
        plan = self._plans.get(key)
        if plan is None:
            over = {a: p for e, p in self._bound.items() for a in self._alias_class(e)}
            plan = self._plans[key] = build_launch_plan(self.program, self.ptrs, over)
        return key, plan

    def _enqueue(self, events: list | None = None) -> None:
        for e, h in self.host_in.items():
            if e not in self.device_fed:
                self.dev.copy_in(self.ptr[e], h)
        for p in self._current_plan()[1]:
            if events is not None:
                events.append((p, self.dev.record()))
            if isinstance(p, PlannedLaunch):
                s = self.program.steps[p.step]
                with self.dev.check(f"launching kernel '{p.kernel}' of node {p.node} '{s.name}'"):
                    self.dev.launch(self.funcs[p.kernel], p.grid, p.block, p.shared_mem, p.argbuf)
            else:
                self.dev.copy(p.dst, p.src, p.nbytes)
        if events is not None:
            events.append((None, self.dev.record()))
        for e, h in self.host_out.items():
            self.dev.copy_out(h, self.ptr[e])

    def execute(self, profile: bool = False) -> list[StepTiming] | None:
        with self.dev.current():
            return self._execute(profile)

    def _execute(self, profile: bool) -> list[StepTiming] | None:
        where = f"running nodes [{self.program.start}, {self.program.end}) of '{self.program.model}'"
        events: list | None = [] if profile else None
        feeds, self._device_feeds = self._device_feeds, []
        for f in feeds:  # on the stage's stream, ahead of everything below (outside any capture)
            with self.dev.check("waiting for and copying a CUDA IPC input"):
                f.enqueue(self.dev, self.ptr)
        if self.graphs and not profile:
            key = self._current_plan()[0]  # one graph per state binding (slot and buffer parity)
            graph = self._graphs.get(key)
            if graph is None:
                with self.dev.check(f"capturing a CUDA graph of nodes [{self.program.start}, {self.program.end})"):
                    graph = self._graphs[key] = self.dev.capture(self._enqueue)
            self.dev.replay(graph)
        else:
            self._enqueue(events)
        with self.dev.check(where + " (a failing kernel is reported here, at the next synchronize)"):
            self.dev.synchronize()
        if events is None:
            return None
        per_step: dict[int, list[tuple[str, float]]] = {}
        for (p, start), (_, end) in zip(events, events[1:]):
            name = p.kernel if isinstance(p, PlannedLaunch) else "__copy"
            per_step.setdefault(p.step, []).append((name, self.dev.elapsed(start, end)))
        return [StepTiming(i, sum(t for _, t in per_step.get(i, [])), tuple(per_step.get(i, [])))
                for i in range(len(self.program.steps))]

    def read(self, entry: int) -> np.ndarray:
        return self.host_out[entry].copy()

    def close(self) -> None:
        """Drop the page-locked buffers and kernels with the context current (PyCUDA frees them when
        collected, and on another thread without the context it could only warn and leak), then
        close the device."""
        if getattr(self.dev, "ctx", None) is not None:
            with self.dev.current():
                self.host_in, self.host_out, self.funcs = {}, {}, {}
        self.dev.close()


_OPEN: "weakref.WeakSet[PyCudaDevice]" = weakref.WeakSet()


@atexit.register
def _close_open_devices() -> None:
    """Free what devices still hold before PyCUDA's own teardown; a weak set, so an atexit hook
    never keeps a device (and its GPU memory) alive."""
    for dev in list(_OPEN):
        with contextlib.suppress(Exception):
            dev.close()


class _Check:
    """PyCudaDevice.check's context manager: a class, not a generator, as it wraps every launch and
    every run (a generator-based one costs a few microseconds a run on a GPU host)."""

    __slots__ = ("error", "what")

    def __init__(self, error: type, what: str):
        self.error, self.what = error, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: type | None, exc: BaseException | None, tb: Any) -> bool:
        if typ is not None and issubclass(typ, self.error):
            raise DeviceError(f"CUDA error while {self.what}: {exc}") from None
        return False


class _Current:
    """PyCudaDevice.current's context manager (a class for the same reason as _Check)."""

    __slots__ = ("dev",)

    def __init__(self, dev: "PyCudaDevice"):
        self.dev = dev

    def __enter__(self) -> None:
        with self.dev.check("making the CUDA context current"):
            self.dev.ctx.push()

    def __exit__(self, *exc: object) -> bool:
        self.dev._pop()
        return False


def device_free_memory(ordinal: int) -> int:
    """Free bytes of CUDA device `ordinal` now (cuMemGetInfo), read through its primary context,
    retained and released again: what a stage placed there could still take (executor/kvpool.py
    sizes a paged pool by it before the stages start). BackendUnavailable / DeviceError where it
    cannot be read."""
    dev = PyCudaDevice(ordinal)
    try:
        with dev.current():
            return dev.free_memory()
    finally:
        dev.close()


class PyCudaDevice:
    """The driver side: PyCUDA for memory, modules, launches and events; the driver API through
    ctypes for stream capture, which PyCUDA 2026.1 does not wrap.

    The primary context is retained, never left current: callers run driver calls inside
    `current()`, on whatever thread they are (see the module docstring)."""

    def __init__(self, ordinal: int = 0, arch: str | None = None):
        try:
            import pycuda.driver as cuda
        except ImportError as exc:  # no pycuda, or no libcuda.so.1 (no driver)
            raise BackendUnavailable(f"the cuda backend needs pycuda and an NVIDIA driver: {exc}") from None
        self.cuda = cuda
        self.ctx: Any = None
        self.allocs: list[Any] = []
        self.graphs: list[ctypes.c_void_p] = []
        self.lib: Any = None
        self.module: Any = None
        with self.check("initialising CUDA"):
            cuda.init()
            if cuda.Device.count() <= ordinal:
                raise BackendUnavailable(f"no CUDA device {ordinal} ({cuda.Device.count()} found)")
            dev = cuda.Device(ordinal)
            self.arch = arch or "sm_{}{}".format(*dev.compute_capability())
            self.smem_optin = dev.get_attribute(cuda.device_attribute.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            self.ctx = dev.retain_primary_context()
        with self.current(), self.check("creating a stream"):
            self.stream = cuda.Stream()
        _OPEN.add(self)

    def current(self) -> "_Current":
        """This device's context is current on the calling thread inside the block (pushed on
        entry, and exactly it popped on exit), whatever thread that is."""
        if self.ctx is None:
            raise DeviceError("the CUDA device is closed")
        return _Current(self)

    def _pop(self) -> None:
        """Pop this device's context, and only it: Context.pop() pops whatever is on top."""
        with self.check("popping the CUDA context"):
            top = self.cuda.Context.get_current()
            if top is None or top != self.ctx:
                raise DeviceError("the CUDA context stack was changed inside a tvmpipe call "
                                  "(a context pushed and not popped)")
            self.cuda.Context.pop()

    def check(self, what: str) -> "_Check":
        """Every driver error becomes a DeviceError that says what tvmpipe was doing."""
        return _Check(self.cuda.Error, what)

    def compile(self, source: str) -> bytes:
        return compile_cubin(source, self.arch)

    def load(self, cubin: bytes, smem: dict[str, int]) -> dict[str, Any]:
        """The kernels, each allowed the dynamic shared memory its launches ask for. CUDA's default
        limit is 48 KiB for static + dynamic together, so the opt-in is needed whenever the sum is
        above it, even with dynamic <= 48 KiB; the sum can never exceed the device's opt-in limit."""
        with self.check(f"loading the cubin ({self.arch})"):
            self.module = self.cuda.module_from_buffer(cubin)
        funcs = {}
        for sym, nbytes in smem.items():
            with self.check(f"looking up kernel '{sym}'"):
                funcs[sym] = f = self.module.get_function(sym)
                static = f.get_attribute(self.cuda.function_attribute.SHARED_SIZE_BYTES)
            if static + nbytes > self.smem_optin:
                raise DeviceError(f"kernel '{sym}' needs {static} bytes of static and {nbytes} bytes of dynamic "
                                  f"shared memory; this device allows at most {self.smem_optin} per block")
            if static + nbytes > DEFAULT_SMEM_LIMIT:
                with self.check(f"raising kernel '{sym}' to {nbytes} bytes of dynamic shared memory"):
                    f.set_attribute(self.cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)
        return funcs

    def free_memory(self) -> int:
        with self.check("asking for the free device memory"):
            return int(self.cuda.mem_get_info()[0])

    def alloc(self, nbytes: int) -> int:
        with self.check(f"allocating {nbytes} bytes"):
            self.allocs.append(self.cuda.mem_alloc(nbytes))
        return int(self.allocs[-1])

    def host(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        with self.check(f"allocating page-locked host memory for {dtype}{list(shape)}"):
            return self.cuda.pagelocked_empty(shape, dtype)

    def upload(self, ptr: int, array: np.ndarray) -> None:
        self.cuda.memcpy_htod(ptr, array)

    @contextlib.contextmanager
    def staging(self, chunk: int, buffers: int = 2) -> Iterator[None]:
        """`buffers` (an even number) page-locked buffers of `chunk` bytes for `upload_staged`, in
        use inside the block; at its end every staged copy has completed (stream synchronized)
        and the buffers are freed."""
        with self.check(f"allocating {buffers} x {chunk} bytes of page-locked staging memory"):
            self._staging = [self.cuda.pagelocked_empty(chunk, np.uint8) for _ in range(buffers)]
        self._staged_events: list[Any] = [None] * buffers
        self._staged_hashes: list[Any] = [None] * buffers  # the sha256 piece still reading each buffer
        try:
            yield
            with self.check("uploading params (waiting for the staged copies)"):
                self.stream.synchronize()
        finally:
            with contextlib.suppress(self.cuda.Error):  # never free a buffer a copy still reads
                self.stream.synchronize()
            for f in self._staged_hashes:
                if f is not None:
                    f.result()
            self._staging, self._staged_events, self._staged_hashes = [], [], []

    def upload_staged(self, jobs: list[tuple[int, str]], weights: WeightsFile, pending: list | None = None) -> None:
        """Tensors (device ptr, name) from the weights file to the device, chunk by chunk through
        the staging buffers. The buffers are pairs; each pair carries one tensor at a time, and
        the pairs take turns chunk by chunk, so a tensor per pair is hashed at once (each on its
        BackgroundHash lane) while the reads and copies stay on this thread and this stream.
        A buffer is refilled only after the event recorded behind its last copy has completed
        and its sha256 piece is done. Each tensor's sha256 is compared with bundle.json's when it
        ends, or with a `pending` list at the weights' `settle(pending)`."""
        chunk, todo = self._staging[0].size, iter(jobs)

        def one(pair: int, ptr: int, name: str) -> Iterator[None]:
            h = BackgroundHash()
            for i, (off, n) in enumerate(weights.chunks(name, chunk)):
                b = 2 * pair + i % 2
                with self.check(f"uploading param '{name}'"):
                    if self._staged_events[b] is not None:
                        self._staged_events[b].synchronize()
                    if self._staged_hashes[b] is not None:
                        self._staged_hashes[b].result()
                    buf = self._staging[b][:n]
                    weights.read_into(name, buf, off, n)
                    self._staged_hashes[b] = h.update(memoryview(buf).cast("B"))
                    self.cuda.memcpy_htod_async(ptr + off, buf, self.stream)
                    ev = self._staged_events[b] = self.cuda.Event()
                    ev.record(self.stream)
                yield
            weights.verify(name, h, pending)

        def start(pair: int) -> Iterator[None] | None:
            job = next(todo, None)
            return None if job is None else one(pair, *job)

        active = [start(p) for p in range(len(self._staging) // 2)]
        while any(a is not None for a in active):
            for p, a in enumerate(active):
                while a is not None:
                    try:
                        next(a)
                        break
                    except StopIteration:
                        a = active[p] = start(p)

    def copy_in(self, ptr: int, host: np.ndarray) -> None:
        self.cuda.memcpy_htod_async(ptr, host, self.stream)

    def copy_out(self, host: np.ndarray, ptr: int) -> None:
        self.cuda.memcpy_dtoh_async(host, ptr, self.stream)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self.cuda.memcpy_dtod_async(dst, src, nbytes, self.stream)

    def launch(self, func: Any, grid: tuple, block: tuple, smem: int, argbuf: bytes) -> None:
        # The call PyCUDA's own prepared_async_call makes, with the argument bytes packed once at load.
        func._launch_kernel(grid, block, argbuf, smem, self.stream)

    def record(self) -> Any:
        ev = self.cuda.Event()
        ev.record(self.stream)
        return ev

    def elapsed(self, start: Any, end: Any) -> float:
        return end.time_since(start) * 1e-3

    def synchronize(self) -> None:
        self.stream.synchronize()

    def _cu(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(msg))
            raise DeviceError(f"{what} failed: {msg.value.decode() if msg.value else rc}")

    def capture(self, enqueue: Any) -> ctypes.c_void_p:
        """Record everything `enqueue` puts on the stream into an instantiated CUDA graph."""
        if self.lib is None:
            self.lib = ctypes.CDLL("libcuda.so.1")
            vp = ctypes.c_void_p
            self.lib.cuStreamBeginCapture_v2.argtypes = [vp, ctypes.c_int]
            self.lib.cuStreamEndCapture.argtypes = [vp, ctypes.POINTER(vp)]
            self.lib.cuGraphInstantiateWithFlags.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_ulonglong]
            self.lib.cuGraphLaunch.argtypes = [vp, vp]
            self.lib.cuGraphDestroy.argtypes = [vp]
            self.lib.cuGraphExecDestroy.argtypes = [vp]
        stream, graph, exe = ctypes.c_void_p(self.stream.handle), ctypes.c_void_p(), ctypes.c_void_p()
        self._cu(self.lib.cuStreamBeginCapture_v2(stream, 1), "cuStreamBeginCapture")  # 1: thread-local mode
        try:
            enqueue()
        finally:
            self._cu(self.lib.cuStreamEndCapture(stream, ctypes.byref(graph)), "cuStreamEndCapture")
        self._cu(self.lib.cuGraphInstantiateWithFlags(ctypes.byref(exe), graph, 0), "cuGraphInstantiate")
        self.lib.cuGraphDestroy(graph)
        self.graphs.append(exe)
        return exe

    def replay(self, exe: ctypes.c_void_p) -> None:
        self._cu(self.lib.cuGraphLaunch(exe, ctypes.c_void_p(self.stream.handle)), "cuGraphLaunch")

    def close(self) -> None:
        """Free everything with the context current, then pop it, even when the last synchronize
        reports a kernel fault (raised afterwards, as a DeviceError). Idempotent."""
        if self.ctx is None:
            return
        _OPEN.discard(self)
        error: str | None = None
        self.ctx.push()
        try:
            try:
                self.stream.synchronize()
            except self.cuda.Error as exc:
                error = f"CUDA error while closing the device (a kernel failed earlier): {exc}"
            for exe in self.graphs:
                self.lib.cuGraphExecDestroy(exe)
            for a in self.allocs:
                with contextlib.suppress(self.cuda.Error):
                    a.free()
            self.graphs, self.allocs = [], []
            self.stream = self.module = None
        finally:
            self._pop()
            self.ctx = None
        if error:
            raise DeviceError(error)
