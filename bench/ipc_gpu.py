"""CUDA IPC hop vs the host path, two processes on GPU 0 (docs/gpu-validation.md, step `ipc`).

    python bench/ipc_gpu.py [--mb 4,64] [--iters 50] [--out bench/results/ipc_gpu.json]

One producer process, one consumer process, a socketpair between them. Per size and path, GB/s of
`iters` micro-batches moved from a producer device buffer into a consumer device buffer:
  cuda-ipc  cluster/wire/cudaipc.py as a pipeline edge uses it: D2D into a 2-slot exported ring, event,
            note; the consumer waits on the event, copies D2D on its stream, acknowledges;
  host      D2H into page-locked memory, sendall over the socket, recv_into page-locked, H2D.
Runs on the fake PyCUDA too (tests put tests/fakecuda first on PYTHONPATH): numbers then mean nothing.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pickle
import socket
import struct
import sys
import time
from collections import namedtuple
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_gate import add_require_gpu, no_gpu_exit, write_result  # noqa: E402

import numpy as np

Meta = namedtuple("Meta", "entry nbytes")
LEN = struct.Struct("<I")


def _send_obj(sock, obj) -> None:
    b = pickle.dumps(obj)
    sock.sendall(LEN.pack(len(b)) + b)


def _recv_exact(sock, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("peer closed")
        got += k
    return bytes(buf)


def _recv_obj(sock):
    return pickle.loads(_recv_exact(sock, LEN.unpack(_recv_exact(sock, LEN.size))[0]))


def consumer(sock, ack_sock, nbytes: int, iters: int, path: str) -> None:
    from tvmpipe.cluster.wire.cudaipc import DeviceInbox
    from tvmpipe.executor.backend_cuda import PyCudaDevice

    dev = PyCudaDevice()
    with dev.current():
        dst = dev.alloc(nbytes)
        pinned = dev.host((nbytes,), np.uint8)
    ack_sock.sendall(b"R")  # set up: the producer's clock starts now
    if path == "host":
        view = memoryview(pinned.view(np.ndarray)).cast("B")
        for _ in range(iters):
            got = 0
            while got < nbytes:
                got += sock.recv_into(view[got:])
            with dev.current():
                dev.upload(dst, pinned.view(np.ndarray))
            ack_sock.sendall(b"\x01")
    else:
        inbox = DeviceInbox(dev, ack_sock)
        for _ in range(iters):
            feed = inbox.take(_recv_obj(sock), [Meta(0, nbytes)])
            with dev.current():
                feed.enqueue(dev, {0: dst})
                dev.synchronize()
            inbox.release()
        inbox.close()
    ack_sock.close()
    del pinned
    dev.close()


def producer(sock, ack_sock, nbytes: int, iters: int, path: str) -> float:
    from tvmpipe.cluster.wire.cudaipc import DeviceRing
    from tvmpipe.executor.backend_cuda import PyCudaDevice

    dev = PyCudaDevice()
    with dev.current():
        src = dev.alloc(nbytes)
        dev.upload(src, np.full(nbytes, 7, np.uint8))
        pinned = dev.host((nbytes,), np.uint8)
    ring = DeviceRing(dev, 2, [(0, nbytes)]) if path == "cuda-ipc" else None
    _recv_exact(ack_sock, 1)  # the consumer is ready
    t0 = time.perf_counter()
    for i in range(iters):
        if ring is not None:
            if not ring.wait_free(ack_sock, lambda: True):
                raise ConnectionError("consumer gone")
            _send_obj(sock, ring.write({0: src}).pack())  # the note as the frame codec carries it
        else:
            with dev.current():
                dev.cuda.memcpy_dtoh(pinned.view(np.ndarray), src)
            sock.sendall(memoryview(pinned.view(np.ndarray)).cast("B"))
            if i >= 1:  # one in flight, as the ring's two slots allow
                _recv_exact(ack_sock, 1)
    if ring is not None:
        while ring.acked < iters:
            ring._read_acks(ack_sock, 0.01)
    else:
        _recv_exact(ack_sock, 1 if iters >= 1 else 0)
    dt = time.perf_counter() - t0
    if ring is not None:
        ring.close(ack_sock)
    del pinned
    dev.close()
    return dt


def hop(nbytes: int, iters: int, path: str) -> float:
    ctx = mp.get_context("spawn")
    a, b = socket.socketpair()
    ack_a, ack_b = socket.socketpair()
    p = ctx.Process(target=consumer, args=(b, ack_b, nbytes, iters, path))
    p.start()
    b.close()
    ack_b.close()  # the consumer's copies only: its close is the producer's EOF
    try:
        dt = producer(a, ack_a, nbytes, iters, path)
    finally:
        p.join(60)
    if p.exitcode != 0:
        raise RuntimeError(f"consumer exited with {p.exitcode}")
    return nbytes * iters / dt / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", default="4,64")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default="bench/results/ipc_gpu.json")
    add_require_gpu(ap)
    args = ap.parse_args(argv)
    if (status := no_gpu_exit("ipc_gpu", args.require_gpu)) is not None:
        return status
    rows = []
    for mb in [float(x) for x in args.mb.split(",")]:
        n = int(mb * (1 << 20))
        row = {"mb": mb}
        for path in ("host", "cuda-ipc"):
            row[path + "_gbps"] = round(hop(n, args.iters, path), 3)
        row["speedup"] = round(row["cuda-ipc_gbps"] / row["host_gbps"], 2)
        print(json.dumps(row), flush=True)
        rows.append(row)
    write_result(args.out, {"iters": args.iters, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
