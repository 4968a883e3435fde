"""Quantized models: a GGUF file of a real configuration through `tvmpipe compile FILE.gguf --decode`.

    python bench/quant.py                 # SmolLM-135M's configuration
    python bench/quant.py --models 1.1b   # TinyLlama-1.1B's (a ~0.7 GB file)

The file is written with gguf's GGUFWriter from the configuration (bench/checkpoint.py MODELS),
seeded random weights, in a Q4_K_M-like mix: Q4_K where a row is whole 256-value blocks (the MLP's
down projection at 135M; every matrix at 1.1B), Q4_0 elsewhere, the MLP's down projection and the
head Q6_K where they are whole blocks, the embedding Q8_0. Per file:

  * file and bundle bytes (the bundle's weights against the file's tensor bytes: target <= 1.05x);
  * compile: wall time and peak RSS of `tvmpipe compile FILE.gguf --decode --max-context 16` in a
    child process (bench/checkpoint.py `measure`: VmHWM), against 1.5 x the file + 1 GiB;
  * the reference backend's tokens/s (greedy_decode, NumPy, one process) over 8 new tokens;
  * stages: `tvmpipe generate B --stages K --local` at K = 2 and 4, each stage actor's peak RSS
    against the packed weights / K + 0.45 GiB and against the heaviest stage's own weights +
    0.45 GiB (bench/checkpoint.py's measure: cuts fall between layers, so shares differ);
  * `--quantize int4` (part `quantize`): a float32 checkpoint of the configuration
    (save_pretrained, random init) compiled with `--decode --quantize int4` in a child: its weights
    against the checkpoint's (target <= 0.3x), compile time and peak, reference tokens/s.

Results go to bench/results/quant.json (with `when`, `commit`, `machine`); `make perf-page` puts
them in docs/performance.md. The GPU comparison (int4 against fp16 tokens/s) is not measured
here: see docs/compiler.md, "GGUF files and packed weights".
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from bench.checkpoint import GIB, MAKE, MODELS, checkpoint_bytes, gib, measure, status_kib  # noqa: E402

PROMPT = [1, 415, 2936, 9060, 285, 1142, 28705, 13]
NEW = 8


def write_file(path: Path, cfg: dict, seed: int = 0) -> dict:
    """A Llama GGUF of configuration `cfg` (bench/checkpoint.py MODELS) in a Q4_K_M-like mix."""
    import gguf
    import numpy as np

    from tests.support.gguf_files import _tensor

    rng = np.random.default_rng(seed)
    h, layers, heads, kv = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], \
        cfg["num_key_value_heads"]
    ffn, vocab, hd = cfg["intermediate_size"], cfg["vocab_size"], cfg["hidden_size"] // cfg["num_attention_heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("bench llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_rope_dimension_count(hd)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("llama")  # SentencePiece-style: <unk>, <s>, </s>, then plain pieces
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(3, vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([2, 3, 3] + [1] * (vocab - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    types: dict[str, int] = {}

    def add(name: str, rows: int, cols: int, kind: str) -> None:
        t = kind if kind in ("F32", "Q8_0", "Q4_0") or cols % 256 == 0 else ("Q4_0" if kind == "Q4_K" else "Q8_0")
        types[t] = types.get(t, 0) + 1
        value = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02) if t in ("Q8_0", "Q4_0") \
            else np.zeros((rows, cols), np.float32)  # the k-quants are random blocks (tests/support/gguf_files.py)
        _tensor(w, rng, name, value, t)

    add("token_embd.weight", vocab, h, "Q8_0")
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(h, np.float32))
        for n, r in (("attn_q", h), ("attn_k", kv * hd), ("attn_v", kv * hd), ("attn_output", h)):
            add(f"blk.{i}.{n}.weight", r, h, "Q4_K")
        add(f"blk.{i}.ffn_gate.weight", ffn, h, "Q4_K")
        add(f"blk.{i}.ffn_up.weight", ffn, h, "Q4_K")
        add(f"blk.{i}.ffn_down.weight", h, ffn, "Q6_K")
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    if not cfg.get("tie_word_embeddings"):
        add("output.weight", vocab, h, "Q6_K")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return types


def reference_tokens_per_s(bundle: Path) -> float:
    from tvmpipe.executor.decode_loop import greedy_decode

    greedy_decode(bundle, PROMPT[:2], 1)  # warm: maps the weights
    t = time.perf_counter()
    greedy_decode(bundle, PROMPT, NEW)
    return round((len(PROMPT) + NEW - 1) / (time.perf_counter() - t), 2)


def stages(bundle: Path, k: int, weights: int) -> dict:
    """`tvmpipe generate --stages K --local`: each stage actor's peak RSS against its targets."""
    import os

    sys.path[:0] = [str(ROOT / "bench")]
    from bigmodel import monitored  # the /proc sampler of a command's process tree

    g = monitored(["timeout", "1200", sys.executable, "-m", "tvmpipe", "generate", str(bundle), "--stages", str(k),
                   "--local", "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "4", "--json"],
                  dict(os.environ))
    try:
        doc = json.loads(g["stdout"][g["stdout"].index("{"):])
    except ValueError:
        return {"error": (g["stderr"] or g["stdout"])[-2000:]}
    actors = sorted((p["hwm_kib"] * 1024 for p in g["peaks"].values() if "StageActor" in p["cmd"]), reverse=True)[:k]
    held = [s.get("weight_bytes") or 0 for s in (doc.get("metrics") or {}).get("stages") or []]
    target = weights / k + 0.45 * GIB
    return {"stage_peak_rss_gib": [gib(x) for x in actors], "stage_weight_gib": [gib(x) for x in held],
            "target_gib": gib(target), "within_target": bool(actors) and max(actors) <= target,
            "heaviest_target_gib": gib(max(held, default=0) + 0.45 * GIB),
            "within_heaviest_target": bool(actors) and max(actors) <= max(held, default=0) + 0.45 * GIB,
            "tokens": [s["tokens"] for s in doc["sequences"]], "wall_s": round(g["wall_s"], 1)}


def run(model: str, work: Path) -> dict:
    from tests.support.gguf_files import tensor_bytes
    from tvmpipe.bundle import load_bundle

    f = work / f"{model}.gguf"
    t = time.perf_counter()
    types = write_file(f, MODELS[model])
    write_s = time.perf_counter() - t
    out = work / "bundle"
    m = measure(f, out)
    b = load_bundle(out)
    weights = sum(b.param_nbytes(n) for n in b.param_names)
    tb = tensor_bytes(f)
    file_bytes = f.stat().st_size
    peak = m["peak_kib"] * 1024
    return {"model": model, "types": types, "file_gib": gib(file_bytes), "tensor_bytes": tb,
            "bundle_weight_bytes": weights, "bundle_over_file_tensors": round(weights / tb, 4),
            "write_s": round(write_s, 1), "compile_s": m["compile_s"], "compile_peak_gib": gib(peak),
            "compile_baseline_gib": gib(m["baseline_kib"] * 1024),
            "compile_target_gib": gib(1.5 * file_bytes + GIB), "compile_within_target": peak <= 1.5 * file_bytes + GIB,
            "reference_tokens_per_s": reference_tokens_per_s(out),
            "stages": {str(k): stages(out, k, weights) for k in (2, 4)}}


def quantize_child(source: str, out: str, scheme: str) -> None:
    """In a fresh interpreter: the libraries imported (the baseline), then `tvmpipe compile SOURCE
    --decode --quantize SCHEME`; prints baseline and peak RSS (KiB) and the wall time."""
    from tvmpipe.compiler.export import compile_model, require_tvm
    from tvmpipe.compiler.progress import Progress
    from tvmpipe.compiler.zoo import ensure_torchvision

    require_tvm()
    ensure_torchvision()
    import transformers

    transformers.LlamaForCausalLM  # noqa: B018
    base = status_kib("VmRSS")
    t = time.perf_counter()
    compile_model(source, out, decode=16, quantize=scheme, overwrite=True, progress=Progress(stream=None))
    print(json.dumps({"baseline_kib": base, "peak_kib": status_kib("VmHWM"), "compile_s": round(time.perf_counter() - t, 2)}))


def run_quantize(model: str, work: Path, scheme: str = "int4") -> dict:
    """`tvmpipe compile DIR --decode --quantize int4` of a float32 checkpoint of `model`'s
    configuration (save_pretrained, random init): weights against the checkpoint's (target
    <= 0.3x), compile time and peak RSS (target 1.5x the checkpoint + 1 GiB), reference tokens/s."""
    import subprocess

    from tvmpipe.bundle import load_bundle

    ckpt, out = work / f"{model}-float32", work / f"{model}-{scheme}.bundle"
    subprocess.run([sys.executable, "-c", MAKE, json.dumps(MODELS[model]), "float32", str(ckpt)], check=True,
                   cwd=ROOT, capture_output=True)
    ck = checkpoint_bytes(ckpt)
    code = "import sys; sys.path[:0] = [sys.argv[1]]; from bench.quant import quantize_child; quantize_child(*sys.argv[2:5])"
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT), str(ckpt), str(out), scheme], capture_output=True,
                          text=True, cwd=ROOT)
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    b = load_bundle(out)
    weights = sum(b.param_nbytes(n) for n in b.param_names)
    peak = m["peak_kib"] * 1024
    return {"scheme": scheme, "checkpoint_bytes": ck, "checkpoint_gib": gib(ck), "bundle_weight_bytes": weights,
            "bundle_over_checkpoint": round(weights / ck, 4), "within_0_3": weights <= 0.3 * ck,
            "compile_s": m["compile_s"], "compile_peak_gib": gib(peak), "compile_target_gib": gib(1.5 * ck + GIB),
            "compile_within_target": peak <= 1.5 * ck + GIB, "reference_tokens_per_s": reference_tokens_per_s(out)}


def main(argv: list[str] | None = None) -> int:
    from bench.stamp import stamp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["135m"], choices=list(MODELS))
    ap.add_argument("--parts", nargs="+", default=["gguf", "quantize"], choices=["gguf", "quantize"])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "quant.json"))
    args = ap.parse_args(argv)
    runs = []
    for model in args.models:
        work = Path(tempfile.mkdtemp(prefix=f"tvmpipe-quant-{model}-"))
        try:
            runs.append(run(model, work) if "gguf" in args.parts else {"model": model})
            if "quantize" in args.parts:
                runs[-1]["quantize"] = run_quantize(model, work)
            print(json.dumps(runs[-1]), flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    old = Path(args.out)
    if set(args.parts) != {"gguf", "quantize"} and old.is_file():  # a part re-measured: the others kept
        kept = {r["model"]: r for r in json.loads(old.read_text()).get("runs", [])}
        for r in runs:
            kept[r["model"]] = {**kept.get(r["model"], {}), **r}
        runs = list(kept.values())
    Path(args.out).write_text(json.dumps(stamp({"runs": runs}), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
