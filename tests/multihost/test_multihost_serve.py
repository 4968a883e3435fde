"""`tvmpipe serve` as a Ray job on the 4-host bed: `ray job submit -- tvmpipe serve BUNDLE --address
auto ...` against the head's job API runs the server on the head node, its two stages spread over
two worker hosts (STRICT_SPREAD; the bundle exists only on the head and is shipped), listening on the
head's bridge address behind an API key. Clients on another host talk to it over the bed's network
with the official `openai` client: plain and streamed completions equal the single-process greedy
loop, a missing key is 401; `ray job stop` (SIGTERM) drains it and the job ends stopped."""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
import uuid
from pathlib import Path

import pytest

from raybed import DASHBOARD_PORT, RAY, RayBed
from tvmpipe.executor.decode_loop import greedy_decode

pytest.importorskip("tvm")

PORT = 8000
KEY = "bed-key-9f3a"
PROMPTS = [[5, 17, 3], [60], [9, 9, 4, 1]]
N = 8

CLIENT = r"""
import json, sys, httpx, openai
url, key, prompts, n = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
out = {"models": [m.id for m in c.models.list().data], "plain": [], "streamed": []}
for p in prompts:
    r = c.completions.create(model="bed-gpt2", prompt=p, max_tokens=n, temperature=0,
                             extra_body={"return_token_ids": True})
    out["plain"].append(r.choices[0].token_ids)
    ids = []
    for chunk in c.completions.create(model="bed-gpt2", prompt=p, max_tokens=n, temperature=0, stream=True,
                                      stream_options={"include_usage": True}):
        for ch in chunk.choices:
            ids += ch.token_ids or []
        if chunk.usage:
            out["usage"] = chunk.usage.completion_tokens
    out["streamed"].append(ids)
out["no_key"] = httpx.get(url + "/v1/models", timeout=30).status_code
out["health"] = httpx.get(url + "/health", timeout=30).json()
text = httpx.get(url + "/metrics", headers={"Authorization": "Bearer " + key}, timeout=30).text
out["stage_hosts"] = [l.split('host="')[1].split('"')[0] for l in text.splitlines() if l.startswith("tvmpipe_stage_info")]
print(json.dumps(out))
"""


def test_serve_as_a_job_across_hosts(bed: RayBed, zoo_decoder, tmp_path: Path):
    bundle_dir, _ = zoo_decoder("gpt2")
    bundle = bed.head_only / "gpt2_step"
    if not bundle.exists():
        shutil.copytree(bundle_dir, bundle)
    url = f"http://{bed.head.address}:{PORT}"
    jobs = ["--address", f"http://{bed.head.address}:{DASHBOARD_PORT}"]
    tvmpipe = str(Path(sys.executable).with_name("tvmpipe"))
    job = f"serve-{uuid.uuid4().hex[:8]}"
    submitted = bed.head.run(RAY, "job", "submit", *jobs, "--no-wait", "--submission-id", job, "--", tvmpipe, "serve",
                             str(bundle), "--address", "auto", "--stages", "2", "--placement", "STRICT_SPREAD",
                             "--gpus-per-stage", "1", "--backend", "reference", "--host", bed.head.address, "--port",
                             str(PORT), "--served-model-name", "bed-gpt2", "--api-key", KEY, env=bed.env, timeout=120)
    assert submitted.returncode == 0, (submitted.stdout + submitted.stderr)[-3000:]

    def logs() -> str:
        return bed.head.run(RAY, "job", "logs", *jobs, job, env=bed.env, timeout=60).stdout

    try:
        deadline = time.time() + 240
        while not re.search(rf"tvmpipe serve: bed-gpt2 on {re.escape(url)}/v1 \(2 stage", logs()):
            assert time.time() < deadline, logs()[-3000:]
            time.sleep(2)
        client = bed.python("-c", CLIENT, url, KEY, json.dumps(PROMPTS), str(N), host=bed.workers[2], timeout=300)
        assert client.returncode == 0, (client.stdout + client.stderr)[-3000:]
        out = json.loads(client.stdout.strip().splitlines()[-1])
        want = [greedy_decode(bundle_dir, p, N).tokens[0] for p in PROMPTS]
        assert out["models"] == ["bed-gpt2"]
        assert out["plain"] == want and out["streamed"] == want and out["usage"] == N
        assert out["no_key"] == 401 and out["health"] == {"status": "ok"}
        hosts = out["stage_hosts"]  # each stage's data listener: on its own worker host
        assert len(hosts) == 2 and len(set(hosts)) == 2 and bed.head.address not in hosts, hosts
    finally:
        bed.head.run(RAY, "job", "stop", *jobs, job, env=bed.env, timeout=120)
    status = bed.head.run(RAY, "job", "status", *jobs, job, env=bed.env, timeout=60).stdout
    assert re.search(r"\bstopped\b", status, re.IGNORECASE), status[-2000:]  # 'was stopped' / 'STOPPED'
    assert not re.search(r"\b(failed|succeeded)\b", status, re.IGNORECASE), status[-2000:]
    assert "SIGTERM: draining" in logs(), logs()[-3000:]
