"""The recording fake device, above PyCudaDevice (the launch sequence and addresses only; the driver
rules and PyCudaDevice itself are tested over the strict fake pycuda in tests/fakecuda), and the
independent checks of what it recorded: expected launches come from graph.json + kernels.json, not
from the StageProgram, and buffer safety is checked on the recorded addresses with lifetimes
recomputed from the graph.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from tvmpipe.bundle.dtypes import np_dtype
from tvmpipe.executor import Stage

FMT = {"int32": "i", "int64": "q", "uint32": "I", "uint64": "Q", "float32": "f", "float64": "d"}


class RecordingDevice:
    """The real PyCudaDevice over the strict fake pycuda (tests/fakecuda; activate it first, e.g.
    with the `fake_cuda` fixture), recording what the backend asks of it: device addresses the
    fake handed out, every copy, launch (kernel symbol, grid, block, shared memory, argument bytes),
    event, synchronize and graph capture/replay."""

    def __new__(cls):
        from tvmpipe.executor.backend_cuda import PyCudaDevice

        class Recorder(PyCudaDevice):
            def __init__(self):
                super().__init__()
                self.calls: list[tuple] = []
                self.sizes: dict[int, int] = {}  # address -> bytes, of every allocation
                self.smem: dict[str, int] = {}
                self.names: dict[int, str] = {}

            def compile(self, source):
                self.calls.append(("compile",))
                return super().compile(source)

            def load(self, cubin, smem):
                self.smem = dict(smem)
                funcs = super().load(cubin, smem)
                self.names = {id(f): sym for sym, f in funcs.items()}
                return funcs

            def alloc(self, nbytes):
                ptr = super().alloc(nbytes)
                self.sizes[ptr] = nbytes
                return ptr

            def upload(self, ptr, array):
                self.calls.append(("upload", ptr, array.nbytes))
                super().upload(ptr, array)

            def upload_staged(self, jobs, weights, pending=None):  # params from the file, through pinned staging
                self.calls.extend(("upload", ptr, weights.info(name).nbytes) for ptr, name in jobs)
                super().upload_staged(jobs, weights, pending)

            def copy_in(self, ptr, host):
                self.calls.append(("h2d", ptr, host.nbytes))
                super().copy_in(ptr, host)

            def copy_out(self, host, ptr):
                self.calls.append(("d2h", ptr, host.nbytes))
                super().copy_out(host, ptr)

            def copy(self, dst, src, nbytes):
                self.calls.append(("d2d", dst, src, nbytes))
                super().copy(dst, src, nbytes)

            def launch(self, func, grid, block, smem, argbuf):
                self.calls.append(("launch", self.names[id(func)], grid, block, smem, argbuf))
                super().launch(func, grid, block, smem, argbuf)

            def record(self):
                self.calls.append(("event",))
                return super().record()

            def synchronize(self):
                self.calls.append(("sync",))
                super().synchronize()

            def capture(self, enqueue):
                self.calls.append(("begin_capture",))
                try:
                    return super().capture(enqueue)
                finally:
                    self.calls.append(("end_capture",))

            def replay(self, graph):
                self.calls.append(("replay",))
                super().replay(graph)

            def close(self):
                if self.ctx is not None:
                    self.calls.append(("close",))
                super().close()

        return Recorder()


def ranges(n: int) -> list[tuple[int, int]]:
    return [(0, n)] + [(0, c) for c in range(1, n)] + [(c, n) for c in range(1, n)]


def expected_launches(bundle, start, end):
    g = bundle.graph
    out = []
    for nid in range(start, end):
        node = g.nodes[nid]
        if node.launches_kernels:
            args = g.input_entry_ids(nid) + list(g.node_entry_ids(nid))
            out += [(nid, l, args) for l in bundle.kernels[node.func_name].launches]
    return out


def intervals(bundle, start, end):
    """Alias-group root -> [first, last] node position in the range during which it holds data."""
    g = bundle.graph
    heads = set(g.head_entries)
    root: dict[int, int] = {}
    iv: dict[int, list[int]] = {}

    def touch(e, t):
        r = root.get(e, e)
        lo, hi = iv.get(r, [t, t])
        iv[r] = [min(lo, t), max(hi, t)]

    for nid in range(start, end):
        node = g.nodes[nid]
        if not node.is_op:
            continue
        ins, outs = g.input_entry_ids(nid), list(g.node_entry_ids(nid))
        if node.is_nop:
            root[outs[0]] = root.get(ins[0], ins[0])
        for e in ins:
            producer = g.nodes[g.entries[e].node]
            touch(e, -1 if (not producer.is_op or producer.index < start) else nid)
            if not producer.is_op and producer.name in bundle.param_names:
                touch(e, end)  # params stay resident
            touch(e, nid)
        for e in outs:
            touch(e, nid)
            if e in heads or any(c >= end for c in g.consumers[e]):
                touch(e, end)
    return root, iv


def check_pointers(bundle, start, end, dev, one_run, want):
    g = bundle.graph
    ptr_of: dict[int, int] = {}
    ws_uses: list[tuple[int, int, int]] = []  # (node, ptr, nbytes)
    for c, (nid, launch, args) in zip([c for c in one_run if c[0] == "launch"], want):
        fmt = "@" + "".join(FMT[o.dtype] if o.kind == "scalar" else "P" for o in launch.args)
        vals = struct.unpack(fmt, c[5])
        for o, v in zip(launch.args, vals):
            if o.kind == "scalar":
                assert v == pytest.approx(o.value)
            elif o.kind == "workspace":
                nb = bundle.kernels[g.nodes[nid].func_name].workspaces[o.index].nbytes
                assert v in dev.sizes and dev.sizes[v] >= nb
                ws_uses.append((nid, v, nb))
            else:
                e = args[o.index]
                assert ptr_of.setdefault(e, v) == v, f"entry {e} seen at two addresses"
                assert v in dev.sizes and dev.sizes[v] >= g.entries[e].nbytes
    root, iv = intervals(bundle, start, end)
    for e, r in root.items():  # __nop outputs alias their input exactly
        if e in ptr_of and r in ptr_of:
            assert ptr_of[e] == ptr_of[r]
        elif e in ptr_of:
            ptr_of[r] = ptr_of[e]
    for c in one_run:  # copies in/out address the fed and sent entries' memory
        if c[0] in ("h2d", "d2h"):
            assert c[1] in dev.sizes and dev.sizes[c[1]] >= c[2]
    groups = [(r, ptr_of[r], max(g.entries[e].nbytes for e in [r] + [x for x, y in root.items() if y == r]))
              for r in iv if r in ptr_of]
    for i, (a, pa, na) in enumerate(groups):
        for b, pb, nb in groups[i + 1:]:
            (a0, a1), (b0, b1) = iv[a], iv[b]
            if a0 <= b1 and b0 <= a1:
                assert pa + na <= pb or pb + nb <= pa, f"live entries {a} and {b} overlap in memory"
    for nid, p, nb in ws_uses:  # a workspace never overlaps a tensor live at its node
        for r, pr, nr in groups:
            if iv[r][0] <= nid <= iv[r][1]:
                assert p + nb <= pr or pr + nr <= p, f"workspace of node {nid} overlaps entry {r}"


def check_stage_launches(bundle, start: int, end: int) -> None:
    """Build [start, end) on the cuda backend with a fake device, run it twice, check everything."""
    dev = RecordingDevice()
    stage = Stage(bundle, start, end, backend="cuda", device=dev)
    setup = len(dev.calls)
    specs = stage.program.entry_specs
    feeds = {e: np.zeros(specs[e].shape, np_dtype(specs[e].dtype)) for e in stage.program.feed_entries}
    stage.run(feeds)
    stage.run(feeds)
    run_calls = dev.calls[setup:]
    one_run = run_calls[:len(run_calls) // 2]
    assert run_calls == one_run * 2 and one_run[-1] == ("sync",)
    assert not any(c[0] == "upload" for c in run_calls), "params are uploaded once, at build"
    uploads = [c for c in dev.calls[:setup] if c[0] == "upload"]
    assert len(uploads) == len(stage.program.param_entries)
    launches = [c for c in one_run if c[0] == "launch"]
    want = expected_launches(bundle, start, end)
    assert [(c[1], c[2], c[3], c[4]) for c in launches] == \
           [(l.kernel, l.grid, l.block, l.shared_mem) for _, l, _ in want]
    assert dev.smem == {l.kernel: max(x.shared_mem for _, x, _ in want if x.kernel == l.kernel) for _, l, _ in want}
    check_pointers(bundle, start, end, dev, one_run, want)
