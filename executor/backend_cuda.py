"""The `cuda` backend: the bundle's own kernels, launched through PyCUDA, one stream per stage.

Split in two so the launch path can be tested without a GPU:
  * `CudaBackend` (pure Python) touches no driver itself: it asks a device for memory, builds the
    launch plan (launch_plan.py: every kernel with its grid, block, shared memory and packed
    argument bytes, pointers resolved from the storage plan) and replays it each run;
  * `PyCudaDevice` is the only code that imports pycuda (when constructed): allocate, copy in/out,
    load the cubin, launch, synchronize, events, CUDA-graph capture. Tests pass a recording fake.
Fed entries are copied into page-locked host buffers by `write`; the H2D copies, the launches and the
D2H copies are all enqueued by `execute`, so with `graphs=True` one CUDA graph replays all of them.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
from typing import Any, Iterator

import numpy as np

from tvmpipe.bundle import Bundle
from tvmpipe.bundle.dtypes import np_dtype
from tvmpipe.executor.backend import StepTiming
from tvmpipe.executor.cubin import compile_cubin
from tvmpipe.executor.errors import BackendUnavailable, DeviceError, ExecutorError
from tvmpipe.executor.launch_plan import PlannedLaunch, build_launch_plan
from tvmpipe.executor.program import KERNELS, StageProgram

DEFAULT_SMEM_LIMIT = 48 * 1024  # above this a kernel must opt in to more dynamic shared memory


class CudaBackend:
    name = "cuda"

    def __init__(self, bundle: Bundle, program: StageProgram, device: Any = None, graphs: bool = False,
                 arch: str | None = None):
        self.program = program
        missing = [f"node {s.node} '{s.name}' ('{s.func}')" for s in program.steps if s.kind == KERNELS and not s.launches]
        if missing:
            raise ExecutorError(f"no kernels.json launch list for {', '.join(missing[:5])}"
                                + (" ..." if len(missing) > 5 else "") + ": a bare graph.json runs only on the simulated backend")
        self.dev = device if device is not None else PyCudaDevice(arch=arch)
        self.graphs = graphs
        smem: dict[str, int] = {}
        for l in program.launches:
            smem[l.kernel] = max(smem.get(l.kernel, 0), l.shared_mem)
        self.funcs = self.dev.load(self.dev.compile(bundle.cuda_source), smem) if smem else {}
        self.ptrs = [self.dev.alloc(max(s.nbytes, 1)) for s in program.storage.slots]
        self.ptr = {e: self.ptrs[program.storage.entry_slot[e]] for e in program.entry_specs}
        for name, e in program.param_entries.items():
            with self.dev.check(f"uploading param '{name}'"):
                self.dev.upload(self.ptr[e], np.ascontiguousarray(bundle.params[name]))
        spec = program.entry_specs
        self.host_in = {e: self.dev.host(spec[e].shape, np_dtype(spec[e].dtype)) for e in program.feed_entries}
        self.host_out = {e: self.dev.host(spec[e].shape, np_dtype(spec[e].dtype)) for e in program.send_entries}
        self.plan = build_launch_plan(program, self.ptrs)
        self.graph: Any = None

    def write(self, entry: int, value: np.ndarray) -> None:
        np.copyto(self.host_in[entry], value)

    def _enqueue(self, events: list | None = None) -> None:
        for e, h in self.host_in.items():
            self.dev.copy_in(self.ptr[e], h)
        for p in self.plan:
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
        where = f"running nodes [{self.program.start}, {self.program.end}) of '{self.program.model}'"
        events: list | None = [] if profile else None
        if self.graphs and not profile:
            if self.graph is None:
                with self.dev.check(f"capturing a CUDA graph of nodes [{self.program.start}, {self.program.end})"):
                    self.graph = self.dev.capture(self._enqueue)
            self.dev.replay(self.graph)
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
        self.dev.close()


class PyCudaDevice:
    """The driver side: PyCUDA for memory, modules, launches and events; the driver API through
    ctypes for stream capture, which PyCUDA does not wrap the same way in every release."""

    def __init__(self, ordinal: int = 0, arch: str | None = None):
        try:
            import pycuda.driver as cuda
        except ImportError as exc:  # no pycuda, or no libcuda.so.1 (no driver)
            raise BackendUnavailable(f"the cuda backend needs pycuda and an NVIDIA driver: {exc}") from None
        self.cuda = cuda
        with self.check("initialising CUDA"):
            cuda.init()
            if cuda.Device.count() <= ordinal:
                raise BackendUnavailable(f"no CUDA device {ordinal} ({cuda.Device.count()} found)")
            dev = cuda.Device(ordinal)
            self.ctx = dev.retain_primary_context()
            self.ctx.push()
            self.arch = arch or "sm_{}{}".format(*dev.compute_capability())
            self.stream = cuda.Stream()
        self.allocs: list[Any] = []
        self.graphs: list[ctypes.c_void_p] = []
        self.lib: Any = None
        atexit.register(self.close)  # pop the context before PyCUDA's teardown checks the stack

    @contextlib.contextmanager
    def check(self, what: str) -> Iterator[None]:
        """Every driver error becomes a DeviceError that says what tvmpipe was doing."""
        try:
            yield
        except self.cuda.Error as exc:
            raise DeviceError(f"CUDA error while {what}: {exc}") from None

    def compile(self, source: str) -> bytes:
        return compile_cubin(source, self.arch)

    def load(self, cubin: bytes, smem: dict[str, int]) -> dict[str, Any]:
        with self.check(f"loading the cubin ({self.arch})"):
            self.module = self.cuda.module_from_buffer(cubin)
        funcs = {}
        for sym, nbytes in smem.items():
            with self.check(f"looking up kernel '{sym}'"):
                funcs[sym] = self.module.get_function(sym)
            if nbytes > DEFAULT_SMEM_LIMIT:
                with self.check(f"raising kernel '{sym}' to {nbytes} bytes of dynamic shared memory"):
                    funcs[sym].set_attribute(self.cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)
        return funcs

    def alloc(self, nbytes: int) -> int:
        with self.check(f"allocating {nbytes} bytes"):
            self.allocs.append(self.cuda.mem_alloc(nbytes))
        return int(self.allocs[-1])

    def host(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        return self.cuda.pagelocked_empty(shape, dtype)

    def upload(self, ptr: int, array: np.ndarray) -> None:
        self.cuda.memcpy_htod(ptr, array)

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
        if getattr(self, "ctx", None) is None:
            return
        self.stream.synchronize()
        for exe in self.graphs:
            self.lib.cuGraphExecDestroy(exe)
        for a in self.allocs:
            a.free()
        self.graphs, self.allocs = [], []
        self.ctx.pop()
        self.ctx = None
