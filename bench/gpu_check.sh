#!/usr/bin/env bash
# The whole GPU check of issue 8, in one run on the GPU machine (see docs/gpu-validation.md):
#
#   PYTHONUNBUFFERED=1 bash bench/gpu_check.sh        # after bench/gpu_prep.sh, carrying .whl and .gpu
#
# There: no network, no Ray, no PyCUDA, Python 3.12 with numpy/torch/pytest, nvcc. Steps:
#   env       nvidia-smi (GPU model, driver), nvcc, Python and package versions
#   wheels    .whl/*.whl -> $SITE (PyCUDA's runtime deps, msgpack)
#   pycuda    builds PyCUDA 2026.1 from the carried sdist (CUDA root from nvcc; no curand if absent)
#   tvmpipe   pip install -e . (offline), else a symlink package from pyproject's package-dir
#   pytest    pytest -m gpu, with resnet18/transformer from .gpu/bundles; fails if any test is skipped
#   executor  bench/executor_gpu.py: run vs kernel time, plain and CUDA-graph replay, vs torch eager
#   pipeline  bench/gpu_pipeline.py: 1-4 process-launched stages on the GPU, bit-exact, throughput, bubble
#   ipc       bench/ipc_gpu.py: one stage-to-stage hop of 4 and 64 MB, CUDA IPC vs the host path, GB/s
#   upload    bench/upload_gpu.py: a 2 GiB model's stages built at K = 1, 2, 4: device memory per stage
#             against its weights, staged upload GB/s against the page-locked copy limit
#   decode    bench/decode_gpu.py: .gpu/bundles/gpt2_decode (and gpt2_decode_b4, its static batches of
#             4, rows admitted one by one too, and gpt2_decode_c8, prompts 8 tokens a step) as K = 1, 2
#             cuda stages, caches on the device: the reference's tokens, tokens/s with 1, 2, 4
#             sequences in flight, time to first token chunked and not
#   generate  bench/generate.py --no-published on .gpu/bundles/decode_fixture: issue 24's sweep of
#             simulated stages (no GPU) on this host's cores, a core per stage process
#   decode_real  (only when GPU_CHECK_STEPS names it) bench/decode_real.py on .gpu/bundles/real: 135M and
#             1.1B Llama decode steps (fp16, T 512 and 2048, batch 1 and 8), weights written here:
#             tokens/s at K = 1, 2 with graph replay against the device-copy bandwidth floor and
#             transformers' generate on this GPU, the step's time by kernel category, T 2048 over 512
#             (issue 47). Its own call, after the setup steps (it needs ~300 s and a 9th file):
#             GPU_CHECK_STEPS=env,wheels,pycuda,tvmpipe,decode_real
# A failed step does not stop the later ones; each has a time budget and the whole run stays under
# GPU_CHECK_BUDGET_S (default 560 s, inside the tool's 600 s). Results: bench/results/gpu_check.json
# (summary), executor_gpu.json, gpu_pipeline.json, ipc_gpu.json, upload_gpu.json, decode_gpu.json,
# generate_gpu_host.json, and copies of them plus gpu_check.log in $OUT: 8 files, the device tool's limit (the PyCUDA build log
# and pytest's own files stay in $WORK; gpu_check.log holds pytest's output). Steps that found no time left can be run in a second call while the
# machine is warm (pycuda stays built in $SITE): GPU_CHECK_STEPS=tvmpipe,upload,decode.
# Exit status: 0 only if every step passed.
# shellcheck disable=SC2317  # the step functions are called through `step NAME BUDGET FUNCTION`
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$PWD
OUT=${OUT:-/tmp/gpu_check_out}
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/site}
SHIM=${GPU_CHECK_SHIM:-/tmp/tvmpipe-shim}
ONLY=${GPU_CHECK_STEPS:-}  # a comma-separated subset of the steps (tests/bench runs some on the CPU)
OPT_IN=",decode_real,"  # steps that run only when GPU_CHECK_STEPS names them
PIPELINE_ARGS=${GPU_CHECK_PIPELINE_ARGS:---stages 1,2,3,4 --graphs both --micro-batches 200}
IPC_ARGS=${GPU_CHECK_IPC_ARGS:---mb 4,64 --iters 50}
EXECUTOR_ARGS=${GPU_CHECK_EXECUTOR_ARGS:---repeat 200}
UPLOAD_ARGS=${GPU_CHECK_UPLOAD_ARGS:---gib 2 --stages 1,2,4}
DECODE_BUNDLE=${GPU_CHECK_DECODE_BUNDLE:-.gpu/bundles/gpt2_decode}
DECODE_BATCH_BUNDLE=${GPU_CHECK_DECODE_BATCH_BUNDLE:-.gpu/bundles/gpt2_decode_b4}
DECODE_CHUNK_BUNDLE=${GPU_CHECK_DECODE_CHUNK_BUNDLE:-.gpu/bundles/gpt2_decode_c8}
DECODE_ARGS=${GPU_CHECK_DECODE_ARGS:---stages 1,2 --in-flight 1,2,4 --new 24}
GENERATE_BUNDLE=${GPU_CHECK_GENERATE_BUNDLE:-.gpu/bundles/decode_fixture}
REAL=${GPU_CHECK_REAL:-.gpu/bundles/real}
DECODE_REAL_ARGS=${GPU_CHECK_DECODE_REAL_ARGS:-}
GENERATE_ARGS=${GPU_CHECK_GENERATE_ARGS:---stages 1,2,3,4}
WORK=${GPU_CHECK_WORK:-/tmp/gpu_check_work}
BUDGET=${GPU_CHECK_BUDGET_S:-560}
T0=$(date +%s)
DEADLINE=$((T0 + BUDGET))
mkdir -p "$OUT" "$WORK" bench/results
rm -f "$OUT/gpu_check.log"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
TEE_PID=$!

if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi
export PYTHONPATH="$SITE:$SHIM${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TVMPIPE_CACHE="$WORK/tvmpipe-cache"  # a fresh cubin cache: every kernel is compiled here, by this nvcc
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
BUNDLES=(examples/mlp examples/cnn)
for m in resnet18 transformer bert_mask gpt2 llama; do
  if [ -f ".gpu/bundles/$m/bundle.json" ]; then BUNDLES+=(".gpu/bundles/$m"); else echo "WARNING: .gpu/bundles/$m missing (run bench/gpu_prep.sh and carry .gpu)"; fi
done

cat >"$WORK/junit_counts.py" <<'EOF'
"""Counts of a pytest junit XML. Modules skipped while collecting (importorskip of tvm, torch, ray:
not on the GPU machine) and modules that failed to import are listed apart from the tests that ran."""
import json, sys, xml.etree.ElementTree as ET

def counts(path):
    n = {"tests": 0, "passed": 0, "failures": 0, "errors": 0, "skipped": 0, "collection_errors": [],
         "modules_skipped": []}
    for case in ET.parse(path).getroot().iter("testcase"):
        err, skip = case.find("error"), case.find("skipped")
        if err is not None and "collection failure" in (err.get("message") or ""):
            n["collection_errors"].append(case.get("name"))
            continue
        if not case.get("classname") and skip is not None and "collection skipped" in (skip.get("message") or ""):
            n["modules_skipped"].append(case.get("name"))
            continue
        n["tests"] += 1
        key = next((k for k, tag in (("failures", "failure"), ("errors", "error"), ("skipped", "skipped"))
                    if case.find(tag) is not None), "passed")
        n[key] += 1
    return n

if __name__ == "__main__":
    n = counts(sys.argv[1])
    print("pytest -m gpu:", json.dumps(n))
    if "--strict" in sys.argv:
        sys.exit(0 if n["tests"] > 0 and n["passed"] == n["tests"] and not n["collection_errors"] else 1)
EOF

STEPS=()
STEP_END=$DEADLINE
step() {  # step NAME BUDGET_S FUNCTION: FUNCTION in a subshell with errexit; record status and time
  local name=$1 budget=$2 fn=$3 start left rc
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then return 0; fi
  if [ -z "$ONLY" ] && [[ "$OPT_IN" == *",$name,"* ]]; then return 0; fi
  start=$(date +%s)
  left=$((DEADLINE - start))
  if [ "$left" -lt 15 ]; then
    echo "=== $name: not run, no time left"
    STEPS+=("$name 124 0")
    return 0
  fi
  STEP_END=$((start + (budget < left ? budget : left)))
  echo "=== $name (budget $((STEP_END - start)) s, $((start - T0)) s into the run)"
  set +e
  (set -euo pipefail; "$fn")
  rc=$?
  set -e
  STEPS+=("$name $rc $(($(date +%s) - start))")
  echo "=== $name: $([ "$rc" -eq 0 ] && echo ok || echo "FAILED (exit $rc)") in $(($(date +%s) - start)) s"
}
tmo() {  # a command under what is left of the step's budget
  local t=$((STEP_END - $(date +%s)))
  [ "$t" -ge 1 ] || t=1
  timeout -k 10 "$t" "$@"
}

# ---- steps --------------------------------------------------------------------------------------
s_env() {
  date -u
  uname -a
  tmo nvidia-smi || true
  command -v nvcc && nvcc --version || echo "nvcc not on PATH"
  "$PY" -c 'import sys; print(sys.executable, sys.version)'
  "$PY" -m pip list 2>/dev/null | grep -iE '^(numpy|msgpack|pytest|pytest-timeout|hypothesis|setuptools|wheel|torch|cupy-cuda13x|cuda-bindings|markupsafe|typing.extensions|matplotlib|pycuda) ' || true
  ls -l .whl .gpu/bundles || true
  [ -f .gpu/PREP.json ] && head -c 600 .gpu/PREP.json && echo
  tmo nvidia-smi -L | grep '^GPU 0'  # a GPU is what this run is for
}

s_wheels() {
  ls .whl/*.whl >/dev/null
  tmo "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  (cd / && "$PY" -c 'import pytools, mako, platformdirs, siphash24, msgpack; print("wheels ok; msgpack", msgpack.version)')
}

find_cuda() {  # sets CUDA_ROOT and CUDA_INC
  local nvcc c h
  CUDA_ROOT=${CUDA_ROOT:-}
  CUDA_INC=""
  nvcc=$(command -v nvcc || true)
  if [ -z "$CUDA_ROOT" ]; then
    for c in ${nvcc:+"$(dirname "$(dirname "$(readlink -f "$nvcc")")")" "$(dirname "$(dirname "$nvcc")")"} \
             /usr/local/cuda /usr/local/cuda-13.0 /usr/local/cuda-13 /opt/cuda; do
      if [ -f "$c/include/cuda.h" ]; then CUDA_ROOT=$c; break; fi
    done
  fi
  if [ -n "$CUDA_ROOT" ] && [ -f "$CUDA_ROOT/include/cuda.h" ]; then
    CUDA_INC=$CUDA_ROOT/include
  else  # e.g. a pip-installed toolkit: headers elsewhere
    h=$(find /usr/local /opt /usr/include -maxdepth 7 -name cuda.h -path '*include*' 2>/dev/null | head -1 || true)
    [ -n "$h" ] || { echo "no cuda.h found (nvcc: ${nvcc:-none})"; return 1; }
    CUDA_INC=$(dirname "$h")
    CUDA_ROOT=${CUDA_ROOT:-$(dirname "$CUDA_INC")}
  fi
  echo "CUDA_ROOT=$CUDA_ROOT CUDA_INC=$CUDA_INC nvcc=${nvcc:-none}"
}

find_libcuda() {  # prints a directory holding libcuda.so to link against (the stub or the driver's)
  local d so1
  for d in "$CUDA_ROOT/lib64/stubs" "$CUDA_ROOT/lib/stubs" "$CUDA_ROOT/targets/x86_64-linux/lib/stubs" \
           /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib; do
    if [ -e "$d/libcuda.so" ]; then echo "$d"; return 0; fi
  done
  so1=$( (ldconfig -p 2>/dev/null || true) | awk '/libcuda\.so\.1 .*x86-64/ { print $NF; exit }')
  [ -n "$so1" ] || so1=$(find /usr/local/nvidia /usr/lib /usr/lib64 /usr/local -maxdepth 5 -name 'libcuda.so.1' 2>/dev/null | head -1 || true)
  [ -n "$so1" ] || return 1
  mkdir -p "$WORK/cudadrv" && ln -sf "$so1" "$WORK/cudadrv/libcuda.so"  # the linker wants the unversioned name
  echo "$WORK/cudadrv"
}

s_pycuda() {
  local src=$WORK/pycuda-build libdir curand=() inc
  find_cuda
  libdir=${GPU_CHECK_CUDADRV_LIB_DIR:-}  # an override, e.g. a directory with a stub libcuda.so
  [ -n "$libdir" ] || libdir=$(find_libcuda) || { echo "libcuda.so / libcuda.so.1 not found"; return 1; }
  echo "linking against libcuda in $libdir"
  # tvmpipe never uses curand, and a curand build makes _driver.so need libcurand on the loader path
  curand=(--no-cuda-enable-curand)
  inc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
  if [ ! -f "$inc/Python.h" ]; then  # no python3.12-dev: the headers gpu_prep.sh carried
    [ -f .gpu/py312-include.tar.gz ] || { echo "no Python.h in $inc and no carried headers"; return 1; }
    mkdir -p "$WORK/pyinc" && tar xzf .gpu/py312-include.tar.gz -C "$WORK/pyinc"
    export CPATH="$WORK/pyinc/python3.12${CPATH:+:$CPATH}"
    echo "no Python.h in $inc: using the carried CPython 3.12 headers"
  fi
  rm -rf "$src" && mkdir -p "$src"
  tar xzf .whl/pycuda-2026.1.tar.gz -C "$src"
  cd "$src/pycuda-2026.1"
  "$PY" configure.py --cuda-root="$CUDA_ROOT" --cuda-inc-dir="$CUDA_INC" --cudadrv-lib-dir="$libdir" "${curand[@]}"
  grep -E '^(CUDA_ROOT|CUDA_INC_DIR|CUDA_ENABLE_CURAND|CUDADRV_LIB_DIR)' siteconf.py
  # setuptools compiles one extension's sources one at a time; _driver has ~40: compile them in
  # parallel (the same calls CCompiler.compile makes, in a thread pool), else fall back to serial.
  cat >"$src/pbuild.py" <<'EOF'
import os, sys
from concurrent.futures import ThreadPoolExecutor
import setuptools  # noqa: F401  (its distutils)
try:
    from setuptools._distutils import ccompiler
except ImportError:
    from distutils import ccompiler

def parallel_compile(self, sources, output_dir=None, macros=None, include_dirs=None, debug=False,
                     extra_preargs=None, extra_postargs=None, depends=None):
    macros, objects, extra_postargs, pp_opts, build = self._setup_compile(
        output_dir, macros, include_dirs, sources, depends, extra_postargs)
    cc_args = self._get_cc_args(pp_opts, debug, extra_preargs)
    def one(obj):
        if obj in build:
            src, ext = build[obj]
            self._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)
    with ThreadPoolExecutor(os.cpu_count() or 4) as pool:
        list(pool.map(one, objects))
    return objects

ccompiler.CCompiler.compile = parallel_compile
sys.argv = ["setup.py", *sys.argv[1:]]
sys.path.insert(0, os.getcwd())
code = compile(open("setup.py").read(), "setup.py", "exec")
exec(code, {"__name__": "__main__", "__file__": os.path.abspath("setup.py")})
EOF
  echo "building (log: $WORK/pycuda_build.log)"
  if ! tmo "$PY" "$src/pbuild.py" build >"$WORK/pycuda_build.log" 2>&1; then
    echo "parallel build failed (tail below); building serially"
    tail -n 20 "$WORK/pycuda_build.log"
    echo "---- serial build" >>"$WORK/pycuda_build.log"
    tmo "$PY" setup.py build >>"$WORK/pycuda_build.log" 2>&1 || { tail -n 40 "$WORK/pycuda_build.log"; return 1; }
  fi
  # pip reuses the up-to-date build/ (no recompile) and records the dist-info; else copy the package.
  if ! tmo "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade \
        --target "$SITE" . >>"$WORK/pycuda_build.log" 2>&1; then
    echo "pip install of the built tree failed; copying build/lib*/pycuda into $SITE"
    rm -rf "$SITE/pycuda" && cp -r build/lib*/pycuda "$SITE/"
  fi
  cd /
  tmo "$PY" - <<'EOF'
import pycuda, pycuda.driver as drv
drv.init()
dev = drv.Device(0)
print(f"pycuda {pycuda.VERSION_TEXT} at {pycuda.__file__}; CUDA {drv.get_version()}, driver {drv.get_driver_version()}; "
      f"{drv.Device.count()} device(s): {dev.name()} sm_{''.join(map(str, dev.compute_capability()))}")
EOF
}

pyproject_shim() {  # tvmpipe.X -> the repo's top-level folder, as pyproject's package-dir maps it
  rm -rf "$SHIM" && mkdir -p "$SHIM"
  "$PY" - "$REPO" "$SHIM" <<'EOF'
import os, sys, tomllib
repo, shim = sys.argv[1:]
dirs = tomllib.load(open(os.path.join(repo, "pyproject.toml"), "rb"))["tool"]["setuptools"]["package-dir"]
os.makedirs(os.path.join(shim, "tvmpipe"))
for f in os.listdir(os.path.join(repo, dirs["tvmpipe"])):
    os.symlink(os.path.join(repo, dirs["tvmpipe"], f), os.path.join(shim, "tvmpipe", f))
for pkg, d in dirs.items():
    if pkg != "tvmpipe":
        os.symlink(os.path.join(repo, d), os.path.join(shim, *pkg.split(".")))
print("shim:", sorted(dirs))
EOF
}

s_tvmpipe() {
  rm -rf "$SHIM"
  if [ "${GPU_CHECK_FORCE_SHIM:-0}" != 1 ] && tmo "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . ; then
    echo "tvmpipe: editable install"
  else
    echo "tvmpipe: pip install -e . failed; using a package shim at $SHIM"
    pyproject_shim
  fi
  (cd / && "$PY" -c 'import tvmpipe, tvmpipe.executor, tvmpipe.cluster.driver, tvmpipe.partition, tvmpipe.compiler.models as m; print("tvmpipe", tvmpipe.__version__, "from", tvmpipe.__file__)')
}

s_pytest() {
  local gb=""
  for b in "${BUNDLES[@]:2}"; do gb+="${gb:+:}$REPO/$b"; done
  export TVMPIPE_GPU_BUNDLES=$gb
  echo "TVMPIPE_GPU_BUNDLES=$gb"
  rm -f "$WORK/pytest_gpu.xml"
  # --continue-on-collection-errors: a test module that cannot be imported here (a package missing
  # from the image) is reported and fails the step, but does not stop the GPU tests from running.
  # From outside the repo: `python -m pytest` puts the working directory first on sys.path, and the
  # repo's own tvmpipe/ folder (the top package alone) would shadow the shim's complete package.
  # Only the modules that hold gpu-marked tests: the others are deselected anyway, and some import
  # packages the GPU image lacks (ray, yaml), which pytest reports as collection errors.
  local files
  mapfile -t files < <(grep -rlE 'pytest\.mark\.gpu|mark\.gpu' --include='test_*.py' "$REPO/tests" | sort)
  [ "${#files[@]}" -gt 0 ] || { echo "no gpu-marked test modules under $REPO/tests"; return 1; }
  echo "gpu test modules: ${files[*]#"$REPO/"}"
  cd "$WORK"
  tmo "$PY" -m pytest -m gpu -q -rA -p no:cacheprovider --continue-on-collection-errors \
    --rootdir "$REPO" -c "$REPO/pyproject.toml" "${files[@]}" \
    --junitxml="$WORK/pytest_gpu.xml" 2>&1 | tee "$WORK/pytest_gpu.log"
  # pytest passes when every test is skipped (no pycuda, no GPU): require that they all ran
  "$PY" "$WORK/junit_counts.py" "$WORK/pytest_gpu.xml" --strict
}

s_executor() {
  local rc=0
  rm -f bench/results/executor_gpu.json "$OUT/executor_gpu.json"
  # shellcheck disable=SC2086  # EXECUTOR_ARGS is a list of options
  tmo "$PY" bench/executor_gpu.py "${BUNDLES[@]}" $EXECUTOR_ARGS || rc=$?
  if [ -s bench/results/executor_gpu.json ]; then cp bench/results/executor_gpu.json "$OUT/"; else
    echo "bench/executor_gpu.py wrote no results (it exits 0 when it finds no GPU)"; [ "$rc" -ne 0 ] || rc=1; fi
  return "$rc"
}

s_pipeline() {
  local rc=0
  rm -f bench/results/gpu_pipeline.json "$OUT/gpu_pipeline.json"
  # shellcheck disable=SC2086  # PIPELINE_ARGS is a list of options
  tmo "$PY" bench/gpu_pipeline.py "${BUNDLES[@]}" --backend cuda $PIPELINE_ARGS \
    --require-gpu --out bench/results/gpu_pipeline.json || rc=$?
  [ -s bench/results/gpu_pipeline.json ] && cp bench/results/gpu_pipeline.json "$OUT/"
  return "$rc"
}

s_ipc() {  # CUDA IPC (cluster/wire/cudaipc.py) against D2H + socket + H2D between two processes on GPU 0
  local rc=0
  rm -f bench/results/ipc_gpu.json
  # shellcheck disable=SC2086  # IPC_ARGS is a list of options
  tmo "$PY" bench/ipc_gpu.py $IPC_ARGS --require-gpu --out bench/results/ipc_gpu.json || rc=$?
  [ -s bench/results/ipc_gpu.json ] && cp bench/results/ipc_gpu.json "$OUT/"
  return "$rc"
}

s_upload() {  # big-model weights: per-stage device memory, staged upload GB/s vs the pinned limit
  local rc=0
  rm -f bench/results/upload_gpu.json
  # shellcheck disable=SC2086  # UPLOAD_ARGS is a list of options
  tmo "$PY" bench/upload_gpu.py $UPLOAD_ARGS --work "$WORK" --require-gpu --out bench/results/upload_gpu.json || rc=$?
  [ -s bench/results/upload_gpu.json ] && cp bench/results/upload_gpu.json "$OUT/"
  return "$rc"
}

s_decode() {  # generation with the KV caches on the device, tokens against the reference backend
  local rc=0
  [ -f "$DECODE_BUNDLE/bundle.json" ] || { echo "no decode bundle at $DECODE_BUNDLE (run bench/gpu_prep.sh and carry .gpu)"; return 1; }
  rm -f bench/results/decode_gpu.json
  local extra=()
  if [ -f "$DECODE_BATCH_BUNDLE/bundle.json" ]; then extra=(--batch-bundle "$DECODE_BATCH_BUNDLE"); else echo "WARNING: no static-batch decode bundle at $DECODE_BATCH_BUNDLE"; fi
  if [ -f "$DECODE_CHUNK_BUNDLE/bundle.json" ]; then extra+=(--chunk-bundle "$DECODE_CHUNK_BUNDLE"); else echo "WARNING: no chunked decode bundle at $DECODE_CHUNK_BUNDLE"; fi
  # shellcheck disable=SC2086  # DECODE_ARGS is a list of options
  tmo "$PY" bench/decode_gpu.py "$DECODE_BUNDLE" $DECODE_ARGS ${extra[@]+"${extra[@]}"} --require-gpu --out bench/results/decode_gpu.json || rc=$?
  [ -s bench/results/decode_gpu.json ] && cp bench/results/decode_gpu.json "$OUT/"
  return "$rc"
}

s_generate() {  # issue 24's sweep (simulated 1 ms / 0.1 ms stages, no GPU) on this host's cores
  local rc=0
  [ -f "$GENERATE_BUNDLE/bundle/bundle.json" ] || { echo "no decode fixture at $GENERATE_BUNDLE (run bench/gpu_prep.sh and carry .gpu)"; return 1; }
  rm -f bench/results/generate_gpu_host.json
  # shellcheck disable=SC2086  # GENERATE_ARGS is a list of options
  tmo "$PY" bench/generate.py --bundle "$GENERATE_BUNDLE" --no-published $GENERATE_ARGS \
    --out bench/results/generate_gpu_host.json || rc=$?
  [ -s bench/results/generate_gpu_host.json ] && cp bench/results/generate_gpu_host.json "$OUT/"
  return "$rc"
}

s_decode_real() {  # issue 47: real-size Llama decode steps against the bandwidth floor and transformers
  local rc=0 left
  [ -f "$REAL/prep.json" ] || { echo "no real-size bundles at $REAL (run bench/gpu_prep.sh and carry .gpu)"; return 1; }
  rm -f bench/results/decode_real.json
  left=$((STEP_END - $(date +%s) - 20))  # the bench stops starting bundles then, and writes what ran
  # shellcheck disable=SC2086  # DECODE_REAL_ARGS is a list of options
  tmo "$PY" bench/decode_real.py "$REAL" --work "$WORK/real" --budget-s "$((left > 30 ? left : 30))" $DECODE_REAL_ARGS \
    --require-gpu --out bench/results/decode_real.json || rc=$?
  [ -s bench/results/decode_real.json ] && cp bench/results/decode_real.json "$OUT/"
  return "$rc"
}

step env 30 s_env
step wheels 60 s_wheels
step pycuda 240 s_pycuda
step tvmpipe 60 s_tvmpipe
step pytest 180 s_pytest
step executor 120 s_executor
step pipeline 240 s_pipeline
step ipc 60 s_ipc
step upload 90 s_upload
step decode 90 s_decode
step generate 150 s_generate
step decode_real 480 s_decode_real

# ---- summary ------------------------------------------------------------------------------------
FAILED=0
for s in "${STEPS[@]}"; do read -r _ rc _ <<<"$s"; [ "$rc" -eq 0 ] || FAILED=1; done
GPU_CHECK_WORK=$WORK "$PY" - "$OUT" "$(($(date +%s) - T0))" "${STEPS[@]}" <<'EOF' || FAILED=1
import json, os, platform, shutil, subprocess, sys, time, xml.etree.ElementTree as ET
out, wall, steps = sys.argv[1], int(sys.argv[2]), [s.split() for s in sys.argv[3:]]
def sh(*cmd):
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        return r.stdout.strip() if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None
def load(path):
    try:
        return json.load(open(path))
    except (OSError, ValueError):
        return None
smi = sh("nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap", "--format=csv,noheader")
nvcc = sh("nvcc", "--version")
summary = {
    "check": "gpu_check", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "wall_s": wall,
    "passed": all(rc == "0" for _, rc, _ in steps),
    "steps": [{"name": n, "exit": int(rc), "seconds": int(s)} for n, rc, s in steps],
    "gpu": smi.splitlines() if smi else None,
    "nvcc": nvcc.splitlines()[-1] if nvcc else None,
    "python": sys.version.split()[0], "platform": platform.platform(),
    "prep": {k: v for k, v in (load(".gpu/PREP.json") or {}).items() if k != "files"},
}
sys.path.insert(0, os.environ["GPU_CHECK_WORK"])
from junit_counts import counts
try:
    summary["pytest_gpu"] = counts(os.path.join(os.environ["GPU_CHECK_WORK"], "pytest_gpu.xml"))
except (OSError, ET.ParseError):
    summary["pytest_gpu"] = None
ex = load("bench/results/executor_gpu.json")
if ex:
    summary["executor"] = [{k: r.get(k) for k in ("model", "kernel_sum_us", "io_us", "graph_device_us", "plain_ratio", "graph_ratio", "graph_ratio_device",
                                                        "request_ratio", "graph_ratio_kernels_only", "vs_torch",
                                                        "graph_target_met")} for r in ex["models"]]  # the bench's verdict
pl = load("bench/results/gpu_pipeline.json")
if pl:
    summary["pipeline"] = {"all_exact": pl.get("all_exact"), "complete": pl.get("complete"), "runs": [
        {"model": m.get("model"), "graphs": run.get("graphs"), "stages": p.get("stages"),
         "exact": (p.get("check") or {}).get("exact"), "throughput": p.get("throughput"),
         "speedup_vs_1_stage": p.get("speedup_vs_1_stage"), "mean_idle_fraction": p.get("mean_idle_fraction"),
         "error": p.get("error")}
        for m in pl.get("models", []) for run in m.get("runs", []) for p in run.get("pipelines", [])]}
ip = load("bench/results/ipc_gpu.json")
if ip:
    summary["ipc"] = ip.get("rows")
up = load("bench/results/upload_gpu.json")
if up:
    summary["upload"] = {"ok": up.get("ok"), "weight_bytes": up.get("weight_bytes"), "limit": up.get("limit"),
                         "runs": [{"stages": r["stages"], "per_stage": [{k: x.get(k) for k in (
                             "weight_bytes", "device_over_weights", "upload_gbps", "upload_over_limit",
                             "host_rss_growth_bytes", "error") if k in x} for x in r["per_stage"]]} for r in up.get("runs", [])]}
de = load("bench/results/decode_gpu.json")
if de:
    summary["decode"] = {"all_exact": de.get("all_exact"), "model": de.get("model"), "rows": [
        {k: r.get(k) for k in ("stages", "batch", "chunk", "in_flight", "row_admission", "steps", "ttft_ms_p50",
                               "same_tokens_as_reference",
                               "same_tokens_as_batch_1", "tokens_per_s", "itl_ms_p50", "max_hop_bytes_per_step",
                               "cache_bytes_per_slot")
         if k in r} for r in de.get("rows", [])]}
dr = load("bench/results/decode_real.json")
if dr:
    summary["decode_real"] = {"complete": dr.get("complete"), "all_exact": dr.get("all_exact"),
                              "copy_gbps": (dr.get("copy") or {}).get("gbps"), "verdicts": dr.get("verdicts"),
                              "rows": [{"model": m, "bundle": n, **{k: r.get(k) for k in (
                                  "stages", "in_flight", "tokens_per_s", "step_ms", "floor_fraction")}}
                                       for m, d in (dr.get("models") or {}).items()
                                       for n, b in d.get("bundles", {}).items() for r in b.get("runs", [])],
                              "not_run": dr.get("not_run")}
ge = load("bench/results/generate_gpu_host.json")
if ge:
    summary["generate"] = {"cpus": ge["machine"]["cpus"], "target": ge["target"], "rows": [
        {k: r.get(k) for k in ("stage_ms", "stages", "in_flight", "tokens_per_s", "fraction_of_ideal",
                               "fraction_of_measured_slowest")} for r in ge["rows"]]}
text = json.dumps(summary, indent=1) + "\n"
open("bench/results/gpu_check.json", "w").write(text)
open(os.path.join(out, "gpu_check.json"), "w").write(text)
print(json.dumps({k: summary[k] for k in ("passed", "steps", "gpu", "pytest_gpu")}, indent=1))
for r in summary.get("executor", []):
    print("executor:", r)
EOF
echo "gpu_check: $([ "$FAILED" -eq 0 ] && echo PASSED || echo FAILED) in $(($(date +%s) - T0)) s; files in $OUT:"
ls -l "$OUT"
exec >&- 2>&-
for _ in $(seq 50); do kill -0 "$TEE_PID" 2>/dev/null || break; sleep 0.1; done
exit "$FAILED"
