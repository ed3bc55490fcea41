"""The HTTP app: Lean's premise-selection endpoints over a `PremiseServer`, every refusal one JSON line.

Why errors look as they do: see the package docstring (the client shows any body that is not a result array).
"""

from __future__ import annotations

import json
import logging
from contextlib import nullcontext
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from leanagent.config import format_validation_error
from leanagent.index import PremiseIndex
from leanagent.serve.schemas import RequestError, RetrieveRequest, ServeLimits
from leanagent.serve.server import PremiseServer

LOG = logging.getLogger("leanagent.serve")
ENDPOINTS = "GET /indexed-modules, GET /indexed-premises, GET /max-new-premises, POST /retrieve, GET /health"


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": " ".join(message.split())}, status_code=status)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused as soon as it passes `limit` bytes (declared or streamed), so a huge one is never held."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"body of {int(declared):,} bytes, more than this server's {limit:,}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"body of more than {limit:,} bytes, this server's limit")
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(body: bytes) -> RetrieveRequest:
    try:
        payload = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise RequestError(400, f"body is not UTF-8 JSON (byte {exc.start} cannot be decoded)") from None
    except json.JSONDecodeError as exc:
        raise RequestError(400, f"body is not JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    if not isinstance(payload, dict):
        raise RequestError(422, f"body must be a JSON object with a state, found a JSON {type(payload).__name__}")
    try:
        return RetrieveRequest.model_validate(payload)
    except ValidationError as exc:
        raise RequestError(422, format_validation_error(exc)) from None


def create_app(index: PremiseIndex | PremiseServer, limits: ServeLimits | None = None) -> FastAPI:
    """The premise-selection API over a loaded index (see the package docstring); run it with uvicorn or mount it.

    No route declares a parameter for FastAPI to validate: `/retrieve` reads and checks its body itself
    (`_read_body`, `_parse`), so that a body is refused at its size limit and every refusal has one shape."""
    server = index if isinstance(index, PremiseServer) else PremiseServer(index, limits)
    app = FastAPI(title="leanagent premise selection", docs_url=None, redoc_url=None,
                  description=f"Lean's premise-selection protocol over {server.index.folder}")
    app.state.premise_server = server

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError) -> JSONResponse:
        return _error(exc.status, exc.message)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}; this server answers "
                                       f"{ENDPOINTS}")

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> JSONResponse:
        LOG.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        first = str(exc).splitlines()[0] if str(exc) else ""
        return _error(500, f"internal error ({type(exc).__name__}{': ' + first if first else ''}); the server's "
                           f"log has the traceback")

    @app.get("/indexed-modules")
    def indexed_modules() -> Response:
        return Response(server.indexed_modules_json, media_type="application/json")

    @app.get("/indexed-premises")
    def indexed_premises() -> Response:
        return Response(server.indexed_premises_json, media_type="application/json")

    @app.get("/max-new-premises")
    def max_new_premises() -> int:
        return server.limits.max_new_premises

    @app.get("/health")
    def health() -> dict[str, Any]:
        return server.health()

    @app.post("/retrieve")
    async def retrieve(request: Request) -> JSONResponse:
        # Batched, a pass waits a moment for a request on its way: counted from before its body is read.
        with server.batcher.arriving() if server.batcher is not None else nullcontext() as arrival:
            body = await _read_body(request, server.limits.max_body_bytes)
            return JSONResponse(await run_in_threadpool(server.retrieve, _parse(body), arrival))

    return app
