"""`leanagent serve` on an open network: each way a client could make it work without bound gets a bounded answer.

Real `leanagent serve` processes on 127.0.0.1 (as a user runs them: their connection handling is the process's),
real sockets for the clients that stall, the index of the session (tests/serve/conftest.py).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from leanagent.serve import PremiseServer, RetrieveRequest, ServeLimits, create_app
from leanagent.serve.cache import EmbeddingCache
from leanagent.serve.process import machine_name

from .conftest import (
    LONG,
    OLD_CLIENT,
    REPO_ROOT,
    STATE,
    LiveServer,
    command_alone,
    open_connections,
    peak_rss,
    post,
    serving,
    stall,
    until,
)


def test_stalled_sockets_get_408_while_a_good_request_is_answered(built) -> None:
    with serving(built["root"] / "index", "--request-timeout-s", "2") as (url, proc):
        port = int(url.rsplit(":", 1)[1])
        stalled = [stall(port) for _ in range(300)]
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
    with serving(built["root"] / "index", "--max-connections", "20", "--request-timeout-s", "30",
                 "--health-connections", "0") as (url, proc):
        port = int(url.rsplit(":", 1)[1])
        stalled = [stall(port) for _ in range(20)]
        until(lambda: open_connections(proc.pid, port) >= 20)  # all 20 taken in before the next ones come
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


def test_a_low_descriptor_limit_lowers_the_connections_and_is_never_run_out_of(built) -> None:
    """With `ulimit -n 256` the connections were lowered with a warning, yet "[Errno 24] Too many open files" was
    logged: asyncio accepts up to the listen backlog (uvicorn's 2,048) in one go, before any is counted. The burst
    is lowered with the limit, so 400 sockets at once are counted or refused, never past the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1024:  # this process holds 400 sockets at once
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 1024), hard))
    # Stalled sockets are held past the time a loaded machine takes to open 400 (10 s by default, then each is
    # closed with a 408 and its slot freed before the last ones come).
    with serving(built["root"] / "index", "--request-timeout-s", "600", nofile=256) as (url, proc):
        assert "the process may open 256 files, so at most " in proc.banner, proc.banner
        room = int(proc.banner.split("so at most ", 1)[1].split()[0])  # with the 8 kept for /health
        port = int(url.rsplit(":", 1)[1])
        stalled = []
        for _ in range(400):
            try:
                stalled.append(stall(port))
            except OSError:  # refused (reset) beyond the limit, or the kernel's queue full: a client's retry
                pass
        until(lambda: open_connections(proc.pid, port) >= room - 8)  # every slot taken, the rest refused
        for conn in stalled:
            conn.close()
        until(lambda: post(url, OLD_CLIENT).status_code == 200)
        proc.send_signal(signal.SIGINT)
        log = proc.stderr.read()
    assert "Too many open files" not in log and "Errno 24" not in log and "Traceback" not in log, log


def test_while_stalled_sockets_hold_every_slot_health_is_answered_and_nothing_else(built) -> None:
    """1,024 stalled sockets once held every slot and a normal GET /health was reset. Connections beyond
    --max-connections are kept for /health alone: answered and closed; any other path a 503 to retry."""
    with serving(built["root"] / "index", "--max-connections", "20", "--request-timeout-s", "30") as (url, proc):
        port = int(url.rsplit(":", 1)[1])
        stalled = [stall(port) for _ in range(20)]
        until(lambda: open_connections(proc.pid, port) >= 20)
        for _ in range(3):  # one after another, each on a new connection
            health = httpx.get(f"{url}/health", timeout=LONG)
            assert health.status_code == 200 and health.json()["status"] == "ok"
            assert health.headers["connection"] == "close"
        refused = post(url, OLD_CLIENT)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "answers GET /health alone" in refused.json()["error"]
        for conn in stalled:
            conn.close()
        until(lambda: post(url, OLD_CLIENT).status_code == 200)


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads the server's peak memory from /proc")
def test_a_large_body_and_too_many_positions_are_refused_as_they_are_read(built) -> None:
    with serving(built["root"] / "index", "--max-positions", "1000", "--max-body-bytes", str(64 << 20)) as (url,
                                                                                                          proc):
        before = peak_rss(proc.pid)
        # 2.6 million tiny new premises, 60 MB: refused once its values are counted, before any is decoded.
        tiny = b'{"name":"a","decl":"b"},'
        body = b'{"state":"s","new_premises":[' + tiny * 2_600_000 + b'{"name":"a","decl":"b"}]}'
        answer = post(url, body)
        assert answer.status_code == 413 and "a body of more than 1,320 JSON values" in answer.json()["error"]
        # Twelve million names in a module list, 60 MB: the same (it was parsed and validated whole: 1.6 GB).
        names = b'{"state":"s","imported_modules":[' + b'"a",' * 12_000_000 + b'"a"]}'
        assert post(url, names).status_code == 413
        many = post(url, json.dumps({"state": "s", "local_premises": [0] * 1200}))
        assert many.status_code == 413 and "1,200 premises and modules named, more than this server's 1,000" in \
            many.json()["error"]
        # The body's bytes are held while read, never millions of objects: far from the 2.46 GB they took.
        assert peak_rss(proc.pid) - before < 600 * 2**20
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
    assert all(len(key) == 16 for key in cache._slots)  # kept by digest: the texts themselves are not held


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
    with serving(built["root"] / "index", "--token-file", str(token_file), "--access-log") as (shown, proc):
        token = token_file.read_text().strip()
        assert oct(token_file.stat().st_mode & 0o777) == "0o600" and len(token) >= 32  # 192 random bits
        # The banner names the file to read the token from, never the token.
        assert shown.endswith("/TOKEN") and f'premiseSelection.apiBaseUrl "{shown}" (TOKEN: the first line of ' \
            f'{token_file})' in proc.banner and token not in proc.banner
        base = shown[: -len("/TOKEN")]
        url = f"{base}/{token}"
        for path in ("/health", "/indexed-premises", "/retrieve", f"/{token[:-1]}x/health"):
            refused = httpx.get(f"{base}{path}", timeout=LONG)
            assert refused.status_code == 404 and "access token" in refused.json()["error"]
            assert token not in refused.text
        assert post(url, OLD_CLIENT).status_code == 200
        assert httpx.get(f"{url}/indexed-modules", timeout=LONG).json()[0] == "Core.Basic"
        # Percent-encoded, it is the token still; cut short by a character, it is not: neither is logged as sent.
        encoded = "".join(f"%{ord(c):02X}" for c in token)
        assert httpx.get(f"{base}/{encoded}/health", timeout=LONG).status_code == 200
        assert httpx.get(f"{base}/{token[:-1]}/health", timeout=LONG).status_code == 404
        proc.send_signal(signal.SIGINT)
        log = proc.stderr.read() + proc.stdout.read()
    assert '"POST /TOKEN/retrieve HTTP/1.1" 200' in log and '"GET /TOKEN/health HTTP/1.1" 200' in log, log
    assert '"GET /WRONG-TOKEN/health HTTP/1.1" 404' in log, log  # the access log, redacted
    assert token[:16] not in log and token[-16:] not in log and encoded[:24] not in log, log
    assert "Traceback" not in log and "Logging error" not in log, log  # uvicorn's formatter reads the arguments


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


def test_every_interface_needs_a_token_or_says_it_serves_anyone(built, tmp_path) -> None:
    """Off loopback without a token the server served everyone; now it refuses before binding, unless told."""
    refused = subprocess.run([sys.executable, "-m", "leanagent.cli", "serve", str(built["root"] / "index"), "--host",
                              "0.0.0.0", "--port", "0"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=LONG,
                             env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "LEANAGENT_SERVE_TOKEN": ""})
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert "needs an access token" in refused.stderr and "--insecure-no-token" in refused.stderr
    with serving(built["root"] / "index", "--host", "0.0.0.0", "--insecure-no-token") as (url, proc):
        assert "warning: listening on every network interface without a token" in proc.banner
        # The server's machine by name: not 0.0.0.0, and not `localhost` where getfqdn() says so (a host whose
        # /etc/hosts maps its name to 127.0.0.1 beside localhost: then its host name).
        assert url.startswith(f"http://{machine_name()}:") and "0.0.0.0" not in url and "localhost" not in url
    with serving(built["root"] / "index", "--host", "0.0.0.0", "--token-file", str(tmp_path / "t")) as (url, proc):
        assert "with a token in the URL's path" in proc.banner


@pytest.mark.parametrize("content, mode, match", [
    ("a\n", 0o600, "a token of 1 characters; at least 16 are needed"),
    ("abcdefgh/ijklmnopq\n", 0o600, "the token holds '/', which a URL's path does not carry"),
    ("abcdefgh ijklmnopq\n", 0o600, "the token holds ' '"),
    ("abcdefghijklmnopqrstu\n", 0o644, "readable by others (mode 644), so the token is no secret; run `chmod 600 "),
])
def test_a_weak_token_or_a_token_file_others_can_read_is_refused(built, tmp_path, content, mode, match) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(content)
    token_file.chmod(mode)
    refused = subprocess.run([sys.executable, "-m", "leanagent.cli", "serve", str(built["root"] / "index"),
                              "--token-file", str(token_file), "--port", "0"], capture_output=True, text=True,
                             cwd=REPO_ROOT, timeout=LONG, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1 and match in refused.stderr, refused.stderr
    assert content.strip() not in refused.stderr or len(content.strip()) < 2


def test_a_token_file_of_a_gigabyte_is_refused_unread(built, tmp_path) -> None:
    """A 1 GiB sparse token file (mode 600) was read whole: 2,086 MB of memory. Now refused from its size."""
    big = tmp_path / "token"
    with open(big, "wb") as f:
        f.truncate(1 << 30)
    big.chmod(0o600)
    code, torch_loaded, err, peak = command_alone(["serve", str(built["root"] / "index"), "--token-file", str(big)],
                                                  tmp_path)
    assert code == 1 and not torch_loaded and err.count("\n") == 1, err
    assert err.startswith(f"error: --token-file {big}: 1.1 GB, more than a token file ever holds (4.1 KB)"), err
    big.chmod(0o644)  # refused before it is opened: the memory of a refusal
    idle = command_alone(["serve", str(built["root"] / "index"), "--token-file", str(big)], tmp_path)
    assert idle[0] == 1 and "readable by others" in idle[2] and peak - idle[3] < 100 * 2**20, (peak, idle)


def test_sigint_ends_the_server_with_130(built) -> None:
    with serving(built["root"] / "index") as (url, proc):
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=LONG) == 128 + signal.SIGINT
        assert "stopped (SIGINT)" in proc.stderr.read()
