"""The real-size decode bundles of the GPU kit's `decode_real` step (docs/gpu-validation.md, issue 47):
made here, weights written there.

    python bench/real_bundles.py prepare --out .gpu/bundles/real [--models 135m,1.1b]
                                         [--combos 512x1,2048x1,512x8,2048x8] [--work DIR]
                                         [--quantize-models 135m,1.1b] [--quantize-combos 512x1,512x8]

Here (a CPU machine with TVM, torch and transformers; bench/gpu_prep.sh runs it): each model's
checkpoint is written by transformers' `save_pretrained` (LlamaForCausalLM of the real
configuration, bench/checkpoint.py's MODELS, random init, float16) into --work, which is not
carried; its config.json is copied to OUT/<model>/config.json, so that the GPU host builds the
transformers model of the same configuration. Each context x batch combination is compiled
(`tvmpipe compile DIR --decode --kv static --max-context T --batch B`, the checkpoint's float16) in a child
process, which reports its wall time and peak RSS, and written without its weights (generated
from seed 0 on load, as `--omit-params` writes a bundle) to OUT/<model>/T<T>_b<B>. Beside it,
T<T>_b<B>.constants.npz holds the compiled values of the params that are not weight matrices
(anything but a float tensor of two or more dimensions: RMSNorm weights, rotary frequencies, the
cache positions' index tensors, the attention mask's fill value). Generated values would break
the step: the index tensors would be zeros, so the cache would be written at position 0 alone and
every position attended. OUT/prep.json records, per bundle, the compile's wall time and peak RSS
and the bytes of its files and of the weights it leaves out.

There (the GPU host, bench/decode_real.py): `materialize` writes each bundle's weights into a
copy under a work directory: the weight matrices from bundle.params.generate_params (seeded by
name, the values a generated bundle gets; made once per model and shared by its bundles) and the
constants, as the bundle's params.safetensors. The transformers side builds its own random model
of the same configuration: the same sizes, so the same work per token, not the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from checkpoint import MODELS as REAL_MODELS, status_kib  # noqa: E402

DTYPE = "float16"
SEED = 0  # the generated weights' seed (bundle.json params.generated)
COMBOS = ((512, 1), (2048, 1), (512, 8), (2048, 8))  # (max context T, batch B)
# The CPU test's model (tests/bench/test_gpu_check_on_cpu.py): Llama-shaped, seconds to compile.
TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True)
MODELS: dict[str, dict[str, Any]] = {**REAL_MODELS, "tiny": TINY}
CONSTANTS = ".constants.npz"  # beside each bundle: <bundle>.constants.npz


def combo_name(t: int, b: int) -> str:
    return f"T{t}_b{b}"


QUANT_SUFFIX = "-int4"  # OUT/<model>-int4: the model's --quantize int4 decode steps (--quantize-models)


def is_weight(dtype: str, shape: tuple[int, ...], name: str = "", packed: frozenset[str] = frozenset()) -> bool:
    """A param whose value the GPU host generates: a float matrix (or more dimensions), or a field
    of a packed (quantized) matrix (bundle.json source.packed): its codes are generated as zeros,
    its float16 scales at random, which costs a step the same reads as real weights."""
    from tvmpipe.bundle.dtypes import is_float

    return name in packed or (is_float(dtype) and len(shape) >= 2)


def packed_params(source: dict[str, Any] | None) -> frozenset[str]:
    """The params holding packed matrices' fields, from bundle.json `source.packed`."""
    packed = (source or {}).get("packed") or {}
    return frozenset(n for m in packed.values() for n in m.get("fields", {}).values())


# ---- here: checkpoints and bundles ---------------------------------------------------------------

def make_checkpoint(cfg: dict[str, Any], out: Path) -> Path:
    """transformers' LlamaForCausalLM of `cfg` (its own random init, seed 0) saved in float16."""
    import torch

    from tvmpipe.compiler.zoo import ensure_torchvision

    ensure_torchvision()
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).to(getattr(torch, DTYPE))
    model.save_pretrained(out)
    return out


def export_bundle(ckpt: str | Path, out: str | Path, max_context: int, batch: int,
                  quantize: str | None = None) -> dict[str, int]:
    """The decode step of checkpoint `ckpt` (`quantize`d: --quantize) compiled and written to `out`
    without its weights (generated from SEED on load), its constants beside it; counts and bytes of
    what was left out."""
    import numpy as np

    from tvmpipe.bundle import dtypes
    from tvmpipe.compiler.export import export
    from tvmpipe.compiler.progress import Progress
    from tvmpipe.core.files import atomic_path

    # static caches: the step's profile (cache updates, attention over T) and floors are the static layout's
    ex = export(str(ckpt), decode=max_context, batch=batch, progress=Progress(stream=None), quantize=quantize,
                kv="static")
    ex.write(out, params_seed=SEED, overwrite=True)
    specs = ex.params.specs()
    packed = packed_params(ex.source)
    consts = {n: np.asarray(ex.params[n]) for n, dt, shape in specs if not is_weight(dt, shape, n, packed)}
    with atomic_path(Path(out).with_name(Path(out).name + CONSTANTS)) as tmp:
        np.savez_compressed(tmp, **consts)
    left_out = sum(int(np.prod(s, dtype=np.int64)) * dtypes.itemsize(d) for n, d, s in specs
                   if is_weight(d, s, n, packed))
    return {"weights_left_out_bytes": left_out, "generated": sum(is_weight(d, s, n, packed) for n, d, s in specs),
            "constants": len(consts)}


def compile_one(ckpt: str, out: str, max_context: int, batch: int, quantize: str | None = None) -> None:
    """In a fresh interpreter: the libraries imported (the baseline), then `export_bundle`. Prints
    one JSON line: wall time, peak and baseline RSS (KiB), what was left out."""
    from tvmpipe.compiler.export import require_tvm
    from tvmpipe.compiler.zoo import ensure_torchvision

    require_tvm()
    ensure_torchvision()
    import transformers

    transformers.LlamaForCausalLM  # noqa: B018  (transformers imports its model modules lazily)
    base = status_kib("VmRSS")
    t = time.perf_counter()
    rec = export_bundle(ckpt, out, max_context, batch, quantize)
    print(json.dumps({"compile_s": round(time.perf_counter() - t, 1), "peak_rss_kib": status_kib("VmHWM"),
                      "baseline_rss_kib": base, **rec}))


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def prepare(out: Path, models: list[str], combos: list[tuple[int, int]], work: Path, children: bool = True,
            quantized: tuple[str, ...] = (), quant_combos: list[tuple[int, int]] | None = None) -> dict:
    """Checkpoints into `work`, bundles and constants into `out` (see the module docstring);
    returns and writes OUT/prep.json. `children`: each bundle compiled in a fresh interpreter,
    which measures its peak RSS (else in this one: the CPU test, seconds faster). The models in
    `quantized` also get OUT/<model>-int4: the same checkpoint compiled with `--quantize int4`
    (q4f16_1: int4 codes, a float16 scale per 32 values, float16 compute) for `quant_combos`
    (default `combos`), which decode_real runs beside the float16 ones (int4 over fp16 tokens/s)."""
    from tvmpipe.core.files import write_json

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}
    doc: dict[str, Any] = {"dtype": DTYPE, "seed": SEED, "cpus": os.cpu_count(), "models": {}}
    for name in models:
        cfg = MODELS[name]
        ckpt = work / f"{name}-{DTYPE}"
        t = time.perf_counter()
        make_checkpoint(cfg, ckpt)
        mdir = out / name
        if mdir.exists():
            shutil.rmtree(mdir)
        mdir.mkdir(parents=True)
        shutil.copyfile(ckpt / "config.json", mdir / "config.json")
        rec: dict[str, Any] = {"config": cfg, "checkpoint_s": round(time.perf_counter() - t, 1), "bundles": {}}
        print(f"[real_bundles] {name}: checkpoint in {rec['checkpoint_s']} s", file=sys.stderr, flush=True)
        qdir = out / (name + QUANT_SUFFIX)
        variants = [(mdir, None, combos)]
        if name in quantized:
            if qdir.exists():
                shutil.rmtree(qdir)
            qdir.mkdir(parents=True)
            shutil.copyfile(ckpt / "config.json", qdir / "config.json")
            variants.append((qdir, "int4", quant_combos or combos))
        for vdir, quant, t_ctx, b in [(v, q, t, b) for v, q, vc in variants for t, b in vc]:
            bdir = vdir / combo_name(t_ctx, b)
            if children:
                r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "compile-one", str(ckpt), str(bdir),
                                    str(t_ctx), str(b), *(["--quantize", quant] if quant else [])],
                                   env=env, cwd=ROOT, capture_output=True, text=True)
                if r.returncode != 0:
                    raise SystemExit(f"[real_bundles] compiling {vdir.name} {combo_name(t_ctx, b)} failed:\n"
                                     f"{r.stderr[-3000:]}")
                c = json.loads(r.stdout.strip().splitlines()[-1])
            else:
                t = time.perf_counter()
                c = export_bundle(ckpt, bdir, t_ctx, b, quant)
                c["compile_s"] = round(time.perf_counter() - t, 1)
            c["bundle_bytes"] = tree_bytes(bdir)
            c["constants_bytes"] = (bdir.with_name(bdir.name + CONSTANTS)).stat().st_size
            key = combo_name(t_ctx, b) + (f"_{quant}" if quant else "")
            rec["bundles"][key] = c
            peak = f", peak RSS {c['peak_rss_kib'] / 1048576:.2f} GiB" if "peak_rss_kib" in c else ""
            print(f"[real_bundles] {vdir.name} {combo_name(t_ctx, b)}: compile {c['compile_s']} s{peak}, bundle "
                  f"{c['bundle_bytes'] / 1048576:.2f} MiB + constants {c['constants_bytes'] / 1024:.0f} KiB "
                  f"({c['weights_left_out_bytes'] / 1048576:.0f} MiB of weights left out)", file=sys.stderr, flush=True)
        shutil.rmtree(ckpt, ignore_errors=True)
        rec["reference"] = reference_check(mdir, combos, work / f"{name}-weights")
        print(f"[real_bundles] {name}: reference backend {json.dumps(rec['reference'])}", file=sys.stderr, flush=True)
        rec["carried_bytes"] = tree_bytes(mdir) + (tree_bytes(qdir) if name in quantized else 0)
        doc["models"][name] = rec
    doc["carried_bytes"] = sum(m["carried_bytes"] for m in doc["models"].values())
    write_json(out / "prep.json", doc)
    return doc


def reference_check(mdir: Path, combos: list[tuple[int, int]], where: Path) -> dict[str, Any]:
    """The model's smallest-context batch-1 bundle with its weights written (`materialize`, as the
    GPU host does) and stepped twice on the reference backend (NumPy): its logits must be finite;
    the second step's time is what a reference token costs on this machine."""
    import numpy as np

    from tvmpipe.executor.decode_loop import DecodeLoop

    t_ctx, b = min(c for c in combos if c[1] == 1) if any(c[1] == 1 for c in combos) else min(combos)
    t = time.perf_counter()
    path = materialize(mdir / combo_name(t_ctx, b), where / combo_name(t_ctx, b), {})
    made = time.perf_counter() - t
    loop = DecodeLoop(path)
    t = time.perf_counter()
    first = loop.step([1] * b)
    t1 = time.perf_counter()
    second = loop.step([2] * b)
    t2 = time.perf_counter()
    loop.runner.close()
    shutil.rmtree(where, ignore_errors=True)
    if not (np.isfinite(first).all() and np.isfinite(second).all()):
        raise SystemExit(f"[real_bundles] {path}: non-finite logits on the reference backend")
    return {"bundle": combo_name(t_ctx, b), "materialize_s": round(made, 1), "first_step_s": round(t1 - t, 2),
            "step_s": round(t2 - t1, 2), "logits_max": round(float(np.abs(second).max()), 4),
            "logits_std": round(float(np.std(second.astype(np.float64))), 4)}


# ---- there: the weights written on the GPU host ----------------------------------------------------

def bundles_in(real: Path) -> dict[str, dict[tuple[int, int], Path]]:
    """model -> (T, B) -> bundle directory, as `prepare` laid them out under `real`."""
    out: dict[str, dict[tuple[int, int], Path]] = {}
    for mdir in sorted(p for p in real.iterdir() if (p / "config.json").is_file()):
        for b in sorted(mdir.iterdir()):
            if (b / "bundle.json").is_file() and b.name.startswith("T") and "_b" in b.name:
                t, batch = b.name[1:].split("_b")
                out.setdefault(mdir.name, {})[int(t), int(batch)] = b
    return out


def materialize(src: Path, dst: Path, cache: dict[tuple, Any]) -> Path:
    """A copy of bundle `src` at `dst` with its weights in params.safetensors: the generated weight
    matrices (from `cache`, keyed by name, dtype and shape, else generated and put there) and the
    constants of `src`.constants.npz. Loaded (and so checked) before it is returned."""
    import numpy as np

    from tvmpipe.bundle import load_bundle
    from tvmpipe.bundle.graph_reader import read_graph
    from tvmpipe.bundle.params import generate_params, load_npz
    from tvmpipe.bundle.weights import save_safetensors
    from tvmpipe.core.files import write_json

    manifest = json.loads((src / "bundle.json").read_text())
    packed = packed_params(manifest.get("source"))
    if manifest["params"].get("generated") is None:
        raise SystemExit(f"{src}: its weights are not generated (bench/real_bundles.py prepare writes them so)")
    graph = read_graph(src / "graph.json")
    consts = load_npz(src.with_name(src.name + CONSTANTS))
    inputs = set(manifest["inputs"])
    names = [graph.nodes[i].name for i in graph.null_nodes if graph.nodes[i].name not in inputs]
    params: dict[str, np.ndarray] = {}
    missing = []
    for n in names:
        e = graph.entry_of(n)
        if n in consts:
            params[n] = consts[n]
        elif (n, e.dtype, e.shape) in cache:
            params[n] = cache[n, e.dtype, e.shape]
        elif is_weight(e.dtype, e.shape, n, packed):
            missing.append(n)
        else:
            raise SystemExit(f"{src}: param '{n}' ({e.dtype}{list(e.shape)}) is neither a weight matrix nor in "
                             f"{src.name + CONSTANTS}")
    for n, a in generate_params(graph, missing, manifest["params"]["generated"]["seed"]).items():
        e = graph.entry_of(n)
        params[n] = cache[n, e.dtype, e.shape] = a
    if dst.exists():
        shutil.rmtree(dst)
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    sums = save_safetensors(tmp / "params.safetensors", params)
    manifest["params"] = {**manifest["params"], "file": "params.safetensors", "generated": None, "sha256": sums}
    write_json(tmp / "bundle.json", manifest)
    load_bundle(tmp)
    tmp.rename(dst)
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="checkpoints, bundles without weights, constants (here)")
    p.add_argument("--out", required=True)
    p.add_argument("--models", default="135m,1.1b", help=f"comma-separated: {', '.join(MODELS)}")
    p.add_argument("--combos", default=",".join(f"{t}x{b}" for t, b in COMBOS),
                   help="comma-separated TxB: max context x batch")
    p.add_argument("--work", default=None, help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--quantize-models", default="",
                   help="comma-separated models that also get OUT/<model>-int4 (--quantize int4 decode steps)")
    p.add_argument("--quantize-combos", default=None, help="TxB of the int4 bundles (default: --combos)")
    c = sub.add_parser("compile-one", help="(internal) one bundle, in a fresh interpreter")
    c.add_argument("ckpt")
    c.add_argument("out")
    c.add_argument("max_context", type=int)
    c.add_argument("batch", type=int)
    c.add_argument("--quantize", default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.cmd == "compile-one":
        compile_one(args.ckpt, args.out, args.max_context, args.batch, args.quantize)
        return 0
    import tempfile

    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"unknown model {unknown[0]!r}: one of {', '.join(MODELS)}")
    combos = [tuple(int(x) for x in c.split("x")) for c in args.combos.split(",")]
    work = Path(args.work or tempfile.mkdtemp(prefix="tvmpipe-real-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        quantized = tuple(m for m in args.quantize_models.split(",") if m)
        if any(m not in models for m in quantized):
            ap.error("--quantize-models must name models of --models")
        qcombos = [tuple(int(x) for x in c.split("x")) for c in args.quantize_combos.split(",")] \
            if args.quantize_combos else None
        doc = prepare(Path(args.out), models, combos, work, quantized=quantized,  # type: ignore[arg-type]
                      quant_combos=qcombos)  # type: ignore[arg-type]
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print(f"[real_bundles] {len(models)} model(s) x {len(combos)} bundle(s) in {args.out}: "
          f"{doc['carried_bytes'] / 1048576:.2f} MiB carried", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
