"""The starlette application and `serve` (uvicorn): routes, streaming, errors, request logs.

Every error leaves as OpenAI's {"error": {...}} object. A request waits for its job's
first event before answering, so a bad prompt (too long for the context) is a 400, not a
broken stream. While it waits, and while it streams, the client's connection is watched:
a client that goes away cancels its job, which frees the worker for the next request.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable, Optional

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .engine import Engine, Event, Job, QueueFull
from .protocol import (
    ApiError,
    GenerationRequest,
    ResponseShape,
    Usage,
    parse_chat_request,
    parse_completion_request,
    parse_json_object,
    sse,
)

DISCONNECT_POLL_S = 0.1  # how often a waiting request checks that its client is still there
MAX_BODY_BYTES = 8 << 20  # far more than any context holds; a bigger body is refused, not held
# A refused body is still read (and dropped) up to this many bytes before the 413 goes out:
# closing a socket with unread bytes in it makes the kernel send a reset, and the client then
# sees "connection reset" instead of our error. Past this, we stop reading and close.
MAX_DRAINED_BYTES = 64 << 20


async def read_body(request: Request) -> bytes:
    """The request body, refused (413) once it passes MAX_BODY_BYTES rather than held whole."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_DRAINED_BYTES:
            break
        if size <= MAX_BODY_BYTES:
            chunks.append(chunk)
    if size > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="request_too_large")
    return b"".join(chunks)


class ClientGone(Exception):
    pass


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


@dataclass
class RequestLog:
    """Timings of one generation request, printed as one line on stderr when it ends."""

    path: str
    stream: bool
    start: float  # the request arrived
    started: float = 0.0  # the worker took it (after waiting in the queue)
    first_token: float = 0.0
    end: float = 0.0
    usage: Optional[Usage] = None
    outcome: str = ""

    def line(self) -> str:
        head = f"execupy serve: POST {self.path} {'stream' if self.stream else 'whole'} {self.outcome}"
        if self.usage is None:  # refused before generating
            return f"{head} | {self.end - self.start:.3f}s"
        u = self.usage
        queued = f"queued {self.started - self.start:.3f}s" if self.started else "not started"
        ttft = f"first token {self.first_token - self.start:.3f}s" if self.first_token else "no token"
        decode = self.end - self.first_token if self.first_token else 0.0
        rate = f"{(u.completion_tokens - 1) / decode:.1f} tok/s" if decode > 0 and u.completion_tokens > 1 else "-"
        return (f"{head} | prompt {u.prompt_tokens} tokens ({u.cached_tokens} cached) | completion "
                f"{u.completion_tokens} tokens | {queued} | {ttft} | {rate} | {self.end - self.start:.3f}s")

    def done(self, outcome: str) -> None:
        self.end, self.outcome = time.perf_counter(), outcome
        print(self.line(), file=sys.stderr, flush=True)


async def next_event(job: Job, request: Request) -> Event:
    """The job's next event; ClientGone (and the job cancelled) if the client disconnects first.

    The client is checked every DISCONNECT_POLL_S whether or not events are flowing: a fast
    model can fill the queue faster than the poll, and a gone client must stop it all the same."""
    while True:
        now = time.monotonic()
        if now - job.client_checked >= DISCONNECT_POLL_S:
            job.client_checked = now
            if await request.is_disconnected():
                job.cancel()
                raise ClientGone
        try:
            return await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            pass


def build_app(engine: Engine) -> Starlette:
    model = engine.model_name

    def check_model(req: GenerationRequest) -> None:
        if req.model is not None and req.model != model:
            raise ApiError(404, f"the model {req.model!r} does not exist; this server serves {model!r}",
                           param="model", code="model_not_found")

    async def generate(request: Request, parse: Callable[[dict], GenerationRequest]) -> Response:
        log = RequestLog(request.url.path, False, time.perf_counter())
        try:
            req = parse(parse_json_object(await read_body(request)))
            log.stream = req.stream
            check_model(req)
            job = Job(req, asyncio.get_running_loop())
            try:
                engine.submit(job)
            except QueueFull:
                raise ApiError(503, f"the server is busy: {engine.waiting()} requests are waiting already; "
                               "retry later", type="server_error", code="queue_full") from None
            first = await next_event(job, request)
            if first.kind == "error":
                raise first.error
        except ApiError as e:
            log.done(f"{e.status} {e.code or e.type}")
            return error_response(e)
        except ClientGone:
            log.done("client left while queued")
            return Response(status_code=499)
        log.usage, log.started = first.usage, time.perf_counter()
        shape = ResponseShape(req.kind, model)
        if req.stream:
            return StreamingResponse(stream_events(job, request, shape, log), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await whole_response(job, request, shape, log)

    async def whole_response(job: Job, request: Request, shape: ResponseShape, log: RequestLog) -> Response:
        parts = []
        try:
            while True:
                event = await next_event(job, request)
                if event.kind == "text":
                    log.first_token = log.first_token or time.perf_counter()
                    parts.append(event.text)
                elif event.kind == "error":
                    log.done(f"{event.error.status} {event.error.code or event.error.type}")
                    return error_response(event.error)
                elif event.kind == "done":
                    log.usage = event.usage
                    log.done(f"200 {event.finish_reason}")
                    return JSONResponse(shape.whole("".join(parts), event.finish_reason, event.usage))
        except ClientGone:
            log.done("client left, generation cancelled")
            return Response(status_code=499)

    async def stream_events(job: Job, request: Request, shape: ResponseShape, log: RequestLog) -> AsyncIterator[bytes]:
        outcome = "client left, generation cancelled"
        try:
            yield sse(shape.chunk("" if shape.kind == "chat" else None, first=True))
            while True:
                event = await next_event(job, request)
                if event.kind == "text":
                    log.first_token = log.first_token or time.perf_counter()
                    yield sse(shape.chunk(event.text))
                elif event.kind == "error":  # after the headers: the error goes in the stream
                    outcome = f"{event.error.status} in stream"
                    yield sse(event.error.body())
                    yield sse("[DONE]")
                    return
                elif event.kind == "done":
                    log.usage = event.usage
                    outcome = f"200 {event.finish_reason}"
                    yield sse(shape.chunk(None, event.finish_reason, event.usage))
                    if job.request.include_usage:
                        yield sse(shape.usage_chunk(event.usage))
                    yield sse("[DONE]")
                    return
        except ClientGone:
            pass
        finally:
            if outcome.startswith("client left"):
                job.cancel()  # also when starlette closes this generator on a disconnect
            log.done(outcome)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, parse_chat_request)

    async def completions(request: Request) -> Response:
        return await generate(request, parse_completion_request)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": model, "object": "model", "created": engine.created, "owned_by": "execupy",
             "context_length": engine.context_length}]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": model, "busy": engine.busy, "waiting": engine.waiting()})

    async def http_error(request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                       code=code))

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})


def serve(args: argparse.Namespace) -> int:
    """Load the model, then serve until interrupted (the `execupy serve` command)."""
    from execupy.errors import InvalidInputError
    from execupy.llm.runner import LLMRunner

    if args.queue_size < 1:
        raise InvalidInputError(f"--queue-size must be at least 1, got {args.queue_size}")
    if args.max_tokens < 1:
        raise InvalidInputError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    runner = LLMRunner(args.model, args.tokenizer)
    name = args.model_name or Path(args.model).stem
    engine = Engine(runner, name, queue_size=args.queue_size, default_max_tokens=args.max_tokens)
    print(f"execupy serve: {name} loaded in {runner.load_s:.2f} s (context {engine.context_length} tokens); "
          f"listening on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    uvicorn.run(build_app(engine), host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0
