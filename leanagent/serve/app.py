"""The HTTP app: Lean's premise-selection endpoints over a `PremiseServer`, every refusal one JSON line.

Why errors look as they do: see the package docstring (the client shows any body that is not a result array).
A request is answered by the server current when it starts (`ServerHolder.using`), to its end: a server that
follows a run swaps in a newer stage between requests, never inside one. With an access token every path starts
with it (`TokenGate`), the one way Lean's client, which is given only `premiseSelection.apiBaseUrl`, can carry
one. No response names a path of this machine, and the OpenAPI schema is served only when asked for.

What a request may cost, and who waits:

- a body's bytes are reserved in one budget for all requests (`BodyBudget`, `bodies_mb`) as they arrive (a declared
  length reserves nothing: sockets that promise bodies and send nothing hold nothing), and its decoded size once it
  is counted; a request that does not fit is a 503 with Retry-After, so a crowd of large bodies costs at most the
  budget, never the machine's memory;
- bodies are decoded off the event loop, at most `parse_slots` at once (the rest wait on the loop, holding no
  thread): the event loop stays free for `GET /health`, which is answered on it, without a thread;
- a client that hangs up mid-body is one short line a minute in the log (`NOTICES`), never a traceback;
- at a stop (`Stop`), requests running are answered for a while, then each one left is a 503 and the encoder drops
  its work, so none is cut off by the end of uvicorn's graceful window (a 500 and a traceback each).
"""

from __future__ import annotations

import asyncio
import ctypes
import hmac
import json
import logging
import os
import threading
from collections.abc import Callable, Coroutine
from contextlib import nullcontext, suppress
from typing import Any

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from leanagent.index.query import PremiseIndex
from leanagent.serve.follow import ServerHolder, trim_heap
from leanagent.serve.parse import excerpt, parse_request
from leanagent.serve.protocol import NOTICES
from leanagent.serve.schemas import RequestError, ServeLimits, ServerStopping
from leanagent.serve.server import PremiseServer

LOG = logging.getLogger("leanagent.serve")
ENDPOINTS = "GET /indexed-modules, GET /indexed-premises, GET /max-new-premises, POST /retrieve, GET /health"
MAX_ERROR_CHARS = 500
RETRY_AFTER_S = 1
BYTES_PER_BODY_BYTE = 4  # the chunks, their join, the decoded text, the text without its strings (when counted)
BYTES_PER_VALUE = 64  # a decoded JSON value: its object and its slot in a list or dict
TRIM_AFTER_BYTES = 32 << 20  # requests that held this much give the allocator's free pages back when done


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 256 << 10


def returnable_large_allocations() -> None:
    """Large allocations (a body, its decoded text, a list of a million positions) from their own pages, handed
    back to the system when freed: glibc's default raises the threshold to the largest block freed so far (up to
    32 MB), after which such blocks come from the heap and its resident size stays at the burst's peak."""
    try:
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    except (OSError, AttributeError):  # not glibc: its allocator decides
        pass


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    message = " ".join(message.split())
    if len(message) > MAX_ERROR_CHARS:
        message = message[: MAX_ERROR_CHARS - 3] + "..."
    return JSONResponse({"error": message}, status_code=status, headers=headers)


class Busy(RequestError):
    """Over a budget shared by all requests: a 503, to be retried."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message)


class ClientGone(Exception):
    """The client hung up before its request was read whole: nobody to answer."""


class BodyBudget:
    """Bytes that request bodies hold across all requests at once, taken as they arrive and given back when each
    request ends. When the last request that held a large share ends, the C allocator is told to give its free
    pages back (`trim_heap`), so the resident memory returns near its baseline after a burst."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = self.peak = 0
        self._lock = threading.Lock()
        self._since_trim = 0

    def take(self, n: int, what: str, own: int = 0) -> None:
        """Reserve `n` more bytes for a request that holds `own` already: a 503 while others hold too much, a 413
        when the request alone could never fit."""
        with self._lock:
            self._fits(n, what, own)
            self.used += n
            self.peak = max(self.peak, self.used)
            self._since_trim += n

    def check(self, n: int, what: str) -> None:
        """Whether `n` more bytes would fit now (a 503 or a 413 as `take` gives), reserving nothing: a declared body
        is refused before its bytes are read when they could not be held, but only bytes that arrived hold the
        budget (16 sockets that declared 16 MiB each and sent nothing held the 256 MB of every other request)."""
        with self._lock:
            self._fits(n, what, 0)

    def _fits(self, n: int, what: str, own: int) -> None:
        if own + n > self.capacity:
            raise RequestError(413, f"{what} needs {(own + n) / 2**20:,.1f} MB for request bodies, more than this "
                                    f"server's --bodies-mb {self.capacity / 2**20:,.0f} holds for all requests "
                                    f"together; send less, or restart the server with a larger --bodies-mb")
        if self.used + n > self.capacity:
            raise Busy(f"the server holds {self.used / 2**20:,.0f} MB of request bodies, near its --bodies-mb "
                       f"{self.capacity / 2**20:,.0f}; {what} must wait: retry in a moment")

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n
            trim = not self.used and self._since_trim >= TRIM_AFTER_BYTES
            if trim:
                self._since_trim = 0
        if trim:  # bodies are freed as their last reference goes: no garbage collection needed, only the trim
            trim_heap()


class _Held:
    """What one request has taken of the budget, given back once, whatever ends it. Nothing is taken after that (a
    decoding thread left to end on its own at a stop)."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.bytes = 0
        self._lock = threading.Lock()
        self._released = False

    def take(self, n: int, what: str) -> None:
        with self._lock:
            if self._released:
                raise ServerStopping()
            self.budget.take(n, what, self.bytes)
            self.bytes += n

    def release(self) -> None:
        with self._lock:
            self._released = True
            n, self.bytes = self.bytes, 0
        self.budget.give(n)


class Stop:
    """A server's stop, as its requests see it. `begin(within_s)` (on the server's event loop, when uvicorn's graceful
    shutdown starts): requests running go on for `within_s`; then each one still running is answered 503
    (`ServerStopping`) and what `when_over` was given runs (`ServerHolder.abort`: the encoder drops its work), so that
    nothing is left for uvicorn to cancel when its own, longer window ends."""

    def __init__(self) -> None:
        self.begun = False
        self._over: asyncio.Event | None = None
        self._then: list[Callable[[], None]] = []

    def when_over(self, then: Callable[[], None]) -> None:
        self._then.append(then)

    def _event(self) -> asyncio.Event:  # made on the server's loop, when first asked for
        if self._over is None:
            self._over = asyncio.Event()
        return self._over

    def begin(self, within_s: float) -> None:
        if not self.begun:
            self.begun = True
            asyncio.get_running_loop().call_later(within_s, self._end)

    def _end(self) -> None:
        self._event().set()
        for then in self._then:
            then()

    async def race(self, work: Coroutine[Any, Any, Any]) -> Any:
        """`work`'s result, or ServerStopping once the stop's time is over; `work` is then cancelled (the threads it
        waits for are left to end on their own, which `ServerHolder.abort` makes quick)."""
        over = self._event()
        task = asyncio.ensure_future(work)
        waiter = asyncio.ensure_future(over.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            if not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=1.0)  # its own clean-up (the body's budget given back)
        if task.done() and not task.cancelled():
            return task.result()  # answered (or refused) before the stop's time was over, or just as it was
        raise ServerStopping()


class _StopGuard:
    """ASGI, outermost: a request that uvicorn cancels at the end of its graceful window (`Stop` leaves none, but a
    stop of its own, a second Ctrl-C, may) is answered 503 when nothing was sent yet, and ends without a traceback:
    uvicorn logs every exception an app raises, with its traceback, and answers it with a 500."""

    def __init__(self, app: Any, stop: Stop) -> None:
        self.app = app
        self.stop = stop

    def __getattr__(self, name: str) -> Any:  # the app's own attributes (FastAPI's `state`)
        return getattr(self.app, name)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:
            if not self.stop.begun:
                raise
            if not started:
                with suppress(Exception):
                    await _error(503, ServerStopping().message, {"Retry-After": str(RETRY_AFTER_S)})(
                        scope, receive, send)


async def _in_thread(work: Callable[[], Any]) -> Any:
    """`work()` in a worker thread; if the request is cancelled meanwhile (a stop), the thread is left to end on its
    own rather than waited for."""
    return await anyio.to_thread.run_sync(work, abandon_on_cancel=True)


async def _read_body(request: Request, limit: int, held: _Held) -> list[bytes]:
    """The body's chunks, refused as soon as they pass `limit` bytes (declared or streamed), so a huge one is never
    held, each chunk taken from the shared budget as it arrives; joined and decoded in a worker thread. A declared
    length that does not fit what others hold now is refused before a byte is read, but reserves nothing: a body
    holds the budget with the bytes it sent, never with the bytes it promised."""
    declared = request.headers.get("content-length")
    promised = int(declared) if declared is not None and declared.isdigit() else 0
    if promised > limit:
        raise RequestError(413, f"body of {promised:,} bytes, more than this server's {limit:,}")
    held.budget.check(promised, "this body")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestError(413, f"body of more than {limit:,} bytes, this server's limit")
            held.take(len(chunk), "this body")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    return chunks


class TokenGate:
    """ASGI: every path must start with `/TOKEN`, which is taken off before the app routes it; any other path is a
    404 that says how the URL is made, without the token. Compared in constant time."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self.token = token.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        first, _, rest = scope["path"].lstrip("/").partition("/")
        if not hmac.compare_digest(first.encode(), self.token):
            await _error(404, "unknown path: this server wants its access token as the first part of every path, "
                              "as in set_option premiseSelection.apiBaseUrl \"http://HOST:PORT/TOKEN\"")(
                scope, receive, send)
            return
        raw = scope.get("raw_path") or scope["path"].encode()
        inner = {**scope, "path": "/" + rest, "raw_path": raw[len(first) + 1:] or b"/"}
        await self.app(inner, receive, send)


def create_app(source: PremiseIndex | PremiseServer | ServerHolder, limits: ServeLimits | None = None,
               token: str | None = None, openapi: bool = False, stop: Stop | None = None) -> Any:
    """The premise-selection API (see the package docstring) over an index, a server, or a holder whose server may
    be swapped (`leanagent.serve.follow`); run it with uvicorn or mount it. `token`: paths start with it.
    `openapi`: serve /openapi.json (the schema of the endpoints). `stop`: begun when the server is told to stop
    (`leanagent serve` begins it as uvicorn's graceful shutdown starts); requests still running when its time is
    over get a 503.

    No route declares a parameter for FastAPI to validate: `/retrieve` reads and checks its body itself
    (`_read_body`, `parse_request`), so that a body is refused at its size limit and every refusal has one shape."""
    if isinstance(source, ServerHolder):
        holder = source
    else:
        holder = ServerHolder(source if isinstance(source, PremiseServer) else PremiseServer(source, limits))
    limits = holder.current.limits
    app = FastAPI(title="leanagent premise selection", docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json" if openapi else None,
                  description="Lean's premise-selection protocol (premiseSelection.apiBaseUrl)")
    app.state.holder = holder
    stop = stop or Stop()
    stop.when_over(holder.abort)
    budget = app.state.bodies = BodyBudget(int(limits.bodies_mb * 2**20))
    # Decoding is Python work under the GIL: a few at once keep the cores busy; more would only slow the event
    # loop's turn (and /health's) without answering anyone sooner.
    slots: list[asyncio.Semaphore] = []

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 503 else None
        return _error(exc.status, exc.message, headers)

    @app.exception_handler(ClientGone)
    async def gone(request: Request, exc: ClientGone) -> Response:
        NOTICES.note("gone", "clients hung up before their request arrived whole")
        return Response(status_code=400)  # to nobody: the connection is closed

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, f"{request.method} {excerpt(request.url.path)}: {exc.detail}; this server "
                                       f"answers {ENDPOINTS}")

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> JSONResponse:
        LOG.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return _error(500, f"internal error ({type(exc).__name__}); the server's log has the details")

    @app.get("/indexed-modules")
    def indexed_modules() -> Response:
        with holder.using() as server:
            return Response(server.indexed_modules_json, media_type="application/json")

    @app.get("/indexed-premises")
    def indexed_premises() -> Response:
        with holder.using() as server:
            return Response(server.indexed_premises_json, media_type="application/json")

    @app.get("/max-new-premises")
    def max_new_premises() -> int:
        with holder.using() as server:
            return server.limits.max_new_premises

    @app.get("/health")
    async def health() -> dict[str, Any]:  # on the event loop: answered while every worker thread is busy
        with holder.using() as server:
            return {**server.health(), "bodies_mb": round(budget.used / 2**20, 1)}

    @app.post("/retrieve")
    async def retrieve(request: Request) -> Response:
        return await stop.race(_retrieve(request))

    async def _retrieve(request: Request) -> Response:
        if not slots:
            slots.append(asyncio.Semaphore(max(2, os.cpu_count() or 2)))
        held = _Held(budget)
        parsed = None
        try:
            with holder.using() as server:
                # Batched, a pass waits a moment for a request on its way: counted from before its body is read.
                with server.batcher.arriving() if server.batcher is not None else nullcontext() as arrival:
                    chunks = await _read_body(request, server.limits.max_body_bytes, held)

                    def parse() -> Any:
                        body = b"".join(chunks)
                        chunks.clear()

                        def decoding(size: int, values: int) -> None:  # counted, before anything is decoded
                            held.take((BYTES_PER_BODY_BYTE - 1) * size + BYTES_PER_VALUE * values, "decoding this body")

                        return parse_request(body, server.limits, decoding)

                    async with slots[0]:
                        parsed = await _in_thread(parse)

                    def answer() -> bytes:
                        ranked = server.retrieve(parsed, arrival)
                        # Scores come from unit vectors: finite, or a 500 rather than invalid JSON.
                        return json.dumps(ranked, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()

                    body = await _in_thread(answer)
                    holder.answered()
                    return Response(body, media_type="application/json")
        finally:
            parsed = None  # the decoded body goes before its bytes are given back (and memory trimmed)
            held.release()

    return _StopGuard(TokenGate(app, token) if token else app, stop)
