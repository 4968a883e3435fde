"""bench/gpu_check.sh on the CPU, over the strict fake PyCUDA (tests/fakecuda): the tvmpipe step on
its fallback package shim, `pytest -m gpu` (every GPU test must run and pass, from outside the repo
so the repo's tvmpipe/ folder cannot shadow the shim: issue 12, defect 6), the executor bench and the
pipeline bench on the cuda backend with and without graph replay; then the IPC, upload, decode and
generate steps; then the decode_real step (issue 47) on a tiny Llama laid out as bench/real_bundles.py
lays out the real ones. A copy of the tree, so no result file is touched."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
from tests.support.fake_cuda import fake_env


def image_python(where: Path) -> Path:
    """A Python like the GPU image's: this environment's packages, but tvmpipe not installed (the
    editable install's finder comes from a .pth that a plain path entry does not run)."""
    import site
    import venv

    venv.EnvBuilder(with_pip=False, symlinks=True).create(where)
    py = where / "bin" / "python"
    inner_site = subprocess.run([str(py), "-c", "import site; print(site.getsitepackages()[0])"],
                                capture_output=True, text=True, check=True).stdout.strip()
    Path(inner_site, "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    assert subprocess.run([str(py), "-c", "import tvmpipe.executor"], cwd=where, capture_output=True).returncode != 0
    return py


def test_gpu_check_steps_on_fake_cuda(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(ROOT, tree, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", ".pytest_cache", ".gpu", ".whl", "*.egg-info"))
    inner = tmp_path / "inner"
    python = image_python(tmp_path / "image")
    env = {**os.environ, **fake_env(tmp_path / "cache", [tree / "examples" / "mlp", tree / "examples" / "cnn", inner])}
    env.update(PYTHON=str(python), OUT=str(tmp_path / "out"), GPU_CHECK_WORK=str(tmp_path / "work"),
               GPU_CHECK_SITE=str(tmp_path / "site"), GPU_CHECK_SHIM=str(tmp_path / "shim"),
               GPU_CHECK_STEPS="tvmpipe,pytest,executor,pipeline", GPU_CHECK_FORCE_SHIM="1",
               GPU_CHECK_EXECUTOR_ARGS="--repeat 5",
               PYTEST_ADDOPTS=f"--basetemp={inner}",
               GPU_CHECK_PIPELINE_ARGS="--stages 1,2 --graphs both --micro-batches 4 --distinct 2 "
                                       "--runner-repeat 3 --plan equal")
    r = subprocess.run(["bash", str(tree / "bench" / "gpu_check.sh")], cwd=tree, env=env, capture_output=True,
                       text=True, timeout=500)
    summary = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert r.returncode == 0 and summary["passed"], r.stdout[-4000:]
    back = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert len(back) <= 8, f"the device tool returns at most 8 files from $OUT: {back}"  # run 2 lost two
    assert [s["name"] for s in summary["steps"]] == ["tvmpipe", "pytest", "executor", "pipeline"]
    rows = {r["model"]: r for r in summary["executor"]}  # bench/executor_gpu.py ran over the fake
    assert set(rows) == {"mlp", "cnn"} and all(r["kernel_sum_us"] > 0 and r["io_us"] > 0 and r["graph_device_us"] > 0
                                                and isinstance(r["graph_target_met"], bool) for r in rows.values()), rows
    assert "using a package shim" in r.stdout
    n = summary["pytest_gpu"]
    assert n["tests"] >= 4 and n["passed"] == n["tests"], n
    runs = summary["pipeline"]["runs"]
    assert {(x["model"], x["graphs"], x["stages"]) for x in runs} == \
        {(m, g, k) for m in ("mlp", "cnn") for g in (False, True) for k in (1, 2)}
    assert all(x["exact"] for x in runs)


def test_gpu_check_ipc_upload_and_decode_steps_on_fake_cuda(tmp_path, decode_bundle, zoo_decoder):
    """The IPC hop, big-model upload, decode and generate steps of the kit, end to end on the fake:
    both hop paths move the bytes, a stage's device memory is its weights, a 2-stage cuda decode
    pipeline of GPT-2's step (caches on the device, CUDA IPC between the stages) gives the
    reference backend's tokens, static batches too (its step at batch 2, as gpu_prep.sh carries it
    at batch 4; rows admitted one by one), and chunked prefill (--chunk 4; gpu_prep.sh: 8) beside a
    token a step, and the generation sweep runs from the carried fixture alone."""
    gpt2, _ = zoo_decoder("gpt2", kv="static")  # as gpu_prep.sh compiles them: --kv static
    batched, _ = zoo_decoder("gpt2", 2, kv="static")
    chunked, _ = zoo_decoder("gpt2", 1, 4, kv="static")
    tree = tmp_path / "tree"
    shutil.copytree(ROOT, tree, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", ".pytest_cache", ".gpu", ".whl", "*.egg-info"))
    python = image_python(tmp_path / "image")
    env = {**os.environ, **fake_env(tmp_path / "cache", [decode_bundle, gpt2, batched, chunked])}
    env.update(PYTHON=str(python), OUT=str(tmp_path / "out"), GPU_CHECK_WORK=str(tmp_path / "work"),
               GPU_CHECK_SITE=str(tmp_path / "site"), GPU_CHECK_SHIM=str(tmp_path / "shim"),
               GPU_CHECK_STEPS="tvmpipe,ipc,upload,decode,generate", GPU_CHECK_FORCE_SHIM="1",
               GPU_CHECK_IPC_ARGS="--mb 1 --iters 4",
               GPU_CHECK_UPLOAD_ARGS="--gib 0.02 --width 256 --stages 1,2",
               GPU_CHECK_DECODE_BUNDLE=str(gpt2), GPU_CHECK_DECODE_BATCH_BUNDLE=str(batched),
               GPU_CHECK_DECODE_CHUNK_BUNDLE=str(chunked),
               GPU_CHECK_DECODE_ARGS="--stages 1,2 --in-flight 1,2 --new 4",
               GPU_CHECK_GENERATE_BUNDLE=str(decode_bundle.parent), GPU_CHECK_GENERATE_ARGS="--quick --stages 1,2")
    r = subprocess.run(["bash", str(tree / "bench" / "gpu_check.sh")], cwd=tree, env=env, capture_output=True,
                       text=True, timeout=500)
    summary = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert r.returncode == 0 and summary["passed"], r.stdout[-4000:]
    back = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert len(back) <= 8, f"the device tool returns at most 8 files from $OUT: {back}"  # run 2 lost two
    assert [s["name"] for s in summary["steps"]] == ["tvmpipe", "ipc", "upload", "decode", "generate"]
    ge = summary["generate"]  # issue 24's simulated-stage sweep, without TVM or transformers
    assert ge["target"]["no_cache_bytes"] and {(r["stages"], r["in_flight"]) for r in ge["rows"]} >= {(1, 1), (2, 2), (2, 4)}
    assert all(r["tokens_per_s"] > 0 for r in ge["rows"])
    (ipc,) = summary["ipc"]
    assert ipc["mb"] == 1 and ipc["host_gbps"] > 0 and ipc["cuda-ipc_gbps"] > 0
    up = summary["upload"]
    assert up["ok"] and [x["stages"] for x in up["runs"]] == [1, 2]
    for run in up["runs"]:
        for st in run["per_stage"]:  # the fake allocates exactly what the stage asks for
            assert 1.0 <= st["device_over_weights"] < 1.1 and st["upload_gbps"] > 0, st
    assert sum(st["weight_bytes"] for st in up["runs"][1]["per_stage"]) == up["runs"][0]["per_stage"][0]["weight_bytes"]
    de = summary["decode"]
    assert de["all_exact"] and {(x["stages"], x["batch"], x["in_flight"]) for x in de["rows"]} == \
        {(1, 1, 1), (1, 1, 2), (2, 1, 1), (2, 1, 2), (1, 2, 4), (2, 2, 4), (2, 2, 2), (1, 1, 4), (2, 1, 4)}
    # chunked prefill beside a token a step, on each K: fewer micro-batches for the same tokens
    chunks = {(x["stages"], x["chunk"]): x for x in de["rows"] if "chunk" in x}
    assert set(chunks) == {(1, 1), (1, 4), (2, 1), (2, 4)}
    assert all(chunks[k, 4]["steps"] < chunks[k, 1]["steps"] for k in (1, 2))
    assert all(x["same_tokens_as_reference"] for x in de["rows"])
    assert all(x["max_hop_bytes_per_step"] < x["cache_bytes_per_slot"] for x in de["rows"])
    full = json.loads((tmp_path / "out" / "decode_gpu.json").read_text())
    # the caches on the device: one buffer a pair and slot (written in place), for the slots used so far
    assert all(x["state_buffers"] == [1] and sum(x["state_bytes_per_stage"]) == x["in_flight"] * x["cache_bytes_per_slot"]
               for x in full["rows"] if x["batch"] == 1 and "chunk" not in x)
    # static batches: two groups of two, one slot each; then one slot, rows taken as they free
    assert all(sum(x["state_bytes_per_stage"]) == 2 * x["cache_bytes_per_slot"] for x in full["rows"]
               if x["batch"] == 2 and "row_admission" not in x)
    (rows_in,) = [x for x in full["rows"] if "row_admission" in x]
    assert rows_in["row_admission"] and sum(rows_in["state_bytes_per_stage"]) == rows_in["cache_bytes_per_slot"]
    assert len(set(rows_in["prompt_tokens"])) > 1 and rows_in["sequences"] > rows_in["batch"]
    assert [x for x in full["rows"] if x["batch"] == 1 and "chunk" not in x][-1]["edge_paths"]["0->1"] == "cuda-ipc"


def test_gpu_check_decode_real_step_on_fake_cuda(tmp_path):
    """The decode_real step (issue 47), end to end on the fake: bench/real_bundles.py's layout for a
    tiny Llama (T 16 and 32 at batch 1, T 16 at batch 2; compiled here, in this process, without
    weights, the compiled constants beside each bundle), the weights written by the step, K = 1, 2
    pipelines with graph replay and the caches on the device, the profile split into matmuls,
    attention, cache updates and the rest, the reference backend's tokens, transformers' generate
    (on the CPU here), and the performance page's row from the step's JSON, refused as the fake's."""
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import perfpage
        import real_bundles

        real = tmp_path / "real"
        prep = real_bundles.prepare(real, ["tiny"], [(16, 1), (32, 1), (16, 2)], tmp_path / "ckpt", children=False)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    layers = real_bundles.TINY["num_hidden_layers"]
    assert prep["models"]["tiny"]["reference"]["logits_std"] > 0  # materialized and stepped on the reference
    assert (real / "tiny" / "config.json").is_file() and (real / "tiny" / "T16_b2.constants.npz").is_file()
    tree = tmp_path / "tree"
    shutil.copytree(ROOT, tree, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", ".pytest_cache", ".gpu", ".whl", "*.egg-info"))
    python = image_python(tmp_path / "image")
    env = {**os.environ, **fake_env(tmp_path / "cache", [real])}
    env.update(PYTHON=str(python), OUT=str(tmp_path / "out"), GPU_CHECK_WORK=str(tmp_path / "work"),
               GPU_CHECK_SITE=str(tmp_path / "site"), GPU_CHECK_SHIM=str(tmp_path / "shim"),
               GPU_CHECK_STEPS="tvmpipe,decode_real", GPU_CHECK_FORCE_SHIM="1", GPU_CHECK_REAL=str(real),
               GPU_CHECK_DECODE_REAL_ARGS="--sequences 2 --copy-mib 4 --profile-repeat 2 --reference-sequences 2")
    r = subprocess.run(["bash", str(tree / "bench" / "gpu_check.sh")], cwd=tree, env=env, capture_output=True,
                       text=True, timeout=500)
    summary = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert r.returncode == 0 and summary["passed"], r.stdout[-4000:]
    assert [s["name"] for s in summary["steps"]] == ["tvmpipe", "decode_real"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["decode_real.json", "gpu_check.json", "gpu_check.log"]
    doc = json.loads((tmp_path / "out" / "decode_real.json").read_text())
    assert doc["fake"] and doc["complete"] and doc["all_exact"] and doc["copy"]["gbps"] > 0
    m = doc["models"]["tiny"]
    bundles = m["bundles"]
    assert {n: [(x["stages"], x["in_flight"]) for x in b["runs"]] for n, b in bundles.items()} == \
        {"T16_b1": [(1, 1), (2, 1), (2, 2)], "T32_b1": [(1, 1)], "T16_b2": [(1, 1), (2, 1), (2, 2)]}
    for b in bundles.values():
        assert b["weight_bytes"] > 0 and 0 < b["floor_step_ms"] < b["static_floor_step_ms"]
        for x in b["runs"]:  # the caches on the device: whole slots (one buffer a pair), split over the stages
            held = sum(x["state_bytes_per_stage"])
            assert len(x["state_bytes_per_stage"]) == x["stages"] and held % b["cache_bytes"] == 0
            assert b["cache_bytes"] <= held <= x["stages"] * b["cache_bytes"]
            assert x["tokens"] == x["sequences"] * doc["new_tokens"] and x["floor_fraction"] > 0
            assert ("cuda-ipc" in x["edge_paths"]) == (x["stages"] > 1)
        p = b["profile"]
        assert p["nodes"] == {"matmul": 7 * layers + 1, "attention": 6 * layers, "cache_update": 2 * layers,
                              "rest": p["nodes"]["rest"]}, p["nodes"]
        assert p["launches_per_step"] > 0 and all(p["us"][c] > 0 for c in p["us"]) and p["over_floor"]
    assert bundles["T16_b1"]["same_tokens_k2_as_k1"] and bundles["T16_b2"]["same_tokens_k2_as_k1"]
    assert bundles["T16_b2"]["tokens_vs_batch_1"]["differ"] == 0  # the fake computes as the reference does
    assert bundles["T32_b1"]["tokens_vs_smallest_context"]["differ"] == 0
    ref = m["reference"]  # two sequences, every token compared, and not one token repeated
    assert ref["differ"] == 0 and [len(x["reference"]) for x in ref["sequences"]] == [doc["new_tokens"]] * 2
    assert len({t for x in ref["sequences"] for t in x["reference"]}) > 1
    assert [(x["batch"], x["contexts"]) for x in m["context_cost"]] == [(1, [16, 32])]
    hf = doc["transformers"]["models"]["tiny"]
    assert {(x["attn_implementation"], x["batch"]) for x in hf} == {(a, b) for a in ("sdpa", "eager") for b in (1, 2)}
    assert all(x["how"] == "generate" and x["tokens"] == x["sequences"] * doc["new_tokens"] for x in hf)
    assert {(x["batch"], x["attn_implementation"]) for x in m["vs_transformers"]} == {(b, a) for a in ("sdpa", "eager")
                                                                                       for b in (1, 2)}
    v = doc["verdicts"]
    assert v["floor"]["model"] == "tiny" and all(isinstance(v[k]["met"], bool) for k in v)
    assert {(x["bundle"], x["stages"]) for x in summary["decode_real"]["rows"]} >= {("T16_b1", 1), ("T16_b1", 2)}
    # the performance page reads the step's JSON (one row), and refuses it as the fake's
    (row,) = perfpage.decode_real(doc)
    assert row.metric.startswith("TINY Llama decode") and "tokens/s" in row.value and isinstance(row.met, bool)
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(tmp_path / "out" / "decode_real.json", results / "decode_real.fake.json")
    with pytest.raises(perfpage.PerfPageError, match="made over the fake PyCUDA"):
        perfpage.collect(results)
