"""A served pipeline through faults and shutdown, each on a server of its own: a stage SIGKILLed
while streams are open (restarted and replayed: every stream's tokens unchanged, the restart in
/metrics), SIGTERM (new requests refused, running ones finish, what outlives --drain-timeout is
cancelled, the process exits with its stages), and the command's one-line errors."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time

import httpx
import pytest

from tests.serve.harness import MODEL, ServerProcess, metric, slowed, stage_pids
from tvmpipe.cli import main
from tvmpipe.executor.sampler import Sampling

pytest.importorskip("tvm")
pytestmark = [pytest.mark.tvm, pytest.mark.slow]


async def read_stream(client: httpx.AsyncClient, body: dict, got: list, started: asyncio.Event | None = None,
                      after: int = 1) -> list:
    """Stream one request, appending each event to `got`; `started` is set after `after` tokens."""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            got.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
            tokens = sum(len(c.get("token_ids", [])) for e in got if isinstance(e, dict) for c in e.get("choices", []))
            if started is not None and tokens >= after:
                started.set()
    return got


def tokens_of(events: list) -> list[int]:
    return [t for e in events if isinstance(e, dict) for c in e.get("choices", []) for t in c.get("token_ids", [])]


def test_a_stage_killed_mid_stream_leaves_every_stream_unchanged(serve_bundle, plain_tokenizer, offline, tmp_path):
    """4 streams (greedy and seeded) are open when stage 1's process is SIGKILLed: the pipeline
    restarts it and replays, and every stream's tokens equal the offline run's, none lost or
    repeated; /metrics shows the restart and the new process. A tokenizer without a chat
    template answers chat with a 400 saying so. Ctrl-C (SIGINT to the process group) stops it
    cleanly: the stage processes ignore it and the server drains. The HTTP process runs 10 below
    the stages in CPU priority (--http-nice), the restarted stage as the others."""
    srv = ServerProcess(serve_bundle, "--stages", "2", "--processes", "--tokenizer", str(plain_tokenizer),
                        log_path=tmp_path / "stderr.txt")
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"model": MODEL, "messages": [
            {"role": "user", "content": "Hi"}]}, timeout=30)
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "no_chat_template"
        prompts = [[5, 17, 3], [60], [9, 9, 9, 9], [33, 0]]
        samplings = [Sampling(), Sampling(0.8, 30, 7, 0.9), Sampling(), Sampling(1.0, 0, 99, 1.0)]
        n = 40
        bodies = [{"model": MODEL, "prompt": p, "max_tokens": n, "stream": True, "return_token_ids": True,
                   "ignore_eos": True, "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
                   "seed": s.seed} for p, s in zip(prompts, samplings)]
        before = srv.metrics()
        pids = stage_pids(before)
        assert sorted(pids) == [0, 1] and metric(before, "tvmpipe_stage_restarts_total", stage=1) == 0
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, srv.proc.pid) == min(19, mine + 10)
        assert [os.getpriority(os.PRIO_PROCESS, p) for p in pids.values()] == [mine, mine]

        async def run():
            got = [[] for _ in bodies]
            started = [asyncio.Event() for _ in bodies]
            async with httpx.AsyncClient(base_url=srv.url, timeout=300) as c:
                tasks = [asyncio.ensure_future(read_stream(c, b, g, e, after=3))
                         for b, g, e in zip(bodies, got, started)]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
                os.kill(pids[1], signal.SIGKILL)
                killed_at = [len(tokens_of(g)) for g in got]
                await asyncio.gather(*tasks)
            return got, killed_at

        got, killed_at = asyncio.run(run())
        assert all(k < n for k in killed_at), killed_at  # every stream was open when the stage died
        want = offline([(p, n, s, ()) for p, s in zip(prompts, samplings)])
        for events, w in zip(got, want):
            assert events[-1] == "[DONE]"
            assert tokens_of(events) == w
            assert [c["finish_reason"] for e in events[:-1] for c in e["choices"]][-1] == "length"
        after = srv.metrics()
        assert metric(after, "tvmpipe_stage_restarts_total", stage=1) == 1
        assert metric(after, "tvmpipe_stage_restarts_total", stage=0) == 0
        assert stage_pids(after)[1] != pids[1] and stage_pids(after)[0] == pids[0]
        assert os.getpriority(os.PRIO_PROCESS, stage_pids(after)[1]) == mine  # restarted by the engine process
        assert metric(after, "tvmpipe_requests_finished_total") == 4
        assert metric(after, "tvmpipe_requests_cancelled_total") == 0
    finally:  # Ctrl-C in a terminal: SIGINT to the server and its stage processes; it drains, they wait
        assert srv.stop(signal.SIGINT, group=True) == 0, srv.log()[-3000:]
        # no stage takes it as a KeyboardInterrupt, stage 1's replacement (started by the pipeline's
        # supervisor) included: the process launcher's workers ignore SIGINT
        assert "SIGINT: draining" in srv.log() and "KeyboardInterrupt" not in srv.log(), srv.log()[-3000:]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_sigterm_drains_then_exits(serve_bundle, tmp_path):
    """A server without a tokenizer (token ids in, token ids out) holding 2 short streams and 30
    long ones (1650 tokens, on stages slowed to 10 ms a step: seconds of work on any machine) gets
    SIGTERM: new connections are refused, a request on an open connection is 503 and /health says
    draining; the short streams finish whole; the long ones still running after --drain-timeout
    (1 s) end with an error event and [DONE]; the process exits 0 within the bound and its stage
    processes are gone."""
    drain = 1.0
    longs = 30
    # the connection opened before the signal must still be open after it, however long the streams
    # take to start: neither the server (--keep-alive-timeout, default 5 s) nor httpx's pool
    # (keepalive_expiry, default 5 s) may close it while it idles
    srv = ServerProcess(serve_bundle, "--stages", "2", "--processes", "--drain-timeout", str(drain),
                        "--keep-alive-timeout", "600", log_path=tmp_path / "stderr.txt", env=slowed(0.01))
    pids = stage_pids(srv.metrics())
    short = {"model": MODEL, "prompt": [5, 6], "max_tokens": 4, "stream": True, "temperature": 0, "ignore_eos": True}
    long = {**short, "max_tokens": 55, "prompt": [7, 8]}
    keep = httpx.Client(base_url=srv.url, timeout=30, limits=httpx.Limits(keepalive_expiry=600))  # open before the signal
    assert keep.get("/health").json() == {"status": "ok"}
    t_signal = [0.0]

    async def run():
        got = [[] for _ in range(2 + longs)]
        started = [asyncio.Event() for _ in range(2)]
        async with httpx.AsyncClient(base_url=srv.url, timeout=120,
                                     limits=httpx.Limits(max_connections=2 + longs)) as c:
            tasks = [asyncio.ensure_future(read_stream(c, short, got[i], started[i])) for i in range(2)]
            tasks += [asyncio.ensure_future(read_stream(c, long, got[i])) for i in range(2, 2 + longs)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
            t_signal[0] = time.time()
            srv.proc.send_signal(signal.SIGTERM)
            await asyncio.gather(*tasks)
        return got

    async def refused():
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                httpx.get(srv.url + "/health", timeout=2)
            except httpx.ConnectError:
                return True
            await asyncio.sleep(0.05)
        return False

    async def both():
        streams = asyncio.ensure_future(run())
        while not t_signal[0]:
            await asyncio.sleep(0.01)
        no_new = await refused()
        health = await asyncio.to_thread(keep.get, "/health")
        late = await asyncio.to_thread(keep.post, "/v1/completions", json=short)
        return await streams, no_new, health, late

    got, no_new, health, late = asyncio.run(both())
    assert no_new, "new connections were still accepted after SIGTERM"
    assert health.status_code == 503 and health.json() == {"status": "draining"}
    assert late.status_code == 503 and late.json()["error"]["code"] == "unavailable"
    for events in got[:2]:
        assert events[-1] == "[DONE]" and len(tokens_of(events)) == 4
        assert events[-2]["choices"][0]["finish_reason"] == "length"
    cut = [e for e in got[2:] if any(isinstance(x, dict) and "error" in x for x in e)]
    assert cut, "every long stream finished within the drain timeout: the bound was not exercised"
    for events in cut:
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "shutdown"
        assert len(tokens_of(events)) < 55
    status = srv.proc.wait(60)
    took = time.time() - t_signal[0]
    keep.close()
    assert status == 0, srv.log()[-3000:]
    assert took < drain + 15, took
    assert "SIGTERM: draining" in srv.log() and "drain timeout" in srv.log()
    deadline = time.time() + 10
    while any(alive(p) for p in pids.values()) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids.values())
    srv.kill()


@pytest.mark.parametrize("where", ["--processes", "--local"])
def test_sigterm_to_the_process_group_drains_and_exits_0(serve_bundle, tmp_path, where):
    """SIGTERM to the server's whole process group (systemd's stop, `kill -TERM -PGID`), with its
    stages as local processes and on the embedded Ray: neither the stage processes nor Ray's
    daemons are in that group's way (they ignore it, or run in a session of their own), so the
    server drains: the stream running when the signal came ends with its tokens or the shutdown
    error, and the process exits 0 within the drain bound. A second SIGTERM during the drain exits
    at once (that server with --http-nice 0: at the stages' CPU priority)."""
    drain = 3.0
    srv = ServerProcess(serve_bundle, "--stages", "2", where, "--drain-timeout", str(drain),
                        log_path=tmp_path / "stderr.txt", env=slowed(0.02))
    body = {"model": MODEL, "prompt": [7, 8], "max_tokens": 40, "stream": True, "temperature": 0, "ignore_eos": True}

    async def run(second: bool):
        got: list = []
        started = asyncio.Event()
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
            task = asyncio.ensure_future(read_stream(c, body, got, started, after=2))
            await asyncio.wait_for(started.wait(), 120)
            t0 = time.time()
            os.killpg(srv.proc.pid, signal.SIGTERM)
            if second:
                await asyncio.sleep(0.5)
                os.killpg(srv.proc.pid, signal.SIGTERM)
            try:
                await task
            except httpx.HTTPError:
                pass  # the second signal closes the connection
        return got, t0

    try:
        got, t0 = asyncio.run(run(second=False))
        status = srv.proc.wait(60)
        took = time.time() - t0
        assert status == 0, srv.log()[-3000:]
        assert took < drain + 15, took
        assert got[-1] == "[DONE]" and len(tokens_of(got)) >= 2
        assert "SIGTERM: draining" in srv.log()
        assert "Traceback" not in srv.log(), srv.log()[-3000:]  # the engine process drained, not killed by it
    finally:
        srv.kill()
    srv = ServerProcess(serve_bundle, "--stages", "2", where, "--drain-timeout", "60", "--http-nice", "0",
                        log_path=tmp_path / "stderr2.txt", env=slowed(0.05))
    try:
        assert os.getpriority(os.PRIO_PROCESS, srv.proc.pid) == os.getpriority(os.PRIO_PROCESS, 0)
        got, t0 = asyncio.run(run(second=True))
        srv.proc.wait(60)
        assert time.time() - t0 < 30  # not the 60 s drain: the second signal cut it short
        assert "again: exiting now" in srv.log()
    finally:
        srv.kill()


def test_command_errors_are_one_line(serve_bundle, tmp_path, capsys):
    """Before any stage starts: no place to run, a bundle that is not a decode step, a tokenizer
    that is not the model's (more ids than its vocabulary), a port already taken."""
    from tests.serve.harness import build_tokenizer
    from tvmpipe.app.sources import builtin_example

    cases = [([str(serve_bundle)], "say where to run"),
             ([str(builtin_example()), "--processes"], "is not a decode-step bundle"),
             ([str(serve_bundle), "--processes", "--tokenizer", str(tmp_path / "none")], "not a directory"),
             ([str(serve_bundle), "--processes", "--tokenizer", str(build_tokenizer(tmp_path / "big", vocab=200))],
              "more than the model's vocabulary of 128")]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cases.append(([str(serve_bundle), "--processes", "--port", str(taken.getsockname()[1])], "cannot listen on"))
        for argv, message in cases:
            assert main(["serve", *argv]) == 2, argv
            err = capsys.readouterr().err
            assert message in err and len(err.strip().splitlines()) == 1, err
    for flag, value in (("--port", "70000"), ("--http-nice", "20"), ("--http-nice", "-1")):
        assert main(["serve", str(serve_bundle), "--processes", flag, value]) == 2
        assert flag in capsys.readouterr().err
