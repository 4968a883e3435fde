"""`tvmpipe serve` under load: requests/s, time to first token and inter-token latency at 1, 4 and 16
concurrent clients, and the server's tokens/s against offline generation of the same prompts.

    python bench/serve.py [--quick] [--bundle DIR] [--out bench/results/serve.json]
    python bench/serve.py --logprobs 5 [--quick]   # the cost of logprobs: bench/results/serve_logprobs.json
    python bench/serve.py --json-schema [--quick]  # the cost of a response_format: serve_json_schema.json
    python bench/serve.py --http-nice [--quick]    # the default --http-nice 10 against 0: serve_http_nice.json

The decode step is the zoo's GPT-2 (`tvmpipe compile gpt2 --decode`: tiny config, seed 1, max context
64), compiled once into --bundle, run as K = 2 stage processes on the reference backend (4 sequence
rows). The server is a real `python -m tvmpipe serve` child process; the clients are this process,
with httpx over loopback, each a closed loop: it sends a streaming /v1/completions request (a
prompt of 3-8 token ids, greedy, 48 new tokens (--new-tokens), `ignore_eos`, token ids returned),
reads it to the end, and sends the next, until the level's requests are done.

Per level (1, 4, 16 clients): requests/s and tokens/s over the level's wall time; TTFT (request
sent -> first token chunk) and inter-token latency (gaps between a stream's token chunks), p50 and
p99, over every request; each request's tokens checked against an offline run of the same prompts.

At 16 clients, side by side in one run, alternating (offline, server, server, offline, ...; 15 rounds
of 32 requests): the offline run of the same prompts (Generator on a 2-stage pipeline of its own,
every prompt queued at once, as `tvmpipe generate` does) and the server's; each server run is set
against the mean of the offline runs just before and after it, and the median of these ratios is
judged, target >= 0.9 x with both kinds of client (issue 50).
The server is measured twice a round: with the httpx clients, and with bare asyncio socket clients
(`socket_request`: HTTP/1.1 and the chunked SSE body read by hand). Server, stages and clients all
share this machine's cores, and httpx spends ~0.2 ms of CPU a streamed token, a bare client ~0.08
(the HTTP process ~0.13, the engine process ~0.33 where the offline driver spends ~0.3, the two
stages ~1.8; `cpu_ms_a_token`): that CPU is taken from the stages here, and from nobody where
clients run on machines of their own. The server is `tvmpipe serve` as users run it: the HTTP
process (--http-nice 10 below the rest), and the engine in a process of its own
(generation/engine_process.py).

`--http-nice` measures that default against --http-nice 0: two servers, 14 rounds of 16 httpx
clients on each in turn, each round's tokens/s paired (bench/results/serve_http_nice.json).

Each side-by-side run's CPU is booked by role from /proc (this process: the clients or the offline
driver; the server's process tree; the offline pipeline's stages): CPU milliseconds a token, the
cores kept busy, and the tokens/s with every core busy (cores / CPU a token), medians over the
rounds, in `cpu_ms_a_token`: what the server path adds per token, and how much of the distance to
offline is waiting rather than work.

`--logprobs K` measures instead what log probabilities cost (issue 51): at 16 bare socket clients,
alternating rounds of plain requests and the same requests with `logprobs` K (every token's log
probability and the K most likely, computed on the sampling stage, sent to the driver as the step's
scores, written into every chunk), tokens/s each and their ratio (median of the rounds), into
bench/results/serve_logprobs.json; the judged rows of serve.json are not touched. `--json-schema`
the same for a response_format json_schema (an object holding one string of up to 200 characters,
so that answers run to their max_tokens as plain ones do), the server given a tokenizer that can
spell JSON in GPT-2's 128 ids (tests/support/json_tokenizer.py): bench/results/serve_json_schema.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from stamp import stamp  # noqa: E402  (when, commit, machine: bench/perfpage.py reads them)

TARGET = 0.9
LEVELS = (1, 4, 16)
MODEL = "gpt2-step"
MAX_CONTEXT = 64


def run(coro):
    """The clients' event loop: uvloop where installed (as the server's), so that the clients take
    as little as they can of the cores the stages share."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def ensure_bundle(path: Path) -> Path:
    """The zoo's GPT-2 decode step at max context 64, compiled once (as `tvmpipe compile gpt2 --decode`)."""
    if not (path / "bundle.json").is_file():
        from tvmpipe.compiler.export import export
        from tvmpipe.compiler.progress import Progress

        print(f"compiling gpt2 --decode into {path} ...", flush=True)
        export("gpt2", progress=Progress(stream=None), decode=MAX_CONTEXT, seed=1).write(path)
    return path


def prompts_for(n: int) -> list[list[int]]:
    return [[(11 * i + 7 * j) % 120 + 4 for j in range(3 + i % 6)] for i in range(n)]


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:  # gone, or no /proc
        pass
    return out


def _cpu_s(pid: int) -> float:
    """user + system CPU seconds of process `pid` (Linux /proc; 0 where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


class CpuBook:
    """CPU seconds by role over a run, from /proc: this process (the clients, or the offline run's
    driver), the server's HTTP process, its engine process and the engine's stage processes, and
    the offline pipeline's stage processes (this process's other children). Why: on a machine whose cores the
    server, its stages and the clients share, tokens/s is bounded by cores / (CPU a token), and the
    ratio of the two runs' CPU a token says how much of the distance to offline is work the server
    path adds rather than time it waits."""

    def __init__(self, server_pid: int):
        self.server_pid = server_pid

    def snapshot(self) -> dict[str, float]:
        server = self._tree(self.server_pid)
        others = [p for c in _children(os.getpid()) if c != self.server_pid for p, _ in self._tree(c)]
        return {"this_process": _cpu_s(os.getpid()),
                "server_http": sum(_cpu_s(p) for p, depth in server if depth == 0),
                "server_engine": sum(_cpu_s(p) for p, depth in server if depth == 1),  # (and mp's resource tracker)
                "server_stages": sum(_cpu_s(p) for p, depth in server if depth > 1),
                "offline_stages": sum(_cpu_s(p) for p in others)}

    def _tree(self, pid: int) -> list[tuple[int, int]]:
        out, todo = [], [(pid, 0)]
        while todo:
            p, depth = todo.pop()
            out.append((p, depth))
            todo += [(c, depth + 1) for c in _children(p)]
        return out


def per_token_ms(before: dict[str, float], after: dict[str, float], tokens: int) -> dict[str, float]:
    return {k: (after[k] - before[k]) * 1e3 / tokens for k in before}


def offline(pipe, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    """tokens/s of the prompts run offline (every prompt queued at once, each keyed 0 as a served
    request is), and their tokens."""
    from tvmpipe.generation import Generator, Request, layout_of

    layout = layout_of(pipe.bundle)
    requests = [Request.checked(p, new, layout, key=0) for p in prompts]
    t0 = time.perf_counter()
    results = Generator(pipe).generate_all(requests)
    wall = time.perf_counter() - t0
    return sum(len(r.tokens) for r in results) / wall, [r.tokens for r in results]


async def one_request(client, prompt: list[int], new: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    t0 = time.perf_counter()
    times, tokens = [], []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            ids = [t for c in json.loads(line[6:]).get("choices", []) for t in c.get("token_ids", [])]
            if ids:
                times.append(time.perf_counter())
                tokens += ids
    return {"sent": t0, "times": times, "tokens": tokens}


async def socket_request(url: str, prompt: list[int], new: int, extra: dict | None = None) -> dict:
    """one_request over a bare asyncio connection: HTTP/1.1 written and its chunked SSE body read
    here, at a fraction of httpx's CPU a token (the side by side's second client); `extra`: more
    of the body (logprobs, a response_format; only the token ids are read back)."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    ask = {"model": MODEL, "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True,
           "ignore_eos": True, "return_token_ids": True, **(extra or {})}
    body = json.dumps(ask).encode()
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(body), body))
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200") or b"transfer-encoding: chunked" not in head.lower():
        raise RuntimeError(f"unexpected response: {head[:300]!r}")
    times, tokens, held = [], [], b""
    while True:
        size = int((await reader.readline()).strip(), 16)
        if size == 0:
            break
        events = (held + await reader.readexactly(size)).split(b"\n\n")
        await reader.readexactly(2)
        held = events.pop()
        for event in events:  # the token ids alone, not the whole chunk's JSON (checked by the levels' httpx runs)
            at = event.find(b'"token_ids":[')
            if at >= 0:
                ids = event[at + 13:event.index(b"]", at)]
                if ids:
                    times.append(time.perf_counter())
                    tokens += [int(t) for t in ids.split(b",")]
    writer.close()
    return {"sent": t0, "times": times, "tokens": tokens}


async def level(url: str, clients: int, prompts: list[list[int]], new: int, bare: bool = False,
                extra: dict | None = None) -> dict:
    """`clients` closed-loop clients over the prompts (httpx, or with `bare` socket_request, its
    body with `extra` if given); the level's figures and each prompt's tokens."""
    import httpx

    todo = list(enumerate(prompts))
    done: dict[int, dict] = {}

    async def worker(client) -> None:
        while todo:
            i, p = todo.pop(0)
            done[i] = await (socket_request(url, p, new, extra) if bare else one_request(client, p, new))

    async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=clients)) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(c) for _ in range(clients)))
        wall = time.perf_counter() - t0
    runs = [done[i] for i in range(len(prompts))]
    ttft = [(r["times"][0] - r["sent"]) * 1e3 for r in runs]
    itl = [(b - a) * 1e3 for r in runs for a, b in zip(r["times"], r["times"][1:])]
    tokens = sum(len(r["tokens"]) for r in runs)
    return {"clients": clients, "requests": len(prompts), "wall_s": wall, "requests_per_s": len(prompts) / wall,
            "tokens_per_s": tokens / wall, "ttft_ms_p50": pct(ttft, 0.5), "ttft_ms_p99": pct(ttft, 0.99),
            "itl_ms_p50": pct(itl, 0.5), "itl_ms_p99": pct(itl, 0.99), "tokens": [r["tokens"] for r in runs]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests and rounds")
    ap.add_argument("--bundle", type=Path, default=Path("/tmp/tvmpipe-bench-serve-gpt2"),
                    help="where the GPT-2 decode step is compiled (reused when present)")
    ap.add_argument("--new-tokens", type=int, default=48, help="tokens a request (default 48)")
    ap.add_argument("--out", type=Path, default=None, help="default bench/results/serve.json "
                    "(with --logprobs: serve_logprobs.json)")
    ap.add_argument("--logprobs", type=int, default=None, metavar="K",
                    help="measure the cost of logprobs=K against plain requests instead")
    ap.add_argument("--json-schema", action="store_true",
                    help="measure the cost of a response_format json_schema against plain requests instead")
    ap.add_argument("--http-nice", action="store_true",
                    help="measure --http-nice 10 (the default) against 0 instead: serve_http_nice.json")
    args = ap.parse_args()
    if args.http_nice:
        return http_nice(args)
    if args.logprobs is not None:
        return cost(args, "logprobs", {"logprobs": args.logprobs}, ())
    if args.json_schema:
        from tests.support.json_tokenizer import build_json_tokenizer

        tok = build_json_tokenizer(Path(os.environ.get("TMPDIR", "/tmp")) / "tvmpipe-bench-json-tokenizer")
        schema = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 200}},
                  "required": ["text"], "additionalProperties": False}
        return cost(args, "json_schema", {"ignore_eos": False, "response_format": {
            "type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}}, ("--tokenizer", str(tok)),
            plain_extra={"ignore_eos": False})
    args.out = args.out or ROOT / "bench" / "results" / "serve.json"
    from tests.serve.harness import ServerProcess
    from tvmpipe.cluster.driver import Pipeline

    bundle = ensure_bundle(args.bundle)
    new = args.new_tokens
    per_client = 2 if args.quick else 4
    rounds = 2 if args.quick else 15  # the machine drifts between runs: more rounds, a steadier median
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "tvmpipe-bench-serve.log"
    results: dict = {"decoder": "gpt2", "bundle": str(bundle), "max_context": MAX_CONTEXT, "stages": 2,
                     "backend": "reference", "new_tokens": new, "levels": []}
    # a paged step's pool sized as tvmpipe generate sizes it (the compiled one holds one row)
    with Pipeline(bundle, 2, launcher="process", logits=False, kv_tokens="auto") as pipe:
        results["rows"] = pipe.slots * pipe.topology.batch
        srv = ServerProcess(bundle, "--stages", "2", "--processes", "--max-waiting", "64", log_path=log)
        try:
            url = srv.url
            run(level(url, 4, prompts_for(4), 4))  # warm-up: connections, first requests
            offline(pipe, prompts_for(4), 4)
            for clients in LEVELS:
                prompts = prompts_for(per_client * clients)
                lv = run(level(url, clients, prompts, new))
                _, want = offline(pipe, prompts, new)
                lv["same_tokens_as_offline"] = lv.pop("tokens") == want
                results["levels"].append(lv)
                print(f"{clients:>2} client(s): {lv['requests_per_s']:.2f} requests/s, {lv['tokens_per_s']:.0f} tokens/s, "
                      f"TTFT p50/p99 {lv['ttft_ms_p50']:.1f}/{lv['ttft_ms_p99']:.1f} ms, ITL p50/p99 "
                      f"{lv['itl_ms_p50']:.1f}/{lv['itl_ms_p99']:.1f} ms, same tokens: {lv['same_tokens_as_offline']}",
                      flush=True)
            prompts = prompts_for(2 * LEVELS[-1])  # short runs, many of them: the machine's load drifts
            served, bare, alone = [], [], []
            book = CpuBook(srv.proc.pid)
            cpu: dict[str, list[dict[str, float]]] = {"offline": [], "bare": [], "httpx": []}

            def counted(what: str, fn):
                before, t0 = book.snapshot(), time.perf_counter()
                out = fn()
                wall, after = time.perf_counter() - t0, book.snapshot()
                cpu[what].append({**per_token_ms(before, after, len(prompts) * new),
                                  "cores_busy": (sum(after.values()) - sum(before.values())) / wall})
                return out

            tps, want = counted("offline", lambda: offline(pipe, prompts, new))
            alone.append(tps)
            for _ in range(rounds):
                lv = counted("bare", lambda: run(level(url, LEVELS[-1], prompts, new, bare=True)))
                if lv.pop("tokens") != want:
                    raise RuntimeError("the bare clients' tokens differ from the offline run's")
                bare.append(lv["tokens_per_s"])
                served.append(counted("httpx", lambda: run(level(url, LEVELS[-1], prompts, new)))["tokens_per_s"])
                alone.append(counted("offline", lambda: offline(pipe, prompts, new))[0])
                print(f"16 clients: server {bare[-1]:.0f} (bare socket clients) / {served[-1]:.0f} (httpx clients) "
                      f"tokens/s, offline {alone[-2]:.0f} before and {alone[-1]:.0f} after", flush=True)
        finally:
            status = srv.stop()
        if status != 0:
            print(f"the server exited with status {status}:\n{srv.log()[-2000:]}", file=sys.stderr)
            return 1
    # each server run against the offline runs just before and after it: the load others put on
    # the machine moves between runs, much less within one round
    around = [(alone[i] + alone[i + 1]) / 2 for i in range(rounds)]
    ratio = statistics.median(b / a for b, a in zip(bare, around))
    with_httpx = statistics.median(h / a for h, a in zip(served, around))
    results["side_by_side"] = {"clients": LEVELS[-1], "requests": len(prompts), "server_tokens_per_s_runs": bare,
                               "server_httpx_clients_tokens_per_s_runs": served, "offline_tokens_per_s_runs": alone,
                               "ratio": ratio, "ratio_httpx_clients": with_httpx}
    cores = os.cpu_count() or 1
    results["cpu_ms_a_token"] = {}
    for what, runs in cpu.items():  # medians over the rounds, by role; the ceiling: every core busy
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        total = sum(v for k, v in med.items() if k != "cores_busy")
        med.update(total=total, ceiling_tokens_per_s=cores * 1e3 / total if total else None)
        results["cpu_ms_a_token"][what] = med
    results["target"] = {"server_over_offline_at_16": TARGET}
    results["machine"] = {"loadavg": list(os.getloadavg())}
    for what, med in results["cpu_ms_a_token"].items():
        print(f"CPU a token, {what}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in med.items()
                                                   if k not in ("cores_busy", "ceiling_tokens_per_s"))
              + f"; {med['cores_busy']:.2f} of {cores} cores busy; every core busy: "
              f"{med['ceiling_tokens_per_s']:.0f} tokens/s")
    met = ratio >= TARGET and with_httpx >= TARGET
    print(f"server / offline tokens/s at 16 clients (median of {rounds} rounds): {ratio:.2f}x with bare socket clients, "
          f"{with_httpx:.2f}x with httpx clients (>= {TARGET} with both): {'PASS' if met else 'FAIL'}")
    from tvmpipe.core.files import write_json

    write_json(args.out, stamp(results))
    print(f"wrote {args.out}")
    return 0


def cost(args, what: str, extra: dict, server_args: tuple[str, ...], plain_extra: dict | None = None) -> int:
    """Plain requests against the same asking for `what` (`extra` in their bodies), alternating
    rounds at 16 bare clients; tokens/s each, and their ratio."""
    from tests.serve.harness import ServerProcess

    bundle = ensure_bundle(args.bundle)
    new = args.new_tokens
    rounds = 2 if args.quick else 7
    prompts = prompts_for(2 * LEVELS[-1])
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"tvmpipe-bench-serve-{what}.log"
    srv = ServerProcess(bundle, "--stages", "2", "--processes", "--max-waiting", "64", *server_args, log_path=log)
    plain, asked = [], []
    try:
        run(level(srv.url, 4, prompts_for(4), 4, bare=True, extra=extra))  # warm-up
        for _ in range(rounds):
            a = run(level(srv.url, LEVELS[-1], prompts, new, bare=True, extra=plain_extra))
            b = run(level(srv.url, LEVELS[-1], prompts, new, bare=True, extra=extra))
            if what == "logprobs" and a.pop("tokens") != b.pop("tokens"):
                raise RuntimeError("logprobs changed the tokens")
            plain.append(a["tokens_per_s"])
            asked.append(b["tokens_per_s"])
            print(f"16 clients: plain {plain[-1]:.0f} tokens/s, {what} {asked[-1]:.0f} tokens/s", flush=True)
    finally:
        status = srv.stop()
    if status != 0:
        print(f"the server exited with status {status}:\n{srv.log()[-2000:]}", file=sys.stderr)
        return 1
    ratio = statistics.median(s / p for s, p in zip(asked, plain))
    results = {"decoder": "gpt2", "bundle": str(bundle), "stages": 2, "backend": "reference", "new_tokens": new,
               "clients": LEVELS[-1], "requests": len(prompts), "asked": extra, "plain_tokens_per_s_runs": plain,
               f"{what}_tokens_per_s_runs": asked, "ratio": ratio, "machine": {"loadavg": list(os.getloadavg())}}
    print(f"{what} / plain tokens/s at 16 clients (median of {rounds} rounds): {ratio:.2f}x")
    from tvmpipe.core.files import write_json

    out = args.out or ROOT / "bench" / "results" / f"serve_{what}.json"
    write_json(out, stamp(results))
    print(f"wrote {out}")
    return 0


def http_nice(args) -> int:
    """`tvmpipe serve` as it runs by default (its HTTP process --http-nice 10 below the engine and the
    stages) against the same server with --http-nice 0, side by side: two servers, rounds of 16
    httpx clients on each in turn (which goes first alternates), each round's two tokens/s paired."""
    from tests.serve.harness import ServerProcess

    bundle = ensure_bundle(args.bundle)
    new = args.new_tokens
    rounds = 2 if args.quick else 14
    prompts = prompts_for(2 * LEVELS[-1])
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    servers = {nice: ServerProcess(bundle, "--stages", "2", "--processes", "--max-waiting", "64", "--http-nice",
                                   str(nice), log_path=tmp / f"tvmpipe-bench-serve-nice{nice}.log") for nice in (10, 0)}
    runs: dict[int, list[float]] = {10: [], 0: []}
    try:
        for srv in servers.values():
            run(level(srv.url, 4, prompts_for(4), 4))  # warm-up
        for i in range(rounds):
            for nice in ((10, 0) if i % 2 == 0 else (0, 10)):
                runs[nice].append(run(level(servers[nice].url, LEVELS[-1], prompts, new))["tokens_per_s"])
            print(f"16 clients: --http-nice 10 {runs[10][-1]:.0f} tokens/s, --http-nice 0 {runs[0][-1]:.0f}", flush=True)
    finally:
        statuses = [srv.stop() for srv in servers.values()]
    if any(statuses):
        print(f"a server exited with status {statuses}", file=sys.stderr)
        return 1
    paired = [a / b for a, b in zip(runs[10], runs[0])]
    results = {"decoder": "gpt2", "bundle": str(bundle), "stages": 2, "backend": "reference", "new_tokens": new,
               "clients": LEVELS[-1], "client": "httpx", "requests": len(prompts),
               "nice10_tokens_per_s_runs": runs[10], "nice0_tokens_per_s_runs": runs[0],
               "ratio": statistics.median(paired), "rounds_higher": sum(r > 1 for r in paired), "rounds": rounds,
               "machine": {"loadavg": list(os.getloadavg())}}
    print(f"--http-nice 10 / 0 tokens/s at 16 httpx clients (median of {rounds} paired rounds): {results['ratio']:.2f}x, "
          f"higher in {results['rounds_higher']} of {rounds}")
    from tvmpipe.core.files import write_json

    out = args.out or ROOT / "bench" / "results" / "serve_http_nice.json"
    write_json(out, stamp(results))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
