"""Peak host memory of `tvmpipe compile` against the model's weight bytes.

    python bench/compile_memory.py [--layers 8] [--width 4096] [--dtype float32] [--out FILE]

Generates a weight-heavy torch.export program (LAYERS stacked `nn.Linear(WIDTH, WIDTH)` with
relu between: 8 x 4096 x 4096 fp32 is 0.5 GiB, 24 is 1.5 GiB as in issue 25), saves it as .pt2
and compiles it in a fresh child process, as `tvmpipe compile FILE.pt2 -o DIR` does. The child
records its resident set after importing tvm/torch/onnx and tvmpipe (the baseline) and its peak
(VmHWM from /proc/self/status) at the end. Reported: weights, baseline, peak, and
(peak - baseline) / weights, the figure issue 25 bounds by 2. Results go to
bench/results/compile_memory.json (one entry per configuration, replaced on re-run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "compile_memory.json"
GiB = 1 << 30


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def make_model(path: Path, layers: int, width: int, dtype: str = "float32", seed: int = 0) -> int:
    """Save LAYERS x Linear(WIDTH, WIDTH) as a torch.export program; returns its weight bytes."""
    import torch

    torch.manual_seed(seed)
    tdt = getattr(torch, dtype)

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for i, layer in enumerate(self.layers):
                x = layer(x)
                if i + 1 < len(self.layers):
                    x = torch.relu(x)
            return x

    with torch.no_grad():
        m = Stack().to(tdt).eval()
        ep = torch.export.export(m, (torch.zeros(1, width, dtype=tdt),))
        torch.export.save(ep, str(path))
    return sum(p.numel() * p.element_size() for p in m.parameters())


def child(source: str, out: str, dtype: str | None) -> None:
    """Runs in the measured process: imports, baseline, compile, peak; prints one JSON line."""
    from tvmpipe.compiler.export import compile_model, require_tvm
    from tvmpipe.compiler.progress import Progress

    require_tvm()
    import tvm  # noqa: F401  (imported by require_tvm; the baseline includes every library)

    base = status_kib("VmRSS")
    t = time.perf_counter()
    progress = Progress(stream=None)
    compile_model(source, out, dtype=dtype, overwrite=True, progress=progress)
    print(json.dumps({"baseline_kib": base, "peak_kib": status_kib("VmHWM"), "rss_end_kib": status_kib("VmRSS"),
                      "compile_s": round(time.perf_counter() - t, 2),
                      "steps_s": {k: round(v, 2) for k, v in progress.timings.items()}}))


def measure(source: Path, out: Path, dtype: str | None = None) -> dict:
    """Compile SOURCE in a fresh interpreter; its baseline and peak resident set in KiB."""
    code = ("import sys; sys.path[:0] = [sys.argv[1]]; from bench.compile_memory import child; "
            "child(sys.argv[2], sys.argv[3], sys.argv[4] or None)")
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", code, str(root), str(source), str(out), dtype or ""],
                          capture_output=True, text=True, cwd=root)
    if proc.returncode != 0:
        raise RuntimeError(f"compile child failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--dtype", default="float32", help="the torch model's dtype (float32, float16, bfloat16)")
    ap.add_argument("--compile-dtype", default=None, help="tvmpipe compile --dtype (default: the model's)")
    ap.add_argument("--label", default="", help="a note stored with the entry (e.g. the commit measured)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="compile-memory-") as tmp:
        src = Path(tmp) / "stack.pt2"
        weights = make_model(src, args.layers, args.width, args.dtype)
        r = measure(src, Path(tmp) / "bundle", args.compile_dtype)
        bundle_bytes = sum(f.stat().st_size for f in (Path(tmp) / "bundle").iterdir())
    peak, base = r["peak_kib"] * 1024, r["baseline_kib"] * 1024
    entry = {
        "model": f"{args.layers} x Linear({args.width}, {args.width}) {args.dtype}",
        "compile_dtype": args.compile_dtype or args.dtype, "label": args.label,
        "weights_bytes": weights, "bundle_bytes": bundle_bytes,
        "baseline_bytes": base, "peak_bytes": peak,
        "peak_over_weights": round(peak / weights, 2),
        "peak_minus_baseline_over_weights": round((peak - base) / weights, 2),
        "compile_s": r["compile_s"], "steps_s": r["steps_s"],
        "loadavg": round(os.getloadavg()[0], 2), "date": time.strftime("%Y-%m-%d"),
    }
    print(f"{entry['model']}: weights {weights / GiB:.2f} GiB, baseline {base / GiB:.2f} GiB, peak "
          f"{peak / GiB:.2f} GiB: peak/weights {entry['peak_over_weights']}, (peak-baseline)/weights "
          f"{entry['peak_minus_baseline_over_weights']} ({r['compile_s']} s)")
    results = json.loads(args.out.read_text()) if args.out.exists() else {"runs": []}
    results["runs"] = [e for e in results["runs"] if (e["model"], e["compile_dtype"], e["label"])
                       != (entry["model"], entry["compile_dtype"], entry["label"])] + [entry]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from stamp import stamp

    args.out.write_text(json.dumps(stamp(results), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
