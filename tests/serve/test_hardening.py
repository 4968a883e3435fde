"""Every error is a JSON error (issue 50, item 5), over real HTTP to a `tvmpipe serve` process:
bodies json.loads cannot take (nested 1,000+ deep, lone surrogates), chat_template_kwargs naming
what the server passes the template itself, an unexpected exception in a route (a 500 in OpenAI's
error shape, the traceback in the log only), and connections that never finish a request's
headers, or idle after one (closed after --header-timeout / --keep-alive-timeout while the server
answers others), or whose body stalls (408 after --body-timeout). Also the command's one-line errors: an empty API key, and a prompts file line
nested 2,000 deep (tests/app/test_generate_jobs.py holds the other bad lines).

One server for the module, as conftest.py's `server` but with short timeouts, and a fault planted
by a sitecustomize on its PYTHONPATH: a completion whose prompt is FAULT_PROMPT raises a RuntimeError
inside the route (Service.prepare), as a bug would."""

from __future__ import annotations

import json
import os
import selectors
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.serve.harness import API_KEY, MODEL, ServerProcess
from tvmpipe.cli import main
from tvmpipe.serve.protocol import MAX_JSON_DEPTH, TEMPLATE_NAMES

pytest.importorskip("tvm")
pytestmark = [pytest.mark.tvm, pytest.mark.slow]

HEADER_TIMEOUT = 3.0  # --header-timeout of the module's server
KEEP_ALIVE_TIMEOUT = 2.0  # --keep-alive-timeout
BODY_TIMEOUT = 3.0  # --body-timeout
FAULT_PROMPT = "plant a fault"
SECRET = "secret-detail-4f1c"  # in the planted exception's message: in the log, never in a response

SITECUSTOMIZE = f'''
import importlib.abc, importlib.util, sys

class _Plant(importlib.abc.MetaPathFinder):
    """Wraps tvmpipe.serve.service.Service.prepare once that module is imported (never in the stages)."""

    def find_spec(self, name, path, target=None):
        if name != "tvmpipe.serve.service":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            prepare = module.Service.prepare

            def planted(self, ask):
                if ask.prompt == {FAULT_PROMPT!r}:
                    raise RuntimeError("a planted bug: {SECRET}")
                return prepare(self, ask)

            module.Service.prepare = planted

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _Plant())
'''


@pytest.fixture(scope="module")
def server(serve_bundle, chat_tokenizer, tmp_path_factory):
    plant = tmp_path_factory.mktemp("plant")
    (plant / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(plant), os.environ.get("PYTHONPATH")) if p)
    log = tmp_path_factory.mktemp("server") / "stderr.txt"
    srv = ServerProcess(serve_bundle, "--stages", "2", "--processes", "--tokenizer", str(chat_tokenizer),
                        "--max-waiting", "12", "--max-body-bytes", "65536", "--header-timeout", str(HEADER_TIMEOUT),
                        "--keep-alive-timeout", str(KEEP_ALIVE_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT), log_path=log,
                        env={"TVMPIPE_API_KEY": API_KEY, "PYTHONPATH": path}, api_key=API_KEY)
    yield srv
    status = srv.stop()
    assert status == 0, srv.log()[-3000:]


@pytest.fixture
def http(server):
    """A client, and afterwards: the server wrote no traceback meanwhile (a 400 is not an accident)."""
    before = server.log().count("Traceback")
    with server.client() as c:
        yield c
    assert server.log().count("Traceback") == before, server.log()[-3000:]


def post(http: httpx.Client, path: str, raw: bytes) -> httpx.Response:
    return http.post(path, content=raw, headers={"Content-Type": "application/json"})


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert "Traceback" not in r.text and 'File "' not in r.text
    return body["error"]


# ---- bodies --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("depth", [1_000, 5_000])  # within --max-body-bytes
def test_deep_json_is_a_400_naming_the_limit(http, path, depth):
    in_prompt = b'{"model": "m", "prompt": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b"}"
    for raw in (b"[" * depth + b"]" * depth, in_prompt):
        error = openai_error(post(http, path, raw), 400)
        assert f"limit of {MAX_JSON_DEPTH}" in error["message"], error
    ok = {"model": MODEL, "prompt": "hello", "max_tokens": 1, "user": "x"}
    nested = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
              "chat_template_kwargs": {"deep": json.loads("[" * (MAX_JSON_DEPTH - 3) + "]" * (MAX_JSON_DEPTH - 3))}}
    r = http.post(path, json=nested if "chat" in path else ok)  # within the bound: served
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path,raw,param", [
    ("/v1/completions", b'{"model": "M", "prompt": "hello \\ud800"}', "prompt"),
    ("/v1/chat/completions", b'{"model": "M", "messages": [{"role": "user", "content": "\\udfff hi"}]}',
     "messages[0].content"),
    ("/v1/chat/completions", b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], '
                             b'"chat_template_kwargs": {"\\ud800": 1}}', "chat_template_kwargs"),
    ("/v1/completions", b'{"model": "M", "prompt": "hi", "stop": ["\\udc00"]}', "stop[0]"),
])
def test_lone_surrogates_are_a_400_naming_the_field(http, path, raw, param):
    error = openai_error(post(http, path, raw.replace(b'"M"', json.dumps(MODEL).encode())), 400)
    assert error["param"] == param and "cannot be encoded as UTF-8" in error["message"], error
    pair = {"model": MODEL, "prompt": "hello \U0001F600", "max_tokens": 1}  # a surrogate pair is text
    assert post(http, "/v1/completions", json.dumps(pair).encode()).status_code == 200


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_chat_template_kwargs_cannot_hold_what_the_server_passes(http, name):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "chat_template_kwargs": {name: [{"role": "user", "content": "x"}]}}
    error = openai_error(http.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == "chat_template_kwargs" and name in error["message"], error
    body["chat_template_kwargs"] = {"enable_thinking": False}  # what they are for: served
    assert http.post("/v1/chat/completions", json=body).status_code == 200


# ---- unexpected exceptions -----------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_an_unexpected_exception_is_a_json_500_and_a_logged_traceback(server, stream):
    before = server.log().count("Traceback")
    with server.client() as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": FAULT_PROMPT, "stream": stream})
        error = openai_error(r, 500)
        assert error["code"] == "internal_error" and error["param"] is None
        assert SECRET not in r.text and "RuntimeError" not in r.text
        error_id = error["message"].split("error id ")[1].split(";")[0]
        assert http.get("/v1/models").status_code == 200  # the server goes on
    deadline = time.time() + 30
    while error_id not in server.log() and time.time() < deadline:
        time.sleep(0.1)
    log = server.log()
    assert log.count("Traceback") == before + 1, log[-3000:]
    tail = log[log.index(error_id):]
    assert "RuntimeError: a planted bug: " + SECRET in tail and "POST /v1/completions" in log, tail[:3000]
    assert "Exception in ASGI application" not in log  # the Gate's log line, not uvicorn's second one


# ---- connections ---------------------------------------------------------------------------------------

def address(server) -> tuple[str, int]:
    url = httpx.URL(server.url)
    return url.host, url.port


def wait_closed(socks: dict[socket.socket, float], deadline: float) -> dict[socket.socket, float]:
    """The time each socket's connection was closed by the server (EOF or reset), until `deadline`."""
    closed: dict[socket.socket, float] = {}
    with selectors.DefaultSelector() as sel:
        for s in socks:
            sel.register(s, selectors.EVENT_READ)
        while len(closed) < len(socks) and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=min(0.5, max(0.0, deadline - time.monotonic()))):
                s = key.fileobj
                try:
                    data = s.recv(65536)
                except ConnectionError:
                    data = b""
                if not data:
                    closed[s] = time.monotonic()
                    sel.unregister(s)
    return closed


def test_connections_that_never_finish_their_headers_are_closed(server):
    """200 connections: half send nothing, half a request line and part of a header. The server
    answers a normal request meanwhile, and closes each of them once --header-timeout has passed
    since it connected (not before: uvicorn's own timers did not close them at all), without
    writing anything to them."""
    host, port = address(server)
    opened: dict[socket.socket, float] = {}
    try:
        for i in range(200):
            s = socket.create_connection((host, port), timeout=30)
            opened[s] = time.monotonic()
            if i % 2:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
            s.setblocking(False)
        with server.client() as http:  # served while they are held
            assert http.get("/v1/models").status_code == 200
        started = time.monotonic()
        closed = wait_closed(opened, started + HEADER_TIMEOUT + max(20.0, 4 * HEADER_TIMEOUT))
        assert len(closed) == len(opened), f"{len(opened) - len(closed)} of {len(opened)} still open"
        early = [closed[s] - opened[s] for s in opened if closed[s] - opened[s] < HEADER_TIMEOUT - 0.25]
        assert not early, f"closed before the header timeout: {sorted(early)[:5]}"
    finally:
        for s in opened:
            s.close()
    with server.client() as http:
        assert http.get("/v1/models").status_code == 200


def test_a_stalled_body_is_a_408_after_the_body_timeout(server):
    """A request whose body stops short of its Content-Length (a client trickling or gone quiet) is
    answered 408 in OpenAI's error JSON once --body-timeout has passed, not held for ever, and the
    connection is closed; the server answers others meanwhile and after."""
    host, port = address(server)
    with socket.create_connection((host, port), timeout=60) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                  "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\": ".encode())
        sent = time.monotonic()
        with server.client() as http:
            assert http.get("/v1/models").status_code == 200
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        waited = time.monotonic() - sent
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data[:200]
    err = json.loads(body)["error"]
    assert err["code"] == "request_timeout" and "--body-timeout" in err["message"], err
    assert BODY_TIMEOUT - 0.25 <= waited < BODY_TIMEOUT + 20, waited
    with server.client() as http:
        assert http.get("/v1/models").status_code == 200


def request(sock: socket.socket, path: str = "/v1/models") -> bytes:
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:])
    length = int(next(v for k, v in fields.items() if k.lower() == b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 200"), head
    return body


def test_idle_and_stalled_kept_alive_connections_are_closed(server):
    """After a response, an idle connection is closed after --keep-alive-timeout; one that starts
    a second request and stalls in its headers, after --header-timeout."""
    host, port = address(server)
    idle, stalled = (socket.create_connection((host, port), timeout=30) for _ in range(2))
    try:
        request(idle)
        done = time.monotonic()
        request(stalled)
        stalled.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        begun = time.monotonic()
        for s in (idle, stalled):
            s.setblocking(False)
        deadline = time.monotonic() + HEADER_TIMEOUT + max(20.0, 4 * HEADER_TIMEOUT)
        closed = wait_closed({idle: done, stalled: begun}, deadline)
        assert set(closed) == {idle, stalled}, closed
        assert closed[idle] - done >= KEEP_ALIVE_TIMEOUT - 0.25
        assert closed[stalled] - begun >= HEADER_TIMEOUT - 0.25
    finally:
        idle.close()
        stalled.close()


# ---- the commands' one-line errors -----------------------------------------------------------------------

def test_an_empty_api_key_is_refused_at_start(serve_bundle, monkeypatch, capsys):
    """An empty key would turn authentication off without a word. (The port is taken: a server
    that started without the key would fail to listen, rather than serve on.)"""
    monkeypatch.delenv("TVMPIPE_API_KEY", raising=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        argv = ["serve", str(serve_bundle), "--processes", "--port", str(taken.getsockname()[1])]
        assert main([*argv, "--api-key", ""]) == 2
        err = capsys.readouterr().err
        assert "--api-key is empty" in err and len(err.strip().splitlines()) == 1, err
        for value in ("", "  "):
            monkeypatch.setenv("TVMPIPE_API_KEY", value)
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert "TVMPIPE_API_KEY is empty" in err and len(err.strip().splitlines()) == 1, err


def test_a_prompts_file_line_nested_2000_deep_is_one_line(serve_bundle, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hello"}\n{"prompt_ids": ' + "[" * 2000 + "]" * 2000 + "}\n")
    assert main(["generate", str(serve_bundle), "--processes", "--prompts-file", str(src),
                 "--output", str(tmp_path / "out.jsonl")]) == 2
    err = capsys.readouterr().err
    assert f"{src} line 2: " in err and f"limit of {MAX_JSON_DEPTH}" in err and len(err.strip().splitlines()) == 1, err


def test_header_timeouts_must_be_positive(serve_bundle, capsys):
    for option in ("--header-timeout", "--keep-alive-timeout", "--body-timeout"):
        assert main(["serve", str(serve_bundle), "--processes", option, "0"]) == 2
        assert option in capsys.readouterr().err
