"""The attacks of issue 38 that the other serve tests do not replay, each against a real `leanagent serve` on
127.0.0.1 (or the server's own parts where the process adds nothing): what cost seconds or gigabytes within every
limit, a client that hangs up, SIGHUP, a burst of bodies past the shared budget, the cache's real memory. What they
cost (CPU seconds, peak memory, /health's worst latency) is measured by `leanagent bench abuse`, not here."""

from __future__ import annotations

import json
import signal
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
import torch

from leanagent.serve import ServeLimits
from leanagent.serve.cache import ENTRY_OVERHEAD, EmbeddingCache

from .conftest import LONG, OLD_CLIENT, STATE, peak_rss, post, serving, until

# A new premise at the limits: a name of 1,023 characters in 512 parts, a declaration of the name's parts repeated
# without whitespace. Tagging its name took 44 s of CPU at 100,000 characters.
NAME = ".".join(["a"] * 512)[:1023]


def _adversarial(decl_chars: int) -> bytes:
    decl = ("a." * (decl_chars // 2 + 1))[:decl_chars]
    return json.dumps({"state": STATE, "k": 5, "new_premises": [{"name": NAME, "decl": decl}]}).encode()


def _raw(port: int, head: bytes) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port), timeout=LONG)
    conn.sendall(head)
    return conn


def _reply(conn: socket.socket) -> bytes:
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    conn.close()
    return data


def _headers(length: int) -> bytes:
    return (b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % length)


def test_premises_at_the_limits_are_answered_while_health_is(built) -> None:
    """One new premise of a 512-part name and a 100,000-character declaration (44 s of CPU), and 48 of 20 kB at
    once (/health waited 37 s): all answered, and /health with them."""
    with serving(built["root"] / "index") as (url, proc):
        assert post(url, _adversarial(100_000)).status_code == 200
        healths: list[int] = []
        done = threading.Event()

        def ask_health() -> None:
            with httpx.Client(timeout=LONG) as http:
                while not done.is_set():
                    healths.append(http.get(f"{url}/health").status_code)

        watcher = threading.Thread(target=ask_health)
        watcher.start()
        body = _adversarial(20_000)
        with ThreadPoolExecutor(48) as pool:
            statuses = list(pool.map(lambda _: post(url, body).status_code, range(48)))
        done.set()
        watcher.join(timeout=LONG)
    assert statuses == [200] * 48 and healths and set(healths) == {200}


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads the server's peak memory from /proc")
def test_a_million_wrong_entries_are_one_error_and_no_gigabytes(built) -> None:
    """1M floats in local_premises (4 MB) built one validation error each: 20 s, +2.5 GB. Now one line."""
    with serving(built["root"] / "index") as (url, proc):
        before = peak_rss(proc.pid)
        answer = post(url, b'{"state": "s", "local_premises": [' + b"0.5," * 999_999 + b"0.5]}")
        assert answer.status_code == 422
        assert answer.json()["error"].startswith("local_premises: 1,000,000 of its 1,000,000 entries are not "
                                                 "positions (integers) or names (strings) ([0] 0.5, [1] 0.5, [2] 0.5,"
                                                 " and 999,997 more)")
        assert peak_rss(proc.pid) - before < 300 * 2**20


def test_bodies_past_the_shared_budget_get_503_and_health_is_answered(built) -> None:
    """Four 60 MB bodies at once took 4.8 GB and stalled /health for 24 s: nothing bounded the bodies held at once.
    Here a body held half-sent keeps the bytes it sent reserved; the next one that would pass --bodies-mb is a 503."""
    with serving(built["root"] / "index", "--bodies-mb", "2") as (url, proc):
        port = int(url.rsplit(":", 1)[1])
        body = json.dumps({"state": STATE, "k": 3, "pad": "x" * 400_000}).encode()
        slow = _raw(port, _headers(len(body)) + body[:300_000])  # the 0.29 MB it sent, of the 2
        until(lambda: httpx.get(f"{url}/health", timeout=LONG).json()["bodies_mb"] >= 0.25)
        refused = _reply(_raw(port, _headers(1_900_000)))  # its headers alone: refused before its body is read
        assert refused.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in refused.lower()
        assert b"--bodies-mb 2" in refused
        assert httpx.get(f"{url}/health", timeout=LONG).status_code == 200
        slow.sendall(body[300_000:])
        assert _reply(slow).startswith(b"HTTP/1.1 200 ")  # decoded within the budget: 4 bytes per body byte
        until(lambda: httpx.get(f"{url}/health", timeout=LONG).json()["bodies_mb"] == 0)
        assert post(url, body).status_code == 200  # given back: the same body is answered again
        # A body that could never fit the budget, even alone, is a 413: retrying would not help.
        never = post(url, json.dumps({"state": STATE, "pad": "x" * 1_000_000}))
        assert never.status_code == 413 and "--bodies-mb" in never.json()["error"]


def test_sockets_that_declare_bodies_and_send_little_hold_only_what_they_sent(built) -> None:
    """16 sockets that each declared Content-Length 16777216 and sent nothing held the default 256 MB budget: every
    legitimate request got 503 until they timed out, and reconnecting kept it so. A body holds what it sent."""
    with serving(built["root"] / "index", "--request-timeout-s", "600") as (url, proc):  # held all along
        port = int(url.rsplit(":", 1)[1])
        held = [_raw(port, _headers(16 << 20) + b'{"state": "' + b"s" * 8181) for _ in range(16)]  # 8 KiB each
        until(lambda: httpx.get(f"{url}/health", timeout=LONG).json()["bodies_mb"] >= 0.1)  # all 16 being read
        statuses = [post(url, OLD_CLIENT).status_code for _ in range(20)]
        assert httpx.get(f"{url}/health", timeout=LONG).json()["bodies_mb"] == 0.1
        for conn in held:
            conn.close()
    assert statuses == [200] * 20


def test_clients_that_hang_up_mid_body_are_one_line_and_no_traceback(built) -> None:
    """50 clients that hung up mid-body gave 5,100 log lines and 102 tracebacks."""
    with serving(built["root"] / "index") as (url, proc):
        port = int(url.rsplit(":", 1)[1])
        for i in range(50):
            conn = _raw(port, _headers(10_000) + b'{"state": "' + b"s" * 100)
            if i % 2:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
            conn.close()
        for _ in range(20):  # and half a request line
            _raw(port, b"POST /retr").close()
        until(lambda: httpx.get(f"{url}/health", timeout=LONG).json()["bodies_mb"] == 0)
        assert post(url, OLD_CLIENT).status_code == 200
        proc.send_signal(signal.SIGINT)
        log = proc.stderr.read()
    assert "Traceback" not in log and len(log.splitlines()) <= 4, log


@pytest.mark.parametrize("in_flight", [True, False])
def test_sighup_ends_the_server_as_sigterm_does(built, in_flight) -> None:
    """SIGHUP gave exit 129 with 2-4 tracebacks and a 500 for the request in flight, and once kept serving."""
    with serving(built["root"] / "index") as (url, proc):
        port = int(url.rsplit(":", 1)[1])
        body = json.dumps({"state": STATE, "k": 3, "local_premises": [0, 1, 2], "pad": "x" * 300_000}).encode()
        if in_flight:
            conn = _raw(port, _headers(len(body)) + body[:200_000])
            until(lambda: httpx.get(f"{url}/health", timeout=LONG).json()["bodies_mb"] >= 0.2)
        proc.send_signal(signal.SIGHUP)
        if in_flight:
            conn.sendall(body[200_000:])
            reply = _reply(conn)
            assert reply.startswith(b"HTTP/1.1 200 ") and b'"score"' in reply, reply[:300]
        assert proc.wait(timeout=LONG) == 128 + signal.SIGHUP
        log = proc.stderr.read()
    assert "stopped (SIGHUP)" in log and "Traceback" not in log, log


def _heaviest(premises: int = ServeLimits().max_new_premises, decl_chars: int = 600) -> bytes:
    """As many new premises as a request may send, each longer than the encoder reads: its most encoder work."""
    new = [{"name": f"Heavy.p{i}", "decl": f"theorem Heavy.p{i} : " + "a + b = b + a ∧ " * (decl_chars // 16)}
           for i in range(premises)]
    return json.dumps({"state": STATE, "k": 5, "new_premises": new}).encode()


@pytest.mark.parametrize("sig, heavy", [(signal.SIGTERM, True), (signal.SIGINT, False), (signal.SIGHUP, False)])
def test_a_stop_answers_or_refuses_every_request_in_flight_in_time_without_a_traceback(built, sig, heavy) -> None:
    """A signal with 3 of the heaviest requests in flight on a loaded machine gave 3 x 500, 6 tracebacks
    (`CancelledError: timeout graceful shutdown exceeded`) and an exit after 60 s: uvicorn cancelled what outlasted
    its window. Now what is still running when the stop's time is over is a 503 (a body that never arrives whole
    always is), the encoder drops its work, and the exit code is 128 + N."""
    replies: list[bytes] = []
    with serving(built["root"] / "index", "--request-timeout-s", "600") as (url, proc):
        port = int(url.rsplit(":", 1)[1])
        body = json.dumps({"state": STATE, "k": 3, "pad": "x" * 300_000}).encode()
        stalled = _raw(port, _headers(len(body)) + body[:200_000])  # never sent whole: in flight to the end
        until(lambda: httpx.get(f"{url}/health", timeout=LONG).json()["bodies_mb"] >= 0.15)
        threads = []
        if heavy:
            heaviest = _heaviest()
            conns = [_raw(port, _headers(len(heaviest)) + heaviest) for _ in range(3)]
            threads = [threading.Thread(target=lambda c=c: replies.append(_reply(c))) for c in conns]
            for t in threads:
                t.start()
            until(lambda: httpx.get(f"{url}/health", timeout=LONG).json()["requests"] == 3)  # handed to the encoder
        proc.send_signal(sig)
        refused = _reply(stalled)
        assert proc.wait(timeout=LONG) == 128 + sig
        for t in threads:
            t.join(timeout=LONG)
        log = proc.stderr.read()
    assert refused.startswith(b"HTTP/1.1 503 ") and b"the server is stopping" in refused, refused[:300]
    assert all(r.startswith((b"HTTP/1.1 200 ", b"HTTP/1.1 503 ")) for r in replies) and len(replies) == 3 * heavy
    assert "Traceback" not in log and "graceful shutdown exceeded" not in log and f"stopped ({sig.name})" in log, log


def test_the_cache_holds_what_it_counts(built) -> None:
    """--cache-mb 8 held 2.2-3.1 times its budget (a tensor per row). Filled with byt5-small-wide rows, the
    process grows by at most 1.3 times the budget, and the cache counts its blocks' real bytes."""
    capacity = 64 << 20
    cache = EmbeddingCache(capacity)
    block = torch.randn(512, 1472)  # one batch of rows, stored under new texts each time
    me = psutil.Process()
    before = me.memory_info().rss
    rows = 0
    for batch in range(40):
        cache.store([f"premise {batch} {i}" for i in range(512)], block)
        rows += 512
    grown = me.memory_info().rss - before
    most = capacity // (1472 * 4 + ENTRY_OVERHEAD)  # rows the budget holds, each with its bookkeeping
    assert 0.95 * most <= len(cache) <= most and rows > most  # full, and the rest dropped
    assert cache.bytes <= capacity and grown <= 1.3 * capacity, (cache.bytes, grown)
    assert sum(b.untyped_storage().nbytes() for b in cache._blocks) + len(cache) * ENTRY_OVERHEAD == cache.bytes
    found, missing = cache.lookup(["premise 39 0", "premise 0 0"])
    assert list(found) == ["premise 39 0"] and missing == ["premise 0 0"]  # the oldest went first
