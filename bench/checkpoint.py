"""Real-size Llama checkpoints through `tvmpipe compile DIR --decode` and a 4-stage pipeline.

    python bench/checkpoint.py                                   # 135M and 1.1B, bf16 and fp32
    python bench/checkpoint.py --models 135m --dtypes bfloat16   # one of them

Each checkpoint is written by transformers' `save_pretrained` (random weights, the model's own
initialisation) from a real configuration: SmolLM-135M's (30 layers, hidden 576, 9 heads, 3 KV
heads, intermediate 1536, vocabulary 49152, tied embedding) and TinyLlama-1.1B's (22 layers,
hidden 2048, 32 heads, 4 KV heads, intermediate 5632, vocabulary 32000, untied). Per checkpoint
and dtype:

  * compile: `tvmpipe compile DIR --decode --max-context T` in a child process, its wall time and
    peak RSS (VmHWM, sampled from /proc as bench/bigmodel.py samples), against the target
    1.5 x the checkpoint's bytes + 1 GiB; the bundle's weight bytes against the checkpoint's
    (a tied embedding stored once: <= 1.02x);
  * stages: `tvmpipe generate B --stages 4 --local` (8 new tokens), each stage actor's peak RSS
    (largest first: a Ray worker's title does not say its stage) against weights / 4 + 0.45 GiB,
    and against the heaviest stage's own weights + 0.45 GiB (cuts fall between layers, so the
    stages' shares differ), and the weights each stage reports holding;
  * on the 135M configuration, in one child process and one after the other: the single-process
    reference loop (`tvmpipe.executor.decode_loop.greedy_decode`, NumPy) and transformers'
    `generate(do_sample=False)` on the same checkpoint, prompt and dtype, in tokens/s.

Results go to bench/results/checkpoint.json (with `when`, `commit`, `machine`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

GIB = 1 << 30
MODELS = {
    "135m": dict(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, intermediate_size=1536, max_position_embeddings=2048, rms_norm_eps=1e-5,
                 tie_word_embeddings=True),
    "1.1b": dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4, intermediate_size=5632, max_position_embeddings=2048, rms_norm_eps=1e-5,
                 tie_word_embeddings=False),
}
PROMPT = [1, 415, 2936, 9060, 285, 1142, 28705, 13]

MAKE = r"""
import json, sys, torch
from tvmpipe.compiler.zoo import ensure_torchvision
ensure_torchvision()
import transformers
cfg, dtype, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).to(getattr(torch, dtype))
model.save_pretrained(out)
"""

SPEED = r"""
import json, sys, time
from tvmpipe.compiler.zoo import ensure_torchvision
ensure_torchvision()
import torch, transformers
from tvmpipe.executor.decode_loop import greedy_decode
ckpt, bundle, dtype, new = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
prompt = json.loads(sys.argv[5])
out = {"threads": {"torch": torch.get_num_threads(), "OPENBLAS_NUM_THREADS": __import__("os").environ.get("OPENBLAS_NUM_THREADS")}}
greedy_decode(bundle, prompt, 2)  # warm-up: the runner's first build
t = time.perf_counter(); r = greedy_decode(bundle, prompt, new); dt = time.perf_counter() - t
out["reference"] = {"seconds": round(dt, 3), "tokens_per_s": round(new / dt, 2), "steps": len(prompt) + new - 1,
                    "ms_per_step": round(1000 * dt / (len(prompt) + new - 1), 2), "tokens": r.tokens[0]}
model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype), local_files_only=True,
                                                          attn_implementation="eager").eval()
ids = torch.tensor([prompt])
kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, eos_token_id=None)
with torch.no_grad():
    model.generate(ids, max_new_tokens=2, **kw)  # warm-up
    t = time.perf_counter(); got = model.generate(ids, max_new_tokens=new, **kw); dt = time.perf_counter() - t
out["transformers"] = {"seconds": round(dt, 3), "tokens_per_s": round(new / dt, 2), "tokens": got[0, len(prompt):].tolist()}
out["same_tokens"] = out["reference"]["tokens"] == out["transformers"]["tokens"]
print(json.dumps(out))
"""


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def child(source: str, out: str, max_context: int) -> None:
    """Runs in the measured process: the libraries imported (tvm, torch, transformers' Llama), the
    resident set then (the baseline), `tvmpipe compile SOURCE --decode`, the peak (VmHWM); prints
    one JSON line."""
    from tvmpipe.compiler.export import compile_model, require_tvm
    from tvmpipe.compiler.progress import Progress
    from tvmpipe.compiler.zoo import ensure_torchvision

    require_tvm()
    ensure_torchvision()
    import transformers

    transformers.LlamaForCausalLM  # noqa: B018  (transformers imports its model modules lazily)
    base = status_kib("VmRSS")
    t = time.perf_counter()
    compile_model(source, out, decode=max_context, overwrite=True, progress=Progress(stream=None))
    print(json.dumps({"baseline_kib": base, "peak_kib": status_kib("VmHWM"), "compile_s": round(time.perf_counter() - t, 2)}))


def measure(source: Path, out: Path, max_context: int = 16) -> dict:
    """Compile checkpoint SOURCE's decode step in a fresh interpreter: baseline and peak RSS (KiB)."""
    code = "import sys; sys.path[:0] = [sys.argv[1]]; from bench.checkpoint import child; child(*sys.argv[2:4], int(sys.argv[4]))"
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT), str(source), str(out), str(max_context)],
                          capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"compile child failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def gib(n: float) -> float:
    return round(n / GIB, 3)


def checkpoint_bytes(path: Path) -> int:
    """The tensors' bytes in the checkpoint's safetensors files (headers left out)."""
    from tvmpipe.bundle.weights import WeightsFile

    total = 0
    for f in sorted(path.glob("*.safetensors")):
        wf = WeightsFile(f)
        total += sum(t.nbytes for t in wf.tensors.values())
        wf.close()
    return total


def bench_one(name: str, dtype: str, work: Path, max_context: int, env: dict, speed: bool, new: int) -> dict:
    from bigmodel import monitored  # the /proc sampler of a command's process tree

    ckpt, bundle = work / f"{name}-{dtype}", work / f"{name}-{dtype}.bundle"
    rec: dict = {"model": name, "dtype": dtype, "config": MODELS[name], "max_context": max_context}
    print(f"[{name} {dtype}] save_pretrained ...", flush=True)
    t = time.time()
    subprocess.run([sys.executable, "-c", MAKE, json.dumps(MODELS[name]), dtype, str(ckpt)], check=True, env=env,
                   cwd=ROOT, capture_output=True)
    rec["save_s"] = round(time.time() - t, 1)
    ck = checkpoint_bytes(ckpt)
    rec.update(checkpoint_bytes=ck, checkpoint_gib=gib(ck))
    print(f"[{name} {dtype}] compile ({gib(ck)} GiB of weights) ...", flush=True)
    c = monitored([sys.executable, "-m", "tvmpipe", "compile", str(ckpt), "--decode", "--max-context",
                   str(max_context), "-o", str(bundle), "--force", "--quiet"], env)
    if c["rc"] != 0:
        rec["compile_error"] = c["stderr"][-2000:]
        print(rec["compile_error"], file=sys.stderr)
        return rec
    peak = max(p["hwm_kib"] for p in c["peaks"].values()) * 1024
    from tvmpipe.bundle import load_bundle

    b = load_bundle(bundle, verify_checksums=False)
    w = b.weight_bytes
    rec.update(compile_s=round(c["wall_s"], 1), compile_peak_rss_gib=gib(peak),
               compile_target_gib=gib(1.5 * ck + GIB), compile_within_target=peak <= 1.5 * ck + GIB,
               compile_peak_over_checkpoint=round(peak / ck, 2),
               bundle_weight_bytes=w, bundle_over_checkpoint=round(w / ck, 4))
    print(f"[{name} {dtype}] compile {rec['compile_s']} s, peak {rec['compile_peak_rss_gib']} GiB "
          f"(target {rec['compile_target_gib']}), bundle weights {rec['bundle_over_checkpoint']}x the checkpoint's",
          flush=True)
    print(f"[{name} {dtype}] tvmpipe generate --stages 4 --local ...", flush=True)
    g = monitored(["timeout", "900", sys.executable, "-m", "tvmpipe", "generate", str(bundle), "--stages", "4",
                   "--local", "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "8", "--json"], env)
    try:
        doc = json.loads(g["stdout"][g["stdout"].index("{"):])
    except ValueError:
        rec["generate_error"] = (g["stderr"] or g["stdout"])[-2000:]
        print(rec["generate_error"], file=sys.stderr)
        return rec
    actors = sorted((p["hwm_kib"] * 1024 for p in g["peaks"].values() if "StageActor" in p["cmd"]), reverse=True)
    stages = (doc.get("metrics") or {}).get("stages") or []
    target = w / 4 + 0.45 * GIB
    held = [s.get("weight_bytes") or 0 for s in stages]
    rec.update(k4_heaviest_stage_target_gib=gib(max(held, default=0) + 0.45 * GIB),
               k4_within_heaviest_stage_target=bool(actors) and max(actors[:4]) <= max(held, default=0) + 0.45 * GIB)
    rec.update(k4_tokens=[s["tokens"] for s in doc["sequences"]], k4_wall_s=round(g["wall_s"], 1),
               k4_stage_peak_rss_gib=[gib(x) for x in actors[:4]],
               k4_stage_weight_gib=[gib(s.get("weight_bytes") or 0) for s in stages],
               k4_stage_target_gib=gib(target), k4_within_target=bool(actors) and max(actors[:4]) <= target)
    print(f"[{name} {dtype}] K=4 stage peaks {rec['k4_stage_peak_rss_gib']} GiB (target {rec['k4_stage_target_gib']}), "
          f"weights held {rec['k4_stage_weight_gib']} GiB", flush=True)
    if speed:
        print(f"[{name} {dtype}] reference loop vs transformers generate ({new} new tokens) ...", flush=True)
        s = subprocess.run([sys.executable, "-c", SPEED, str(ckpt), str(bundle), dtype, str(new), json.dumps(PROMPT)],
                           env=env, cwd=ROOT, capture_output=True, text=True)
        if s.returncode != 0:
            rec["speed_error"] = s.stderr[-2000:]
            print(rec["speed_error"], file=sys.stderr)
        else:
            rec["speed"] = json.loads(s.stdout.strip().splitlines()[-1])
            r, t = rec["speed"]["reference"], rec["speed"]["transformers"]
            print(f"[{name} {dtype}] reference loop {r['tokens_per_s']} tokens/s, transformers {t['tokens_per_s']} "
                  f"tokens/s (same tokens: {rec['speed']['same_tokens']})", flush=True)
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="135m,1.1b", help=f"comma-separated: {', '.join(MODELS)}")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--max-context", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32, help="tokens per speed run (135M only)")
    p.add_argument("--work", default=None, help="where the checkpoints and bundles go (default: a temp dir, removed)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "checkpoint.json"))
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "bench"))
    from stamp import stamp

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + [x for x in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if x])}
    work = Path(args.work or tempfile.mkdtemp(prefix="tvmpipe-checkpoint-"))
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else {}
    results.setdefault("runs", {})
    t0 = time.time()
    try:
        for name in args.models.split(","):
            for dtype in args.dtypes.split(","):
                rec = bench_one(name, dtype, work, args.max_context, env, name == "135m", args.new_tokens)
                rec["load_average"] = [round(x, 2) for x in os.getloadavg()]
                results["runs"][f"{name}-{dtype}"] = rec
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(stamp(results), indent=1) + "\n")
                for f in work.iterdir():  # one checkpoint and bundle on disk at a time
                    shutil.rmtree(f, ignore_errors=True)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {out} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
