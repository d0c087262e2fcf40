"""The HTTP side: OpenAI's routes on Starlette, over the engine (in a process of its own: aftgen.serve.remote).

GET /health, GET /controls (the sampling fields' ranges and defaults), GET /v1/models, POST /v1/completions,
POST /v1/chat/completions, vLLM's POST /tokenize, POST /detokenize and GET /tokenizer_info (at the root and
under /v1), and GET / (the playground page, unless --no-webui). Every error, ours or
Starlette's (404, 405), is answered in OpenAI's shape. Streams are server-sent events in OpenAI's
chunk format, ending with `data: [DONE]`; a client that goes away stops its generation at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import itertools
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from aftgen.compiled.availability import with_fallbacks
from aftgen.serve import tokenizing
from aftgen.serve.batch import COMPILING
from aftgen.serve.remote import EngineUnavailable
from aftgen.serve.replies import UNREADABLE, Reply, as_json, scores_as_json, scores_writer
from aftgen.serve.schema import APIError, controls_body, parse_request
from aftgen.serve.work import (
    Done,
    EngineClient,
    Event,
    Failed,
    Finished,
    Text,
    Ticket,
    each_choice,
    merged_texts,
    timed_out,
)

# The page may talk to this server only: its own inline script and style, nothing fetched from elsewhere.
PLAYGROUND_POLICY = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src data:"
)
PARSE_ERROR = (
    "We could not parse the JSON body of your request. (HINT: This likely means you aren't using your HTTP library "
    "correctly. The OpenAI API expects a JSON payload, but what was sent was not valid JSON.)"
)


class Gone:
    """The client disconnected before its response began."""


def error_response(error: APIError) -> JSONResponse:
    retry = {"Retry-After": str(error.retry_after)}
    headers = {503: retry, 408: {"Connection": "close"}}.get(error.status)  # 408: the body is unread
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def failure(event: Failed) -> APIError:
    return APIError(event.status, event.message, event.kind, event.param, event.code, event.retry_after)


class Inbox(asyncio.Queue):
    """A request's events, as delivered; `scores`: how its tokens' scores are written (chat's shape or not, and how
    many alternatives a token; scores_as_json), None where it asked for none."""

    def __init__(self, scores: tuple[bool, int] | None):
        super().__init__()
        self.scores = scores


class EventStream(StreamingResponse):
    """Server-sent events whose end, however it comes (done, client gone, error), calls `on_close`."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else as_json(data)}\n\n"


class Server:
    """The routes, bound to one engine and model."""

    def __init__(self, engine: EngineClient, model_name: str):
        self.engine, self.model_name, self.options = engine, model_name, engine.options
        self.created = int(time.time())
        self.inboxes: dict[int, Inbox] = {}  # the requests being answered, by the numbers they were submitted by
        self.numbers = itertools.count(1)

    def app(self) -> Starlette:
        routes = [
            Route("/health", self.health),
            Route("/controls", self.controls),
            Route("/v1/models", self.models),
            Route("/v1/models/{model:path}", self.model),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ]
        for root in ("", "/v1"):  # vLLM serves these at the root, where lm-eval's remote tokenizer looks
            routes += [
                Route(f"{root}/tokenize", self.tokenize, methods=["POST"]),
                Route(f"{root}/detokenize", self.detokenize, methods=["POST"]),
                Route(f"{root}/tokenizer_info", self.tokenizer_info),
            ]
        if self.options.webui:
            routes.append(Route("/", self.playground))
        handlers = {HTTPException: self.http_error, Exception: self.internal_error}
        return Starlette(routes=routes, exception_handlers=handlers, lifespan=self.lifespan)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()

        def deliver(events: list[tuple[Ticket, Event]]) -> None:
            for ticket, event in each_choice(scores_as_json(events, self.engine.tokenizer, self._scores_asked)):
                if event is UNREADABLE:
                    self.engine.cancel(ticket)
                if (inbox := self.inboxes.get(ticket.number)) is not None:  # None: its answer has ended
                    inbox.put_nowait(event)

        self.engine.publish = lambda events: loop.call_soon_threadsafe(deliver, events)
        self.engine.start()
        # the scores' writer (the tokenizer's names made JSON, the native library loaded) made now, not in the event
        # loop as the first request with logprobs is delivered
        await asyncio.to_thread(scores_writer, self.engine.tokenizer)
        try:
            yield
        finally:
            self.engine.stop()

    def _scores_asked(self, ticket: Ticket) -> tuple[bool, int] | None:
        inbox = self.inboxes.get(ticket.number)
        return None if inbox is None else inbox.scores

    async def http_error(self, request: Request, exc: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(APIError(exc.status_code, message, kind))

    async def internal_error(self, request: Request, exc: Exception) -> JSONResponse:
        """A bug: the client gets a 500 in OpenAI's shape; uvicorn logs the traceback."""
        return error_response(APIError(500, f"internal error: {type(exc).__name__}", "server_error"))

    def authorize(self, request: Request) -> None:
        """The key (printable ASCII: ServeOptions.check) is compared with the bytes sent, in constant time."""
        key = self.options.api_key
        if key is None:
            return
        given = next((value for name, value in request.scope["headers"] if name == b"authorization"), b"")
        if not given:
            raise APIError(401, "You didn't provide an API key: send 'Authorization: Bearer KEY'.")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), key.encode("utf-8")):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    async def playground(self, request: Request) -> HTMLResponse:
        """The playground page; it asks for the API key itself, so the page is served without one."""
        page = importlib.resources.files("aftgen.serve").joinpath("playground.html").read_text(encoding="utf-8")
        return HTMLResponse(page, headers={"Content-Security-Policy": PLAYGROUND_POLICY, "Cache-Control": "no-cache"})

    async def health(self, request: Request) -> JSONResponse:
        """Up (200) only while the engine answers and its step is ready, for anyone (a load balancer has no key):
        503 with the reason while not. The model and the engine's figures (its step's among them) need the key."""
        try:
            figures = await self.engine.figures()
        except EngineUnavailable as exc:
            return JSONResponse({"status": str(exc)}, status_code=503, headers={"Retry-After": "1"})
        if figures["step"] == COMPILING:  # requests wait for it meanwhile
            return JSONResponse({"status": "compiling the step"}, status_code=503, headers={"Retry-After": "1"})
        try:
            self.authorize(request)
        except APIError:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "ok", "model": self.model_name} | with_fallbacks(figures))

    async def controls(self, request: Request) -> JSONResponse:
        """The sampling fields' types, ranges and defaults, for anyone (the playground reads them before its key)."""
        return JSONResponse(controls_body(self.options))

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "aftgen"}

    async def models(self, request: Request) -> Response:
        return await self._answer(request, lambda: JSONResponse({"object": "list", "data": [self._model_card()]}))

    async def model(self, request: Request) -> Response:
        def card() -> JSONResponse:
            if request.path_params["model"] != self.model_name:
                message = f"The model '{request.path_params['model']}' does not exist"
                raise APIError(404, message, param="model", code="model_not_found")
            return JSONResponse(self._model_card())

        return await self._answer(request, card)

    async def _answer(self, request: Request, respond: Callable) -> Response:
        """Authorize, then respond; an APIError anywhere becomes its JSON error response."""
        try:
            self.authorize(request)
            result = respond()
            return await result if asyncio.iscoroutine(result) else result
        except APIError as error:
            return error_response(error)
        except ClientDisconnect:  # gone while its body was read: nobody to answer, nothing wrong to log
            return Response(status_code=499)

    async def completions(self, request: Request) -> Response:
        return await self._answer(request, lambda: self._generate(request, chat=False))

    async def chat_completions(self, request: Request) -> Response:
        return await self._answer(request, lambda: self._generate(request, chat=True))

    async def tokenize(self, request: Request) -> Response:
        return await self._answer(request, lambda: self._tokenizer_answer(request, tokenizing.tokenize))

    async def detokenize(self, request: Request) -> Response:
        return await self._answer(request, lambda: self._tokenizer_answer(request, tokenizing.detokenize))

    async def tokenizer_info(self, request: Request) -> Response:
        info = tokenizing.tokenizer_info(self.engine.tokenizer, self.options)
        return await self._answer(request, lambda: JSONResponse(info))

    async def _tokenizer_answer(self, request: Request, answer: Callable) -> JSONResponse:
        """The body checked and answered on a worker thread: a 1 MB prompt takes a while to tokenize."""
        body = await self._body(request)
        return JSONResponse(await asyncio.to_thread(answer, body, self.engine.tokenizer, self.options, self.model_name))

    async def _body(self, request: Request) -> dict:
        """The JSON object in the body, refusing one over the size limit before reading it all.

        Only `Content-Type: application/json` is read: a web page can make a browser send a form or
        text/plain to 127.0.0.1 without asking first (no CORS preflight), but never JSON.
        """
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            given = f"'{media_type}'" if media_type else "none"
            message = f"{request.url.path} takes a JSON body: send 'Content-Type: application/json' (got {given})"
            raise APIError(415, message)
        limit = self.options.max_body_bytes
        too_large = APIError(413, f"the request body is larger than this server's limit of {limit} bytes")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        body, pieces = bytearray(), request.stream()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.read_timeout  # for the whole body: a byte now and then keeps no client
        while True:
            try:
                body += await asyncio.wait_for(anext(pieces), deadline - loop.time())
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                message = f"the request body did not arrive within {self.options.read_timeout:g} s"
                raise APIError(408, message, code="request_timeout") from None
            if len(body) > limit:
                raise too_large
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):  # RecursionError: arrays nested deeper than Python recurses
            raise APIError(400, PARSE_ERROR) from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        return data

    async def _generate(self, request: Request, chat: bool) -> Response:
        body = await self._body(request)
        parsed = parse_request(body, chat, self.options, self.engine.tokenizer, self.model_name)
        scored = parsed.work.logprobs is not None
        number = next(self.numbers)
        inbox = self.inboxes[number] = Inbox((chat, parsed.work.logprobs) if scored else None)
        ticket = self.engine.submit(parsed.work, number)
        expiry = asyncio.get_running_loop().call_later(self.options.timeout, self._expire, ticket, inbox)
        reply = Reply(chat, self.model_name, scored)
        watcher = asyncio.create_task(self._watch(request, ticket, inbox))
        ended = True  # the request: all but a stream that has begun
        try:
            first = await self._until_started(inbox, reply, stop_early=parsed.stream)
            ended = isinstance(first, Gone) or not parsed.stream
        finally:
            watcher.cancel()  # a stream watches for itself (Starlette's StreamingResponse)
            if ended:
                expiry.cancel()
                self.inboxes.pop(number, None)
        if isinstance(first, Gone):
            return Response(status_code=499)  # nobody is listening; nothing to say
        if not parsed.stream:
            return Response(reply.whole(), media_type="application/json")

        def closed() -> None:
            expiry.cancel()
            self.inboxes.pop(number, None)
            self.engine.cancel(ticket)

        return EventStream(self._stream(ticket, inbox, reply, first, parsed.include_usage), on_close=closed)

    def _expire(self, ticket: Ticket, inbox: Inbox) -> None:
        """--timeout has passed and the engine has not ended the request (it is stopped, or stuck in a turn): it
        ends here, with the 504 the engine would have sent."""
        self.engine.cancel(ticket)
        inbox.put_nowait(timed_out(self.options.timeout))

    async def _watch(self, request: Request, ticket: Ticket, inbox: Inbox) -> None:
        """Cancel the ticket when the client disconnects (while no response has begun)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.engine.cancel(ticket)
        inbox.put_nowait(Gone())

    async def _until_started(self, inbox: Inbox, reply: Reply, stop_early: bool) -> Event | Gone:
        """Feed events to `reply` until generation starts (stop_early) or the request is done.

        Returns the event it stopped at; a failure before that raises its APIError.
        """
        while True:
            event = await inbox.get()
            if isinstance(event, Failed):
                raise failure(event)
            if isinstance(event, Gone):
                return event
            reply.take(event)
            if isinstance(event, Done) or (stop_early and reply.started is not None):
                return event

    async def _stream(
        self, ticket: Ticket, inbox: Inbox, reply: Reply, first: Event, include_usage: bool
    ) -> AsyncIterator[str]:
        """OpenAI's chunks from the engine's events; text that piled up meanwhile goes out as one chunk."""
        if reply.chat:
            for index in range(ticket.work.n):
                yield sse(reply.chunk(index, first=True))
        events = [first]
        while True:
            for _, event in merged_texts([(ticket, arrived) for arrived in events]):
                if isinstance(event, Failed):  # an error event, then the stream ends as every stream does
                    yield sse(failure(event).body())
                    yield sse("[DONE]")
                    return
                if isinstance(event, Text):  # sent as it comes: the reply keeps only what the usage counts
                    yield sse(reply.chunk(event.index, event.text, scores=event.scores))
                elif isinstance(event, Done):
                    if include_usage:
                        yield sse(reply.usage_chunk())
                    yield sse("[DONE]")
                    return
                elif isinstance(event, Finished):
                    reply.take(event)
                    yield sse(reply.chunk(event.index, finish=event.reason))
            events = [await inbox.get()]
            while not inbox.empty():
                events.append(inbox.get_nowait())
