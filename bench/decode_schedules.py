"""Schedule variants of the real-size decode steps (issue 54): where a step's device time goes is in
dlight's schedules, so this compiles the same steps under other rule sets, for bench/decode_real.py
to run side by side on a GPU.

    python bench/decode_schedules.py OUT [MODEL:VARIANT:T:B ...]     # here (TVM; ~25-45 s a bundle)
    # then, on the device (docs/gpu-validation.md), with OUT carried under .gpu/:
    GPU_CHECK_REAL=OUT GPU_CHECK_DECODE_REAL_ARGS="--stages 1 --transformers off --reference-max-s 8" \
        GPU_CHECK_STEPS=env,wheels,pycuda,tvmpipe,decode_real bash bench/gpu_check.sh
    # and decode_real.json comes back as bench/results/decode_schedules.<gpu>-<driver>.json

OUT gets, per model and variant, a folder `<model>_<variant>` laid out as bench/real_bundles.py lays
out .gpu/bundles/real (config.json, T<T>_b<B> without weights, its constants), the `base` variant being
the default rules (a copy of .gpu/bundles/real's bundle), each variant folder also holding the base
batch-1 bundle, so decode_real's `tokens_vs_batch_1` compares the variant's batch-B tokens with it and
its reference check compares the batch-1 tokens with NumPy's.

Variants (compiler/export.py default_rules is replaced while compiling, and the small-rows tile taken out):
  base  Matmul, GEMV, Reduction, GeneralReduction, Fallback (compiler/export.py's default_rules).
  rows8 compiler/smallrows.py, what decode steps compile with: a matmul reading a 2-D float weight
        whose output has 2-16 rows first goes to dlight's Matmul with an 8-row x 32-column tile
        (block 2 x 32 threads, 4 rows a thread) instead of its 64 x 64 (8 x 16 threads, 4 x 4 a
        thread, rows padded to 64); the rest as base.
  rows8w the same tile with 64 x 2 columns (block 2 x 64).
  norm  rows8, and dlight's RMSNorm rule before Reduction. (Its Transpose rule is left out: on the
        grouped-query expansion it leaves loops in host code, which a launch list cannot run.)

What the H200 showed (bench/results/decode_schedules.h200-580.json; docs/gpu-validation.md): rows8
takes 24 % off the batch-8 matmuls (1.1B: 23.3 -> 17.7 ms a step; +17 % tokens/s, the same tokens);
rows8w and norm gain nothing. rows8 became compiler/smallrows.py, what decode steps now
compile with; `base` here stays the rules before it. The batch-8 matmuls stay ~7x the batch-1 GEMVs' time for 8x the rows,
where a GEMV-like schedule (threads across the reduction, all rows a block) would cost about one
GEMV: the next schedule to write.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
DEFAULT_JOBS = ["135m:rows8:512:8", "135m:rows8w:512:8", "135m:norm:512:1", "135m:norm:512:8",
                "1.1b:rows8:512:8", "1.1b:rows8w:512:8", "1.1b:norm:512:1"]


def variants(base) -> dict:
    """The rule lists by variant name; `base` is export's own default_rules."""
    import tvm.s_tir.dlight as dl

    from tvmpipe.compiler.smallrows import small_rows_rule

    return {
        "base": base,
        "rows8": lambda: [small_rows_rule(), *base()],
        "rows8w": lambda: [small_rows_rule(64, 2), *base()],
        "norm": lambda: [small_rows_rule(), dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.RMSNorm(), dl.gpu.Reduction(),
                         dl.gpu.GeneralReduction(), dl.gpu.Fallback()],
    }


def main(argv: list[str]) -> int:
    import real_bundles as rb

    import tvmpipe.compiler.export  # noqa: F401  (the module, which the package's `export` function hides)

    export_module = sys.modules["tvmpipe.compiler.export"]  # the package re-exports the function as `export`
    real = ROOT / ".gpu" / "bundles" / "real"
    if not argv or not (real / "prep.json").is_file():  # `make bench` runs every script: nothing to do without them
        print(f"decode_schedules: needs OUT and bench/real_bundles.py's bundles in {real} (bench/gpu_prep.sh); "
              "nothing done", file=sys.stderr)
        return 0
    out = Path(argv[0])
    jobs = [j.split(":") for j in (argv[1:] or DEFAULT_JOBS)]
    prep = json.loads((real / "prep.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(real / "prep.json", out / "prep.json")  # gpu_check.sh's sign that OUT holds bundles
    original, original_first = export_module.default_rules, export_module._rules
    rules, checkpoints = variants(original), {}
    for model in {m for m, *_ in jobs}:  # the base of every model, and its batch-1 bundle in each variant folder
        for var in ["base"] + sorted({v for m, v, *_ in jobs if m == model}):
            d = out / f"{model}_{var}"
            d.mkdir(exist_ok=True)
            shutil.copy(real / model / "config.json", d / "config.json")
            for name in {f"T{t}_b1" for m, _, t, _ in jobs if m == model} | (
                    {f"T{t}_b{b}" for m, _, t, b in jobs if m == model} if var == "base" else set()):
                shutil.copytree(real / model / name, d / name, dirs_exist_ok=True)
                shutil.copy(real / model / (name + rb.CONSTANTS), d / (name + rb.CONSTANTS))
    try:
        for model, var, t_ctx, batch in jobs:
            if model not in checkpoints:
                checkpoints[model] = rb.make_checkpoint(prep["models"][model]["config"], out / f".checkpoint-{model}")
            export_module.default_rules = rules[var]
            export_module._rules = lambda few_rows: export_module.default_rules()  # the variant alone
            t = time.perf_counter()
            rec = rb.export_bundle(checkpoints[model], out / f"{model}_{var}" / f"T{t_ctx}_b{batch}", int(t_ctx),
                                   int(batch))
            print(f"[decode_schedules] {model} {var} T{t_ctx}_b{batch}: {time.perf_counter() - t:.1f} s {rec}",
                  flush=True)
    finally:
        export_module.default_rules, export_module._rules = original, original_first
        for ck in checkpoints.values():
            shutil.rmtree(ck, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
