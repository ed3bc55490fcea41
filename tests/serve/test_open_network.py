"""`leanagent serve` on an open network: each way a client could make it work without bound gets a bounded answer.

Real `leanagent serve` processes on 127.0.0.1 (as a user runs them: their connection handling is the process's),
real sockets for the clients that stall, the index of the session (tests/serve/conftest.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest

from leanagent.serve import PremiseServer, RetrieveRequest, ServeLimits, create_app
from leanagent.serve.cache import EmbeddingCache

from .conftest import OLD_CLIENT, REPO_ROOT, STATE, LiveServer, post

LONG = 60  # seconds a test waits at most for what a server does at once: generous on a loaded machine


@contextmanager
def serving(source: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """`leanagent serve SOURCE ARGS --port 0` as a user runs it; (its URL, the process), stopped with SIGINT."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "leanagent.cli", "serve", str(source), "--port", "0", *args],
                            stderr=subprocess.PIPE, text=True, env=full_env, cwd=REPO_ROOT)
    try:
        lines = []
        while True:
            line = proc.stderr.readline()
            assert line, f"the server ended: {''.join(lines)}"
            lines.append(line)
            if line.startswith("serving "):
                break
        proc.banner = "".join(lines)  # type: ignore[attr-defined]
        yield line.split(" at ", 1)[1].split(";", 1)[0], proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=LONG)


def _stall(port: int) -> socket.socket:
    """A client that sends half a request line and stalls."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=LONG)
    conn.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Le")
    return conn


def _until(condition, seconds: float = LONG) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not within the time given"
        time.sleep(0.05)


def _open_connections(pid: int, port: int) -> int:
    return sum(1 for c in psutil.Process(pid).net_connections(kind="tcp")
               if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED)


def _peak_rss(pid: int) -> int:
    """The process's resident high-water mark (Linux's VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_stalled_sockets_get_408_while_a_good_request_is_answered(built) -> None:
    with serving(built["root"] / "index", "--request-timeout-s", "2") as (url, proc):
        port = int(url.rsplit(":", 1)[1])
        stalled = [_stall(port) for _ in range(300)]
        answer = post(url, OLD_CLIENT)  # while 300 sockets hold half a request each
        assert answer.status_code == 200 and len(answer.json()) == 6
        # Each stalled socket is answered 408 and closed once its deadline passes (2 s); read them all.
        replies = []
        for conn in stalled:
            data = b""
            while chunk := conn.recv(4096):
                data += chunk
            replies.append(data)
            conn.close()
        assert all(r.startswith(b"HTTP/1.1 408 Request Timeout") for r in replies), replies[0]
        assert b"did not arrive whole within 2 s" in replies[0]
        assert post(url, OLD_CLIENT).status_code == 200
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
    # One line a minute about them, not one (or a traceback) per socket.
    assert rest.count("did not arrive whole") == 1 and "Traceback" not in rest, rest


def test_connections_beyond_the_limit_are_closed_at_once(built) -> None:
    with serving(built["root"] / "index", "--max-connections", "20", "--request-timeout-s", "30") as (url, proc):
        port = int(url.rsplit(":", 1)[1])
        stalled = [_stall(port) for _ in range(20)]
        _until(lambda: _open_connections(proc.pid, port) >= 20)  # all 20 taken in before the next ones come
        extra = [socket.create_connection(("127.0.0.1", port), timeout=LONG) for _ in range(5)]
        for conn in extra:  # closed (reset) by the server without a byte of an answer
            try:
                conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert conn.recv(4096) == b""
            except (ConnectionResetError, BrokenPipeError):
                pass
            conn.close()
        for conn in stalled:
            conn.close()
        deadline = time.monotonic() + LONG
        while True:  # the stalled ones gone, a client is answered again
            try:
                if httpx.get(f"{url}/health", timeout=LONG).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.1)


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads the server's peak memory from /proc")
def test_a_large_body_and_too_many_positions_are_refused_as_they_are_read(built) -> None:
    with serving(built["root"] / "index", "--max-positions", "1000") as (url, proc):
        before = _peak_rss(proc.pid)
        # 2.6 million tiny new premises, 60 MB: refused after the first 2,049 objects, not after building them all.
        tiny = b'{"name":"a","decl":"b"},'
        body = b'{"state":"s","new_premises":[' + tiny * 2_600_000 + b'{"name":"a","decl":"b"}]}'
        answer = post(url, body)
        assert answer.status_code == 413 and "new_premises: more than this server's 2,048" in answer.json()["error"]
        many = post(url, json.dumps({"state": "s", "local_premises": [0] * 5000}))
        assert many.status_code == 413 and "more than 1,000 positions" in many.json()["error"]
        # The body's bytes are held while read, never millions of objects: far from the 2.46 GB they took.
        assert _peak_rss(proc.pid) - before < 600 * 2**20
        assert httpx.get(f"{url}/health", timeout=LONG).json()["status"] == "ok"


def test_the_new_premise_cache_is_bounded_in_bytes(built) -> None:
    index = built["index"]
    capacity = 20 * (64 * index.embeddings.element_size() + 200)  # 20 rows of this index's width, as stored
    server = PremiseServer(index, ServeLimits(cache_mb=capacity / 2**20, batching=False))
    for r in range(4):  # 4 requests of 10 distinct declarations of 99,000 characters each
        new = [{"name": f"RepoA.big{r}_{i}", "decl": f"theorem big{r}_{i} : " + "x" * 99_000} for i in range(10)]
        assert server.retrieve(RetrieveRequest(state=STATE, k=5, new_premises=new))
    cache: EmbeddingCache = server._cache
    assert cache.bytes <= capacity and len(cache) == 20
    assert all(len(key) == 16 for key in cache._rows)  # kept by digest: the texts themselves are not held


@pytest.mark.parametrize("name, status", [("a." * 80_000 + "a", 413), ("a." * 500 + "a", 200)])
def test_a_long_name_is_refused_before_any_work_on_it_and_a_long_enough_one_is_answered(built, name, status) -> None:
    body = {"state": STATE, "k": 3, "new_premises": [{"name": name, "decl": f"theorem {name} : True"}]}
    with LiveServer(create_app(built["index"])) as live:
        answer = post(live.url, json.dumps(body))
    assert answer.status_code == status, answer.text
    if status == 413:
        error = answer.json()["error"]
        assert "name of 160,001 characters" in error and len(error) < 300  # a short prefix of it, not all of it


def test_a_token_in_the_path_is_required_and_lean_is_told_the_url(built, tmp_path) -> None:
    token_file = tmp_path / "token"
    with serving(built["root"] / "index", "--token-file", str(token_file)) as (url, proc):
        token = token_file.read_text().strip()
        assert oct(token_file.stat().st_mode & 0o777) == "0o600" and len(token) >= 24
        assert url.endswith(f"/{token}") and f'premiseSelection.apiBaseUrl "{url}"' in proc.banner
        base = url[: -len(token) - 1]
        for path in ("/health", "/indexed-premises", "/retrieve", f"/{token[:-1]}x/health"):
            refused = httpx.get(f"{base}{path}", timeout=LONG)
            assert refused.status_code == 404 and "access token" in refused.json()["error"]
            assert token not in refused.text
        assert post(url, OLD_CLIENT).status_code == 200
        assert httpx.get(f"{url}/indexed-modules", timeout=LONG).json()[0] == "Core.Basic"


def test_no_response_names_a_path_and_the_schema_is_off_unless_asked(built) -> None:
    folder = str(built["root"])
    with serving(built["root"] / "index") as (url, proc):
        health = httpx.get(f"{url}/health", timeout=LONG)
        assert health.status_code == 200 and folder not in health.text
        assert health.json()["model"]["sha256"] and health.json()["stage"] is None
        assert httpx.get(f"{url}/openapi.json", timeout=LONG).status_code == 404
        for body in (OLD_CLIENT, '{"state": "s", "local_premises": ["nowhere"]}', "{"):
            assert folder not in post(url, body).text
    with serving(built["root"] / "index", "--openapi") as (url, proc):
        assert "/retrieve" in httpx.get(f"{url}/openapi.json", timeout=LONG).json()["paths"]


def test_every_interface_is_warned_about_and_lean_gets_this_machines_name(built) -> None:
    with serving(built["root"] / "index", "--host", "0.0.0.0") as (url, proc):
        assert "warning: listening on every network interface" in proc.banner and "--token-file" in proc.banner
        assert "0.0.0.0" not in url and url.startswith(f"http://{socket.getfqdn()}:")


def test_sigint_ends_the_server_with_130(built) -> None:
    with serving(built["root"] / "index") as (url, proc):
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=LONG) == 128 + signal.SIGINT
        assert "stopped (SIGINT)" in proc.stderr.read()
