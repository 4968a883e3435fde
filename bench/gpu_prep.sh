#!/usr/bin/env bash
# Prepare the one-call GPU check (issue 8). Runs HERE, on a CPU machine with network and TVM:
#
#   bash bench/gpu_prep.sh            # PYTHON=... to choose the interpreter (needs tvmpipe + apache-tvm)
#
# 1. .whl/: the PyCUDA 2026.1 sdist and the wheels it needs on the GPU machine (CPython 3.12,
#    x86-64 manylinux) that its image lacks (docs/gpu-validation.md lists why each one);
# 2. .gpu/bundles/{resnet18,transformer}: compiled here (TVM is not on the GPU machine), with
#    generated weights (--omit-params: params.generated = {"seed": 0}) so they stay small; and
#    .gpu/bundles/gpt2_decode, GPT-2's decode step (tiny config, seeded weights, max context 64),
#    gpt2_decode_b4, the same step for static batches of 4, and gpt2_decode_c8, the same step taking
#    prompts 8 tokens a step (chunked prefill), for the `decode` step; and .gpu/bundles/real, the
#    real-size Llama decode steps of the `decode_real` step (bench/real_bundles.py: SmolLM-135M's and
#    TinyLlama-1.1B's configurations, fp16, T 512 and 2048, batch 1 and 8, weights left out and
#    written on the GPU host; GPU_PREP_REAL_MODELS= skips them, ~6 min on 2 cores);
# 3. checks the sizes against the device tool's 64 MiB working-tree limit and prints the exact `run`
#    call that does the whole check (bench/gpu_check.sh) there, also saved as .gpu/run-call.json.
# Both folders are git-ignored; the run call carries them. Re-run this in every new session: they
# are not committed, and the bundles must match the compiler of the checkout being tested.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$PWD

PYCUDA=pycuda==2026.1
# Wheels the GPU image lacks (KINDS.md, "Python packages already there"): PyCUDA's runtime deps
# pytools, platformdirs, mako, siphash24 (MarkupSafe, typing-extensions, numpy are there), and
# msgpack at the version pyproject.toml pins. Build deps setuptools, wheel, numpy are there;
# so are pytest, pytest-timeout and hypothesis.
WHEELS=(pytools==2026.1.1 platformdirs==4.14.7 mako==1.4.3 siphash24==1.9 msgpack==1.2.4)
LIMIT_MIB=64
BUDGET_MIB=${GPU_PREP_BUDGET_MIB:-48}  # stay well under the limit: the tree grows between sessions

say() { printf '[gpu_prep] %s\n' "$*" >&2; }
die() { say "ERROR: $*"; exit 1; }

# ---- interpreter --------------------------------------------------------------------------------
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for c in .venv/bin/python /tmp/venv/bin/python python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import tvm, tvmpipe.compiler' >/dev/null 2>&1; then PY=$c; break; fi
  done
fi
[ -n "$PY" ] || die "no Python with tvmpipe and apache-tvm found: run 'make .venv/.dev' (pip install -e '.[dev,compile]') or set PYTHON=..."
"$PY" -c 'import tvm, tvmpipe.compiler' || die "$PY cannot import tvm and tvmpipe.compiler"
say "python: $PY ($("$PY" -c 'import sys, tvm; print(sys.version.split()[0], "tvm", tvm.__version__)'))"

# ---- 1. wheels and the PyCUDA sdist ---------------------------------------------------------------
mkdir -p .whl
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
say "downloading ${WHEELS[*]} (cp312 manylinux x86_64) and the $PYCUDA sdist"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$tmp/wheels" "${WHEELS[@]}" 2>&1 | grep -v 'is ignored: it is neither' >&2 || true
# The sdist only (--no-binary pycuda; its build deps may be wheels). pip prepares its metadata, which
# needs no CUDA. Falls back to a plain download of the file if that step fails.
"$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary pycuda -d "$tmp/sdist" "$PYCUDA" 2>&1 \
  | grep -v 'is ignored: it is neither' >&2 || true
for w in "${WHEELS[@]}"; do
  name=${w%%==*}; ver=${w##*==}
  found=""
  for f in "$tmp/wheels/"*.whl; do
    case "${f##*/}" in "${name//-/_}-${ver}-"*) found=$f ;; esac
  done
  [ -n "$found" ] || die "pip did not fetch $w"
done
[ -f "$tmp/sdist/pycuda-2026.1.tar.gz" ] || die "pip did not fetch the $PYCUDA sdist"
# Replace older copies of the same projects; leave anything else in .whl/ alone, but say so.
for f in "$tmp/wheels/"*.whl "$tmp/sdist/pycuda-2026.1.tar.gz"; do
  base=$(basename "$f"); proj=${base%%-*}
  find .whl -maxdepth 1 -type f -iname "${proj}-*" ! -name "$base" -print -delete | sed 's/^/[gpu_prep] removed older /' >&2
  cp -f "$f" .whl/
done
ours=$(for f in "$tmp/wheels/"*.whl "$tmp/sdist/"*.tar.gz; do echo "${f##*/}"; done | sort)
others=$(for f in .whl/*; do [ -e "$f" ] && echo "${f##*/}"; done | sort | comm -23 - <(echo "$ours") || true)
[ -z "$others" ] || say "note: .whl/ also holds files this script did not fetch (gpu_check.sh installs every .whl/*.whl): $others"

# ---- 2. bundles ---------------------------------------------------------------------------------
mkdir -p .gpu/bundles
for m in resnet18 transformer; do
  say "compiling $m -> .gpu/bundles/$m (generated weights)"
  "$PY" -m tvmpipe compile "$m" -o ".gpu/bundles/$m" --omit-params --force --quiet
done
# Three published architectures from the zoo (transformers' BERT, GPT-2 and Llama, small configs,
# seeded weights kept in the bundle: under 1 MiB each), exported with torch.export and compiled.
ZOO_MODELS=(bert_mask gpt2 llama)
for m in "${ZOO_MODELS[@]}"; do
  say "exporting and compiling zoo model $m -> .gpu/bundles/$m"
  pt2=$("$PY" -c 'import sys; from pathlib import Path; from tvmpipe.compiler.zoo import ZOO, export_model
print(export_model(ZOO[sys.argv[1]], "pt2", Path(sys.argv[2]))[0])' "$m" "$tmp/zoo")
  "$PY" -m tvmpipe compile "$pt2" -o ".gpu/bundles/$m" --name "$m" --force --quiet
done
# The decode fixture of bench/generate.py (tests/support/decode_bundle.py), for the `generate` step:
# the simulated-stage sweep run on the GPU host's 16 cores (a core per stage, which this VM lacks).
say "compiling the decode fixture -> .gpu/bundles/decode_fixture/bundle"
rm -rf .gpu/bundles/decode_fixture
"$PY" -c 'import shutil, sys; sys.path.insert(0, "."); from tests.support.decode_bundle import decode_bundle
shutil.copytree(decode_bundle(sys.argv[1]), ".gpu/bundles/decode_fixture/bundle")' "$tmp/decode_fixture"
# Each bundle must load, use generated weights, and give finite outputs on the reference backend.
# The decode step measures static caches (bytes a slot, on the device): --kv static, not the
# default paged layout (paged kernels on a GPU: bench/paged_gpu.py).
say "compiling gpt2 --decode --kv static -> .gpu/bundles/gpt2_decode (max context 64, seeded weights)"
"$PY" -m tvmpipe compile gpt2 --decode --kv static --max-context 64 --seed 1 -o .gpu/bundles/gpt2_decode --force --quiet
say "compiling gpt2 --decode --kv static --batch 4 -> .gpu/bundles/gpt2_decode_b4 (the same weights, 4 sequences a micro-batch)"
"$PY" -m tvmpipe compile gpt2 --decode --kv static --max-context 64 --seed 1 --batch 4 -o .gpu/bundles/gpt2_decode_b4 --force --quiet
say "compiling gpt2 --decode --kv static --chunk 8 -> .gpu/bundles/gpt2_decode_c8 (the same weights, prompts 8 tokens a step)"
"$PY" -m tvmpipe compile gpt2 --decode --kv static --max-context 64 --seed 1 --chunk 8 -o .gpu/bundles/gpt2_decode_c8 --force --quiet
# The real-size decode steps (issue 47): checkpoints in $tmp (not carried), bundles without weights
REAL_MODELS=${GPU_PREP_REAL_MODELS-135m,1.1b}
if [ -n "$REAL_MODELS" ]; then
  say "compiling real-size decode steps ($REAL_MODELS; ${GPU_PREP_REAL_COMBOS:-512x1,2048x1,512x8,2048x8}) -> .gpu/bundles/real"
  rm -rf .gpu/bundles/real
  # GPU_PREP_REAL_QUANT (issue 52, opt-in: e.g. 1.1b): those models' --quantize int4 steps too, as <model>-int4
  "$PY" bench/real_bundles.py prepare --out .gpu/bundles/real --models "$REAL_MODELS" \
    --combos "${GPU_PREP_REAL_COMBOS:-512x1,2048x1,512x8,2048x8}" --work "$tmp/real" \
    --quantize-models "${GPU_PREP_REAL_QUANT:-}" --quantize-combos "${GPU_PREP_REAL_QUANT_COMBOS:-512x1,512x8}"
else
  say "GPU_PREP_REAL_MODELS is empty: no real-size decode steps (the decode_real step then fails)"
fi
"$PY" - <<'EOF'
import json, numpy as np
from tvmpipe.bundle import load_bundle
from tvmpipe.executor import GraphRunner, random_inputs
for m in ("resnet18", "transformer"):
    b = load_bundle(f".gpu/bundles/{m}")
    assert b.manifest.params_file is None and b.manifest.params_seed == 0, f"{m}: weights are not generated"
    with GraphRunner(b) as r:
        r.run(**random_inputs(b, seed=4))
        outs = [r.get_output(i) for i in range(r.get_num_outputs())]
    assert all(np.isfinite(o).all() for o in outs), f"{m}: non-finite reference outputs"
    print(f"[gpu_prep] {m}: {len(b.graph.op_nodes)} op nodes, outputs {[list(o.shape) for o in outs]}, "
          f"max|out| {max(float(np.abs(o).max()) for o in outs):.3g} (reference backend)")
for m in ("bert_mask", "gpt2", "llama"):
    b = load_bundle(f".gpu/bundles/{m}")
    with GraphRunner(b) as r:
        r.run(**random_inputs(b, seed=4))
        outs = [r.get_output(i) for i in range(r.get_num_outputs())]
    assert all(np.isfinite(o).all() for o in outs), f"{m}: non-finite reference outputs"
    print(f"[gpu_prep] {m}: {len(b.graph.op_nodes)} op nodes, outputs {[list(o.shape) for o in outs]} (reference backend)")
EOF

# ---- CPython 3.12 headers, in case the GPU image has no Python.h (python3.12-dev) ----------------
# gpu_check.sh uses them only when its Python's include dir lacks Python.h (via CPATH).
hdr=""
for c in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /root/.pyenv/versions/3.12*/bin/python3.12; do
  if command -v "$c" >/dev/null 2>&1; then
    inc=$("$c" -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null || true)
    if [ -f "$inc/Python.h" ] && [ "$(basename "$inc")" = python3.12 ]; then hdr=$inc; break; fi
  fi
done
if [ -n "$hdr" ]; then
  tar czf .gpu/py312-include.tar.gz -C "$(dirname "$hdr")" python3.12
  say "carried CPython headers from $hdr ($(du -h .gpu/py312-include.tar.gz | cut -f1))"
else
  rm -f .gpu/py312-include.tar.gz
  say "note: no local CPython 3.12 headers found; gpu_check.sh then relies on the GPU image's Python.h"
fi

# ---- provenance ---------------------------------------------------------------------------------
"$PY" - <<EOF
import hashlib, json, pathlib, subprocess, time, sys, tvm
def sha(p): return hashlib.sha256(p.read_bytes()).hexdigest()
def git(*a):
    try: return subprocess.run(["git", *a], capture_output=True, text=True, cwd="$REPO").stdout.strip()
    except OSError: return None
files = {str(p): sha(p) for p in sorted(pathlib.Path(".whl").iterdir()) if p.is_file()}
files.update({str(p): sha(p) for p in sorted(pathlib.Path(".gpu/bundles").rglob("*")) if p.is_file()})
json.dump({"prepared": time.strftime("%Y-%m-%dT%H:%M:%S"), "git_head": git("rev-parse", "HEAD"),
           "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
           "tvm": tvm.__version__, "python": sys.version.split()[0], "files": files},
          open(".gpu/PREP.json", "w"), indent=1)
EOF

# ---- 3. sizes -------------------------------------------------------------------------------------
mib() { awk -v b="$1" 'BEGIN { printf "%.2f", b / 1048576 }'; }
bytes_of() { find "$@" -type f -printf '%s\n' 2>/dev/null | awk '{ s += $1 } END { print s + 0 }'; }
whl_b=$(bytes_of .whl); gpu_b=$(bytes_of .gpu)
tree_b=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null | awk '{ s += $1 } END { print s + 0 }')
shared_b=0; [ -d shared ] && shared_b=$(bytes_of shared)
total_b=$((whl_b + gpu_b + tree_b + shared_b))
say "sizes: .whl $(mib "$whl_b") MiB, .gpu $(mib "$gpu_b") MiB, working tree $(mib "$tree_b") MiB, shared/ $(mib "$shared_b") MiB"
say "total that travels: $(mib "$total_b") MiB (limit $LIMIT_MIB MiB, budget $BUDGET_MIB MiB)"
[ "$total_b" -le $((BUDGET_MIB * 1048576)) ] || die "over the ${BUDGET_MIB} MiB budget: trim the working tree or the carried folders"
ls -l .whl .gpu/bundles/* >&2

# ---- the run call ---------------------------------------------------------------------------------
CMD='PYTHONUNBUFFERED=1 bash bench/gpu_check.sh'
"$PY" - "$CMD" <<'EOF'
import json, sys
call = {"command": sys.argv[1], "carry": [".whl", ".gpu"], "timeout_s": 600}
assert len(call["command"]) <= 2000
open(".gpu/run-call.json", "w").write(json.dumps(call, indent=1) + "\n")
print(json.dumps(call))
EOF
REAL_CMD='GPU_CHECK_STEPS=env,wheels,pycuda,tvmpipe,decode_real PYTHONUNBUFFERED=1 bash bench/gpu_check.sh'
"$PY" - "$REAL_CMD" <<'EOF'
import json, sys
call = {"command": sys.argv[1], "carry": [".whl", ".gpu"], "timeout_s": 600}
open(".gpu/run-call-decode-real.json", "w").write(json.dumps(call, indent=1) + "\n")
print(json.dumps(call))
EOF
say "the second line is the decode_real step's own call (issue 47; .gpu/run-call-decode-real.json)"
say "next (a session whose task has a GPU): call the device tool's run with the JSON above, then copy"
say "the returned gpu_check.json and the step files (executor_gpu, gpu_pipeline, ipc_gpu, upload_gpu, generate_gpu_host,"
say "decode_gpu .json) into bench/results/, named with the GPU model and driver (docs/gpu-validation.md)."
