"""HTTP/1.1 on an open network: every request arrives whole within a deadline, and connections are bounded.

uvicorn (with h11) cuts nothing but idle keep-alive connections: a client that sends half a request line and
stalls holds its socket for ever, and a few thousand such sockets exhaust the process's descriptors, after which
every real request fails and asyncio logs a traceback per failed accept. So `bounded_protocol` gives uvicorn a
protocol that

- closes a connection whose request has not arrived whole (headers and body) within `request_timeout_s` of the
  connection, or of the end of the previous response on a kept-alive one, with a 408 naming the deadline;
- beyond `max_connections` open ones, takes `health_connections` more for `GET /health` alone (a monitor, a
  user asking whether the server lives, is answered while stalled clients hold every other slot): such a
  connection must send its request within `HEALTH_TIMEOUT_S`, gets a 503 for any other path, and is closed after
  its answer;
- closes a new connection at once, before reading it, beyond those (so descriptors never run out before the limit
  does, and each refusal costs nothing);

and `quiet_accept_errors` turns asyncio's "socket.accept() out of system resource" traceback into one line a
minute. Once a request has arrived whole, the time the app takes to answer is not bounded here (a batch of new
premises may take the encoder a while); the app bounds its own work.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

LOG = logging.getLogger("leanagent.serve")
NOTICE_EVERY_S = 60.0
HEALTH_TIMEOUT_S = 2.0


class _Notices:
    """One log line per kind of trouble per minute, with how many times it happened since the last line."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._count: dict[str, int] = {}

    def note(self, kind: str, line: str) -> None:
        self._count[kind] = self._count.get(kind, 0) + 1
        now = time.monotonic()
        if now - self._last.get(kind, -NOTICE_EVERY_S) >= NOTICE_EVERY_S:
            count, self._count[kind] = self._count[kind], 0
            self._last[kind] = now
            LOG.warning("%s%s", line, f" ({count} times in the last minute)" if count > 1 else "")


NOTICES = _Notices()


class OncePerMinute(logging.Filter):
    """For uvicorn's own per-request warnings (`Invalid HTTP request received.`: a client may send thousands): each
    message once a minute with its count (`NOTICES`), instead of once per request. Errors pass as they are."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        NOTICES.note(f"uvicorn:{record.msg}", f"uvicorn: {record.getMessage()}")
        return False


def _timeout_response(seconds: float) -> bytes:
    body = (b'{"error":"the request did not arrive whole within %d s of the connection (or of the previous '
            b'response); send it at once"}' % round(seconds))
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body))


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request to arrive whole and a cap on open connections
    (see the module docstring); `bounded_protocol` sets the two limits."""

    request_timeout_s: float = 10.0
    max_connections: int = 1024
    health_connections: int = 8

    _refused = False
    _health_only = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        open_now = len(self.server_state.connections)
        if open_now >= self.max_connections + self.health_connections:
            NOTICES.note("connections", f"refused connections beyond the limit of {self.max_connections} open ones "
                                        f"(--max-connections) and {self.health_connections} for GET /health")
            self._refused = True
            transport.abort()
            return
        super().connection_made(transport)  # type: ignore[arg-type]
        if open_now >= self.max_connections:
            NOTICES.note("health-only", f"{self.max_connections} connections open (--max-connections): new ones "
                                        f"are answered GET /health alone")
            self._health_only = True
            self.app = _HealthOnly(self.app)
        self._deadline: asyncio.TimerHandle | None = None
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        seconds = min(self.request_timeout_s, HEALTH_TIMEOUT_S) if self._health_only else self.request_timeout_s
        self._deadline = self.loop.call_later(seconds, self._too_slow)

    def _disarm(self) -> None:
        deadline = getattr(self, "_deadline", None)
        if deadline is not None:
            deadline.cancel()
            self._deadline = None

    def _request_whole(self) -> bool:
        """The current request's headers and body have all arrived (its response may still be on its way)."""
        return self.cycle is not None and not self.cycle.more_body and not self.cycle.response_complete

    def handle_events(self) -> None:
        super().handle_events()
        if self._request_whole():
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request on this connection has its own deadline

    def _too_slow(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or self._request_whole():
            return
        NOTICES.note("slow", f"closed connections whose request did not arrive whole within "
                             f"{self.request_timeout_s:g} s (--request-timeout-s)")
        if self.cycle is None or self.cycle.response_complete:  # nothing of ours on the wire yet
            self.transport.write(_timeout_response(self.request_timeout_s))
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:  # never counted as a connection, nothing of it was set up
            return
        self._disarm()
        super().connection_lost(exc)


class _HealthOnly:
    """ASGI, for a connection beyond --max-connections: `GET /health` (after a token, when there is one) passes,
    closing the connection after its answer; anything else is a 503 to retry later."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        async def closing(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        parts = scope.get("path", "").strip("/").split("/")
        if scope.get("type") == "http" and parts[-1] == "health" and len(parts) <= 2:
            await self.app(scope, receive, closing)
            return
        body = (b'{"error":"the server holds as many connections as it takes (--max-connections); on this one it '
                b'answers GET /health alone: retry in a moment"}')
        await closing({"type": "http.response.start", "status": 503,
                       "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                                   (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def bounded_protocol(request_timeout_s: float, max_connections: int,
                     health_connections: int = 0) -> type[BoundedH11Protocol]:
    """The protocol class uvicorn takes as `http=`, with these limits."""
    return type("BoundedH11Protocol", (BoundedH11Protocol,),
                {"request_timeout_s": float(request_timeout_s), "max_connections": int(max_connections),
                 "health_connections": int(health_connections)})


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Out of descriptors, asyncio logs a traceback at every retry of accept(); one line a minute instead."""
    default = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", ""))
        if "out of system resource" in message:
            exc = context.get("exception")
            NOTICES.note("accept", f"cannot accept connections: {exc or message} (too many open files: lower "
                                   f"--max-connections, or raise the process's descriptor limit)")
            return
        if default is not None:
            default(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
