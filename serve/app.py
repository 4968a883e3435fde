"""The HTTP routes (FastAPI): /health, /v1/models, /v1/completions, /v1/chat/completions, /metrics.

Thin by design: a route reads the body into an Ask (serve.protocol), has the Service make the
generation request (serve.service), submits it as a ServedSequence (serve.sequence) and writes
what comes back, as one JSON body or as server-sent events. Every error is OpenAI's error JSON.

`Gate`, a plain ASGI middleware around the routes, does what must happen before a route runs:
the API key (every path but /health, compared in constant time), the body bound (413 from the
Content-Length alone, or as soon as a chunked body passes it: never more than the bound is kept),
and counting responses by status for /metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from tvmpipe.generation.engine import EngineClosed, QueueFull
from tvmpipe.generation.output import RequestOutput
from tvmpipe.serve import metrics
from tvmpipe.serve.protocol import DONE, ApiError, Ask, Reply, finish_reason, read_ask, read_json_body, sse
from tvmpipe.serve.sequence import Bridge, SequenceFailed, ServedSequence
from tvmpipe.serve.service import Service

OPEN_PATHS = frozenset({"/health"})  # reachable without the API key (load balancers, orchestrators)
STAGE_STATUS_TIMEOUT_S = 2.0  # /metrics answers without the stages' pids rather than wait for a restart
CLIENT_GONE = 499  # nginx's "client closed request", counted for a non-streaming request given up
ERROR_ID = "tvmpipe.error_id"  # the scope key of an unexpected error's id: in the 500's message and the log
log = logging.getLogger("uvicorn.error")  # uvicorn's: to stderr in `tvmpipe serve`


def error_response(exc: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def internal_error(scope: dict) -> ApiError:
    """The 500 of an unexpected exception: an id to find its traceback in the log by, nothing of
    the exception itself (the traceback is logged by the Gate, never sent)."""
    error_id = scope.setdefault(ERROR_ID, uuid.uuid4().hex[:16])
    return ApiError(500, f"internal server error (error id {error_id}; the details are in the server's log)",
                    code="internal_error")


class Gate:
    """API key, body bound and response counts, around the whole app (see the module docstring);
    and the last word on an unexpected exception: its traceback goes to the log, the client gets
    OpenAI's error JSON with status 500 (create_app's handler writes it; here if nothing did)."""

    def __init__(self, app: Any, *, api_key: str | None, max_body_bytes: int, counters: metrics.Counters,
                 body_timeout: float = 30.0):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body = max_body_bytes
        self.counters = counters
        self.body_timeout = body_timeout

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = complete = False

        async def counted(message: dict) -> None:
            nonlocal started, complete
            if message["type"] == "http.response.start":
                started = True
                self.counters.response(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        refused = self._refuse(scope["path"], headers)
        if refused is not None:
            await error_response(refused)(scope, receive, counted)
            return
        seen, body_done = 0, False
        deadline = asyncio.get_running_loop().time() + self.body_timeout

        async def bounded() -> dict:
            nonlocal seen, body_done
            if body_done:  # the body is in: what a route waits for now (a disconnect) may take any time
                return await receive()
            try:  # a body trickled or stalled would hold the connection and its task for ever
                message = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except asyncio.TimeoutError:
                raise ApiError(408, f"the request body did not arrive within {self.body_timeout:g} s (--body-timeout)",
                               code="request_timeout") from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise _too_large(self.max_body)
                body_done = not message.get("more_body", False)
            return message

        try:
            await self.app(scope, bounded, counted)
        except ApiError as exc:  # a body past the bound, read by a route
            if started:
                raise
            await error_response(exc)(scope, receive, counted)
        except Exception as exc:
            if started and not complete:  # a stream cut short: uvicorn logs it and closes the connection
                raise
            error = internal_error(scope)
            log.error("unexpected error in %s %s (answered 500, error id %s)", scope.get("method"), scope.get("path"),
                      scope[ERROR_ID], exc_info=exc)
            if not started:
                await error_response(error)(scope, receive, counted)

    def _refuse(self, path: str, headers: dict[bytes, bytes]) -> ApiError | None:
        if self.api_key is not None and path not in OPEN_PATHS:
            scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.api_key):
                return ApiError(401, "invalid or missing API key: send `Authorization: Bearer KEY`",
                                code="invalid_api_key")
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return ApiError(400, "Content-Length is not a number")
            if int(length) > self.max_body:
                return _too_large(self.max_body)
        return None


def _too_large(bound: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server's bound of {bound} bytes (--max-body-bytes)",
                    code="request_too_large")


def create_app(service: Service, *, api_key: str | None = None, max_body_bytes: int = 1 << 20,
               body_timeout: float = 30.0, counters: metrics.Counters | None = None) -> Any:
    """The ASGI app: the routes behind the Gate."""
    counters = counters if counters is not None else metrics.Counters()
    engine = service.engine
    bridges: dict[asyncio.AbstractEventLoop, Bridge] = {}  # one per event loop serving the app
    app = FastAPI(title="tvmpipe serve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:  # unknown path, wrong method
        detail = exc.detail if isinstance(exc.detail, str) else "error"
        return error_response(ApiError(exc.status_code, f"{detail}: {request.method} {request.url.path}"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:  # Starlette re-raises it to the Gate
        return error_response(internal_error(request.scope))

    @app.get("/health")
    async def health() -> JSONResponse:
        stats = engine.stats()
        if stats.failed is not None:
            return JSONResponse({"status": "failed", "error": stats.failed}, status_code=503)
        if stats.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    def model_card() -> dict[str, Any]:
        return {"id": service.model, "object": "model", "created": service.created, "owned_by": "tvmpipe",
                "max_model_len": service.max_context}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        service.check_model(Ask(chat=False, model=model))
        return model_card()

    @app.get("/metrics")
    async def metrics_text() -> PlainTextResponse:
        try:
            stages = await asyncio.wait_for(asyncio.to_thread(service.stage_info), STAGE_STATUS_TIMEOUT_S)
        except asyncio.TimeoutError:
            stages = []
        text = metrics.render(service.model, engine.stats(), counters, stages)
        return PlainTextResponse(text, media_type=metrics.CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def generate(request: Request, chat: bool) -> Response:
        try:
            raw = await request.body()
        except ClientDisconnect:  # the client left before its body was in: nobody to answer
            return Response(status_code=CLIENT_GONE)
        body = read_json_body(raw)
        ask = read_ask(body, chat=chat)
        if service.codec is None:  # no text to send: the tokens are the answer
            ask = dataclasses.replace(ask, return_token_ids=True)
        prepared = service.prepare(ask)
        loop = asyncio.get_running_loop()
        bridge = bridges.get(loop) or bridges.setdefault(loop, Bridge(loop))
        seqs: list[ServedSequence] = []
        try:
            for r in prepared.requests:
                seqs.append(ServedSequence(engine, bridge, r))
        except (QueueFull, EngineClosed) as exc:
            for seq in seqs:  # a request's choices run together or not at all
                seq.close()
            if isinstance(exc, QueueFull):
                raise ApiError(429, f"{exc}: retry later", code="queue_full") from None
            raise ApiError(503, str(exc), code="unavailable") from None
        counters.prompt_tokens += prepared.prompt_tokens
        prompts = ask.prompts or (ask.prompt,)
        reply = Reply(ask, service.model, prepared.prompt_ids, token_text=service.token_text,
                      prompts=prepared.prompts, tool_format=prepared.tool_format, tool_forced=prepared.tool_forced,
                      prompt_texts=[service.prompt_text(ask, p, ids) for p, ids in zip(prompts, prepared.prompts)]
                      if ask.echo else [])
        if len(seqs) > 1:
            if ask.stream:
                return StreamingResponse(events_of_choices(seqs, reply), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            return await whole_choices(request, seqs, reply, prepared.n, prepared.runs)
        seq = seqs[0]
        if ask.stream:
            return StreamingResponse(events(seq, reply), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await whole(request, seq, reply)

    return Gate(app, api_key=api_key, max_body_bytes=max_body_bytes, counters=counters, body_timeout=body_timeout)


async def events(seq: ServedSequence, reply: Reply) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed request. The response closing early (the client went
    away: Starlette cancels this generator) cancels the sequence (ServedSequence.outputs)."""
    ask = reply.ask
    first = True
    if ask.chat:  # the role first, as OpenAI's and vLLM's streams begin
        yield sse(reply.chunk("", [], None, first=True))
        first = False
    count = 0
    scored = ask.logprobs is not None or (ask.echo and not ask.chat)
    tools = reply.tool_stream() if reply.tool_format is not None else None  # content now, calls at the end
    try:
        async for out in seq.outputs():
            count += len(out.token_ids)
            if tools is not None:
                text = tools.push(out.text)
                if out.finish is not None:
                    if text:
                        yield sse(reply.chunk(text, None, None))
                    yield sse(reply.tool_chunk(tools, finish_reason(out.finish)))
                elif text:
                    yield sse(reply.chunk(text, None, None))
                continue
            if scored:  # each chunk carries its tokens' log probabilities (the first: an echo's prompt)
                finish = finish_reason(out.finish) if out.finish is not None else None
                yield sse(reply.chunk(out.text, list(out.token_ids), finish, first=first, logprobs=out.logprobs,
                                      prompt_logprobs=out.prompt_logprobs))
                first = False
            elif first or out.finish is not None:
                finish = finish_reason(out.finish) if out.finish is not None else None
                yield sse(reply.chunk(out.text, list(out.token_ids), finish, first=first))
                first = False
            elif out.text or (ask.return_token_ids and not ask.chat):
                yield reply.token_event(out.text, list(out.token_ids))
            elif ask.return_token_ids:  # a chat token whose text is held: an empty delta with its id
                yield sse(reply.chunk(out.text, list(out.token_ids), None))
    except SequenceFailed as exc:
        yield sse(_failed(exc).body())
        yield DONE
        return
    if ask.include_usage:
        yield sse(reply.usage_chunk(count))
    yield DONE


async def whole(request: Request, seq: ServedSequence, reply: Reply) -> Response:
    """A non-streamed request: the whole body once the sequence ends; a client that disconnects
    first has its sequence cancelled."""

    async def run() -> dict[str, Any]:
        text, ids, finish, lps, prompt_lps = [], [], "length", [], None
        async for out in seq.outputs():
            text.append(out.text)
            ids.extend(out.token_ids)
            lps.extend(out.logprobs or ())
            prompt_lps = out.prompt_logprobs if out.prompt_logprobs is not None else prompt_lps
            if out.finish is not None:
                finish = finish_reason(out.finish)
        return reply.body("".join(text), ids, finish, logprobs=lps, prompt_logprobs=prompt_lps)

    return await _answer(request, run, [seq])


async def _choices(seqs: list[ServedSequence]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of a request's sequences as they come, each with its choice's index; the first
    that fails fails the request (SequenceFailed), and leaving early cancels every one left."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, seq: ServedSequence) -> None:
        try:
            async for out in seq.outputs():
                queue.put_nowait((i, out, None))
        except SequenceFailed as exc:
            queue.put_nowait((i, None, exc))
        else:
            queue.put_nowait((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, seq)) for i, seq in enumerate(seqs)]
    try:
        left = len(seqs)
        while left:
            i, out, exc = await queue.get()
            if exc is not None:
                raise exc
            if out is None:
                left -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        for seq in seqs:
            seq.close()


async def events_of_choices(seqs: list[ServedSequence], reply: Reply) -> AsyncIterator[bytes]:
    """The server-sent events of a request with several choices (n, a batch of prompts): each
    chunk names its choice's index, each choice begins with its first chunk (a chat's role, an
    echo's prompt) and ends with its finish_reason."""
    ask = reply.ask
    started: set[int] = set()
    count = 0
    if ask.chat:
        for i in range(len(seqs)):
            yield sse(reply.chunk("", [], None, first=True, index=i))
            started.add(i)
    tools: dict[int, Any] = {}  # a chat with tools: each answer's content now, its calls at its end
    try:
        async for i, out in _choices(seqs):
            count += len(out.token_ids)
            finish = finish_reason(out.finish) if out.finish is not None else None
            if reply.tool_format is not None:
                stream = tools.get(i) or tools.setdefault(i, reply.tool_stream())
                text = stream.push(out.text)
                if text:
                    yield sse(reply.chunk(text, None, None, index=i))
                if finish is not None:
                    yield sse(reply.tool_chunk(stream, finish, i))
                continue
            yield sse(reply.chunk(out.text, list(out.token_ids), finish, first=i not in started, index=i,
                                  logprobs=out.logprobs, prompt_logprobs=out.prompt_logprobs))
            started.add(i)
    except SequenceFailed as exc:
        yield sse(_failed(exc).body())
        yield DONE
        return
    if ask.include_usage:
        yield sse(reply.usage_chunk(count))
    yield DONE


async def whole_choices(request: Request, seqs: list[ServedSequence], reply: Reply, n: int,
                        runs: int) -> Response:
    """A non-streamed request with several sequences: every choice once all have ended; with
    best_of (`runs` > n a prompt), the n of each prompt's whose tokens are the most likely (the
    sum of their log probabilities, as vLLM ranks them), renumbered in that order."""

    async def run() -> dict[str, Any]:
        got: dict[int, dict[str, Any]] = {}
        async for i, out in _choices(seqs):
            c = got.setdefault(i, {"text": [], "ids": [], "lps": [], "prompt": None, "finish": "length", "rank": 0.0})
            c["text"].append(out.text)
            c["ids"].extend(out.token_ids)
            c["lps"].extend(out.logprobs or ())
            if out.prompt_logprobs is not None:
                c["prompt"] = out.prompt_logprobs
            if out.finish is not None:
                c["finish"] = finish_reason(out.finish)
                c["rank"] = out.result.cumulative_logprob if out.result is not None else 0.0
        choices, tokens = [], 0
        for p in range(len(seqs) // runs):
            mine = [got.get(p * runs + j) or {"text": [], "ids": [], "lps": [], "prompt": None, "finish": "length",
                                                "rank": 0.0} for j in range(runs)]
            if runs > n:
                mine = sorted(mine, key=lambda c: -c["rank"])[:n]
            for j, c in enumerate(mine):
                tokens += len(c["ids"])
                choices.append(reply.choice("".join(c["text"]), c["ids"], c["finish"], index=p * n + j,
                                            logprobs=c["lps"], prompt_logprobs=c["prompt"]))
        return reply.bodies(choices, tokens)

    return await _answer(request, run, seqs)


async def _answer(request: Request, run: Any, seqs: list[ServedSequence]) -> Response:
    """The JSON body `run()` makes once the request's sequences end; a client that disconnects
    first has them cancelled (and gets nothing: CLIENT_GONE); a sequence that fails is the
    request's error."""

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(run()), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            for seq in seqs:
                seq.close()
    if not work.done() or work.cancelled():
        return Response(status_code=CLIENT_GONE)
    try:
        return JSONResponse(work.result())
    except SequenceFailed as exc:
        return error_response(_failed(exc))


def _failed(exc: SequenceFailed) -> ApiError:
    """A sequence that ended unfinished, as the request's error: 503 when the server shut down
    first, else 500."""
    return ApiError(503 if exc.shutdown else 500, str(exc), code="shutdown" if exc.shutdown else "generation_failed")
