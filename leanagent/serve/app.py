"""The HTTP app: Lean's premise-selection endpoints over a `PremiseServer`, every refusal one JSON line.

Why errors look as they do: see the package docstring (the client shows any body that is not a result array).
A request is answered by the server current when it starts (`ServerHolder.using`), to its end: a server that
follows a run swaps in a newer stage between requests, never inside one. Bodies are decoded off the event loop,
under the limits (`parse.py`). With an access token every path starts with it (`TokenGate`), the one way Lean's
client, which is given only `premiseSelection.apiBaseUrl`, can carry one. No response names a path of this
machine, and the OpenAPI schema is served only when asked for.
"""

from __future__ import annotations

import hmac
import json
import logging
from contextlib import nullcontext
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from leanagent.index.query import PremiseIndex
from leanagent.serve.follow import ServerHolder
from leanagent.serve.parse import excerpt, parse_request
from leanagent.serve.schemas import RequestError, ServeLimits
from leanagent.serve.server import PremiseServer

LOG = logging.getLogger("leanagent.serve")
ENDPOINTS = "GET /indexed-modules, GET /indexed-premises, GET /max-new-premises, POST /retrieve, GET /health"
MAX_ERROR_CHARS = 500


def _error(status: int, message: str) -> JSONResponse:
    message = " ".join(message.split())
    if len(message) > MAX_ERROR_CHARS:
        message = message[: MAX_ERROR_CHARS - 3] + "..."
    return JSONResponse({"error": message}, status_code=status)


async def _read_body(request: Request, limit: int) -> list[bytes]:
    """The body's chunks, refused as soon as they pass `limit` bytes (declared or streamed), so a huge one is never
    held; joined and decoded in a worker thread, not here on the event loop."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"body of {int(declared):,} bytes, more than this server's {limit:,}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"body of more than {limit:,} bytes, this server's limit")
        chunks.append(chunk)
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
               token: str | None = None, openapi: bool = False) -> Any:
    """The premise-selection API (see the package docstring) over an index, a server, or a holder whose server may
    be swapped (`leanagent.serve.follow`); run it with uvicorn or mount it. `token`: paths start with it.
    `openapi`: serve /openapi.json (the schema of the endpoints).

    No route declares a parameter for FastAPI to validate: `/retrieve` reads and checks its body itself
    (`_read_body`, `parse_request`), so that a body is refused at its size limit and every refusal has one shape."""
    if isinstance(source, ServerHolder):
        holder = source
    else:
        holder = ServerHolder(source if isinstance(source, PremiseServer) else PremiseServer(source, limits))
    app = FastAPI(title="leanagent premise selection", docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json" if openapi else None,
                  description="Lean's premise-selection protocol (premiseSelection.apiBaseUrl)")
    app.state.holder = holder

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError) -> JSONResponse:
        return _error(exc.status, exc.message)

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
    def health() -> dict[str, Any]:
        with holder.using() as server:
            return server.health()

    @app.post("/retrieve")
    async def retrieve(request: Request) -> Response:
        with holder.using() as server:
            # Batched, a pass waits a moment for a request on its way: counted from before its body is read.
            with server.batcher.arriving() if server.batcher is not None else nullcontext() as arrival:
                chunks = await _read_body(request, server.limits.max_body_bytes)

                def answer() -> bytes:
                    ranked = server.retrieve(parse_request(b"".join(chunks), server.limits), arrival)
                    # Scores come from unit vectors: finite, or a 500 rather than invalid JSON.
                    return json.dumps(ranked, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()

                body = await run_in_threadpool(answer)
                holder.answered()
                return Response(body, media_type="application/json")

    return TokenGate(app, token) if token else app
