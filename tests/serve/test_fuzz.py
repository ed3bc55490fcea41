"""`POST /retrieve` fuzzed, as the trusted servers are: whatever body arrives (any JSON value, a request object with
any values in its fields, any bytes up to past the body limit), a real server on 127.0.0.1 answers a 2xx or a 4xx
with one line, never a 500, and its memory stays bounded. And the first segment of a path, where the token goes,
in any spelling (percent-encoded, cut short, mistyped): no log line holds the token or most of it. Reproducible:
derandomized, bounded examples."""

from __future__ import annotations

import json
import logging
import resource
import socket
from urllib.parse import unquote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from uvicorn.logging import AccessFormatter

from leanagent.serve import ServeLimits, create_app
from leanagent.serve.access import REDACTED, WRONG
from leanagent.serve.process import quiet_logs

from .conftest import STATE, LiveServer

LIMITS = ServeLimits(max_body_bytes=8192, max_new_premises=8, max_positions=256, max_name_chars=64,
                     max_decl_chars=2000, max_state_chars=4000, max_k=50)
FUZZ = settings(max_examples=200, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner,
                                                                                max_size=5), max_leaves=20)
NAMES = st.sampled_from(["RepoA.glend_zero", "Core.Basic", "«a b».c", "x", "", "RepoA.Main"])
POSITION = st.one_of(st.integers(-3, 60), st.integers(), NAMES, JSON)
NEW = st.one_of(st.fixed_dictionaries({"name": st.one_of(NAMES, st.text(max_size=70)),
                                       "decl": st.text(max_size=300)}), JSON)
REQUEST = st.fixed_dictionaries({}, optional={
    "state": st.one_of(st.just(STATE), st.text(max_size=200), JSON),
    "local_premises": st.one_of(st.lists(POSITION, max_size=20), JSON),
    "imported_modules": st.one_of(st.lists(POSITION, max_size=8), JSON),
    "imported_all_modules": st.one_of(st.lists(POSITION, max_size=8), JSON),
    "new_premises": st.one_of(st.lists(NEW, max_size=10), JSON),
    "k": st.one_of(st.integers(-5, 100), st.integers(), JSON),
    "caller_in_module_system": st.one_of(st.booleans(), JSON),
})


@pytest.fixture(scope="module")
def server(built):
    with LiveServer(create_app(built["index"], LIMITS)) as live, httpx.Client(timeout=120) as http:
        yield live.url, http


def _answered(server, body: bytes) -> None:
    url, http = server
    answer = http.post(f"{url}/retrieve", content=body, headers={"Content-Type": "application/json"})
    assert answer.status_code < 500, (answer.status_code, answer.text, body[:200])
    if answer.status_code == 200:
        hits = answer.json()
        assert isinstance(hits, list) and all(set(h) == {"name", "score"} for h in hits)
    else:
        error = answer.json()["error"]
        assert isinstance(error, str) and "\n" not in error and len(error) <= 500


def _peak_kb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


@FUZZ
@given(st.one_of(REQUEST, JSON))
def test_any_json_gets_a_2xx_or_a_4xx(server, value) -> None:
    before = _peak_kb()
    _answered(server, json.dumps(value).encode())
    assert _peak_kb() - before < 256 * 1024  # kB: no request of these sizes grows the process by 256 MB


@FUZZ
@given(st.binary(max_size=LIMITS.max_body_bytes + 100))
def test_any_bytes_get_a_4xx(server, body) -> None:
    url, http = server
    answer = http.post(f"{url}/retrieve", content=body)
    assert 400 <= answer.status_code < 500 or (answer.status_code == 200 and body.strip().startswith(b"{")), \
        (answer.status_code, answer.text, body[:100])


TOKEN = "Zq3-vX9_kL2.mN8~pR4tY7wB1cD5fG6h"  # 32 characters of every kind a token may hold
HEX = st.sampled_from("0123456789abcdefABCDEF")
URL_CHAR = st.one_of(st.sampled_from("abcXYZ019-._~!$&'()*+,;=:@"), st.builds(lambda a, b: f"%{a}{b}", HEX, HEX))


@st.composite
def _spelled(draw, text: str) -> str:
    """`text` with any of its characters percent-encoded, in either case of hex digit."""
    out = []
    for c in text:
        encoded = "".join(f"%{b:02X}" for b in c.encode())
        out.append(draw(st.sampled_from([c, encoded, encoded.lower()])))
    return "".join(out)


def _mistyped(draw, text: str) -> str:
    i = draw(st.integers(0, len(text) - 1))
    return text[:i] + draw(st.sampled_from("aZ0-")) + text[i + 1:]


FIRST_SEGMENT = st.one_of(
    _spelled(TOKEN),  # the token, percent-encoded anywhere
    st.integers(1, len(TOKEN) - 1).flatmap(lambda n: _spelled(TOKEN[:-n])),  # cut short
    st.integers(1, len(TOKEN) - 1).flatmap(lambda n: _spelled(TOKEN[n:])),  # its end
    st.lists(URL_CHAR, min_size=1, max_size=4).map("".join).map(lambda extra: TOKEN + extra),  # more after it
    st.composite(lambda draw: _mistyped(draw, TOKEN))(),
    st.lists(URL_CHAR, max_size=40).map("".join),  # anything
)


class _Lines(logging.Handler):
    """The access lines as `leanagent serve --access-log` prints them: uvicorn's own formatter, which reads the
    record's arguments by position."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.setFormatter(AccessFormatter('%(client_addr)s - "%(request_line)s" %(status_code)s', use_colors=False))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture(scope="module")
def token_server(built):
    lines = _Lines()
    access = logging.getLogger("uvicorn.access")
    access.addHandler(lines)
    access.setLevel(logging.INFO)
    try:
        with quiet_logs(TOKEN), LiveServer(create_app(built["index"], LIMITS, token=TOKEN), access_log=True) as live:
            yield live.url, lines
    finally:
        access.removeHandler(lines)


def _get(url: str, target: str) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=120) as conn:
        conn.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    return data


@FUZZ
@given(FIRST_SEGMENT, st.sampled_from(["/health", "/indexed-modules", "/nowhere", "", "/health?x=1"]))
def test_no_spelling_of_the_token_reaches_the_log(token_server, first, rest) -> None:
    """A percent-encoded token was accepted and logged as sent; one missing its last character was logged in clear
    (31 of its 32 characters). The segment where the token goes is replaced whatever it holds."""
    url, lines = token_server
    before = len(lines.lines)
    reply = _get(url, f"/{first}{rest}")
    assert reply.startswith(b"HTTP/1.1 "), reply[:100]
    new = lines.lines[before:]
    assert len(new) == 1, new  # the request's access line
    line = new[0]
    decoded = unquote(line)
    assert not any(TOKEN[i:i + 8] in decoded for i in range(len(TOKEN) - 7)), line
    accepted = b"wants its access token" not in reply  # the gate's 404 (the first segment, decoded, is not it)
    segment = f"/{first}{rest}".lstrip("/").partition("?")[0].partition("/")[0]  # what stands where the token goes
    assert (f"/{REDACTED}" in line) == accepted and (f"/{WRONG}" in line) == (not accepted and bool(segment)), line
