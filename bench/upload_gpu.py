"""Big-model weights onto the GPU (docs/gpu-validation.md, step `upload`): each stage's device memory
against its weights, and the staged upload's GB/s against the page-locked copy limit.

    python bench/upload_gpu.py [--gib 2] [--stages 1,2,4] [--out bench/results/upload_gpu.json]

The model is bench/bigmodel.py's synthetic stack (Linear(4096) + ReLU layers, fp32, a safetensors
file written one tensor at a time; its kernels have empty bodies: this step measures weights, not
compute). For each K of an equal plan, every stage is built with the cuda backend in a process of
its own, as a stage actor builds it:
  * device memory: cuMemGetInfo's used bytes after the build minus before (slots, params, the
    module), against the stage's weight bytes;
  * upload: the params' time from the weights file to the device through the page-locked
    staging buffers (2 x backend_cuda.STAGING_BYTES in all, one buffer pair per hash lane, the
    pairs carrying one tensor each in turn; every chunk read with pread, hashed on its tensor's
    lane, copied asynchronously), as GB/s;
  * host memory: the process's peak RSS growth over the build, against the stage's weights (the
    staged path keeps no host copy: it must stay far below them);
and, as the limit, cuMemcpyHtoDAsync from one page-locked buffer of the staging size, repeated.
The weights file is read from the page cache (it was just written): a warm node.
Runs on the fake PyCUDA too (tests put tests/fakecuda first on PYTHONPATH): numbers then mean nothing.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_gate import add_require_gpu, no_gpu_exit, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WIDTH = 4096


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def build_stage(bundle_dir: str, start: int, end: int, q) -> None:
    """One stage's cuda build in this process; puts its measurements (or an error) on `q`."""
    try:
        import numpy as np  # noqa: F401  (imported before the RSS baseline)

        from tvmpipe.bundle import load_bundle
        from tvmpipe.executor import Stage
        from tvmpipe.executor import backend_cuda
        from tvmpipe.executor.backend_cuda import PyCudaDevice

        timed = {}
        upload = backend_cuda.CudaBackend._upload_params

        def timed_upload(self, bundle, program):
            t = time.perf_counter()
            upload(self, bundle, program)
            with self.dev.current():
                self.dev.synchronize()
            timed["upload_s"] = time.perf_counter() - t

        backend_cuda.CudaBackend._upload_params = timed_upload
        probe = PyCudaDevice()  # the context (primary: shared with the stage's) and a baseline
        with probe.current():
            free0, total = probe.cuda.mem_get_info()
        bundle = load_bundle(bundle_dir)
        rss0 = _rss_kib("VmRSS")
        t = time.perf_counter()
        stage = Stage(bundle, start, end, backend="cuda")
        build_s = time.perf_counter() - t
        with probe.current():
            free1, _ = probe.cuda.mem_get_info()
        weights = sum(bundle.param_nbytes(n) for n in stage.program.param_names)
        q.put({"start": start, "end": end, "weight_bytes": weights, "device_bytes": free0 - free1,
               "device_over_weights": round((free0 - free1) / max(weights, 1), 3), "build_s": round(build_s, 3),
               "upload_s": round(timed["upload_s"], 4),
               "upload_gbps": round(weights / timed["upload_s"] / 1e9, 3),
               "host_rss_growth_bytes": (_rss_kib("VmHWM") - rss0) * 1024, "device_total_bytes": total})
        stage.close()
        probe.close()
    except BaseException as exc:  # noqa: BLE001 - reported by the parent, one line
        q.put({"start": start, "end": end, "error": f"{type(exc).__name__}: {exc}"})


def pinned_limit(nbytes: int, repeat: int, q) -> None:
    """GB/s of cuMemcpyHtoDAsync from one page-locked buffer of `nbytes`, `repeat` times."""
    try:
        import numpy as np

        from tvmpipe.executor.backend_cuda import PyCudaDevice

        dev = PyCudaDevice()
        with dev.current():
            src = dev.host((nbytes,), np.uint8)
            src[:] = 1
            dst = dev.alloc(nbytes)
            dev.cuda.memcpy_htod_async(dst, src, dev.stream)
            dev.synchronize()
            t = time.perf_counter()
            for _ in range(repeat):
                dev.cuda.memcpy_htod_async(dst, src, dev.stream)
            dev.synchronize()
            dt = time.perf_counter() - t
        del src
        dev.close()
        q.put({"pinned_htod_gbps": round(nbytes * repeat / dt / 1e9, 3), "chunk_bytes": nbytes})
    except BaseException as exc:  # noqa: BLE001
        q.put({"error": f"{type(exc).__name__}: {exc}"})


def in_child(target, *args) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    try:
        out = q.get(timeout=600)
    finally:
        p.join(60)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0, help="weights of the model, fp32 (default 2)")
    ap.add_argument("--width", type=int, default=WIDTH)
    ap.add_argument("--stages", default="1,2,4")
    ap.add_argument("--work", default=None, help="where the bundle is written (default: a temp dir)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "upload_gpu.json"))
    add_require_gpu(ap)
    args = ap.parse_args(argv)
    if (status := no_gpu_exit("upload_gpu", args.require_gpu)) is not None:
        return status
    sys.path.insert(0, str(ROOT / "bench"))
    sys.path.insert(0, str(ROOT))
    from bigmodel import write_synthetic
    from tvmpipe.bundle import load_bundle
    from tvmpipe.executor.backend_cuda import STAGING_BYTES
    from tvmpipe.partition import plan_equal_ops

    layers = max(1, round(args.gib * (1 << 30) / (4 * args.width * (args.width + 1))))
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        bundle_dir = Path(work) / "stack"
        t = time.perf_counter()
        w = write_synthetic(bundle_dir, layers, args.width)
        print(f"[upload] {layers} x Linear({args.width}): {w / (1 << 30):.2f} GiB written in "
              f"{time.perf_counter() - t:.1f} s", flush=True)
        limit = in_child(pinned_limit, min(STAGING_BYTES, w), 32)
        print(f"[upload] page-locked HtoD limit: {json.dumps(limit)}", flush=True)
        g = load_bundle(bundle_dir).graph
        runs, ok = [], "error" not in limit
        for k in [int(x) for x in args.stages.split(",")]:
            plan = plan_equal_ops(g, k)
            stages = []
            for s, e in plan.stages:
                r = in_child(build_stage, str(bundle_dir), s, e)
                if "error" not in r and "pinned_htod_gbps" in limit:
                    r["upload_over_limit"] = round(r["upload_gbps"] / limit["pinned_htod_gbps"], 3)
                ok = ok and "error" not in r
                print(f"[upload] K={k} stage [{s}, {e}): {json.dumps(r)}", flush=True)
                stages.append(r)
            runs.append({"stages": k, "per_stage": stages})
    write_result(args.out, {"weight_bytes": w, "layers": layers, "width": args.width, "staging_bytes": STAGING_BYTES,
                            "limit": limit, "runs": runs, "ok": ok})
    print(f"[upload] wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
