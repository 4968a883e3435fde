"""A batch generation job the way users of Ray clusters run one: `ray job submit -- tvmpipe generate
BUNDLE --address auto --prompts-file in.jsonl --output out.jsonl` against the head's job API, on the
4-host bed. The job's driver runs on the head node; its two stages go one to a worker host each
(STRICT_SPREAD, one fake GPU a stage: the head has none), and the bundle, which only the head can
see, reaches them by shipping. The output file is written on the head, whole: one line per prompt,
each the single-process greedy loop's tokens."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from raybed import DASHBOARD_PORT, RAY, RayBed
from tvmpipe.executor.decode_loop import greedy_decode

N = 8
PROMPTS = {"a": [5, 17, 3], "b": [60], "c": [9, 9, 4, 1], "d": [33, 0, 12], "e": [1, 2, 3, 4, 5], "f": [42]}


def test_generate_job_through_ray_job_submit(bed: RayBed, decode_bundle):
    bundle = bed.head_only / "decode_step"
    if not bundle.exists():
        shutil.copytree(decode_bundle, bundle)
    src, out = bed.head_only / "gen-in.jsonl", bed.head_only / "gen-out.jsonl"
    src.write_text("".join(json.dumps({"id": k, "prompt_ids": p}) + "\n" for k, p in PROMPTS.items()))
    out.unlink(missing_ok=True)
    tvmpipe = str(Path(sys.executable).with_name("tvmpipe"))
    done = bed.head.run(RAY, "job", "submit", "--address", f"http://{bed.head.address}:{DASHBOARD_PORT}", "--",
                        tvmpipe, "generate", str(bundle), "--address", "auto", "--stages", "2", "--placement",
                        "STRICT_SPREAD", "--gpus-per-stage", "1", "--backend", "reference", "--prompts-file", str(src),
                        "--output", str(out), "--max-new-tokens", str(N), env=bed.env, timeout=300)
    log = done.stdout + done.stderr
    assert done.returncode == 0 and "succeeded" in log, log[-5000:]
    assert f"{len(PROMPTS)} sequence(s) written to {out}, 0 already there" in log, log[-3000:]
    data = out.read_text()
    assert data.endswith("\n")
    lines = [json.loads(x) for x in data.splitlines()]
    assert sorted(x["id"] for x in lines) == sorted(PROMPTS)
    for x in lines:
        assert x["prompt"] == PROMPTS[x["id"]]
        assert x["tokens"] == greedy_decode(decode_bundle, x["prompt"], N).tokens[0] and x["finish"] == "length"
