"""A `leanagent serve` process under attack, as `leanagent bench abuse` watches it: its log, CPU and memory, and
/health asked all along. What an attack returns (`Outcome`)."""

from __future__ import annotations

import http.client
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import psutil

HEALTH_EVERY_S = 0.1


def request(url: str, method: str = "GET", body: bytes | None = None, timeout: float = 120) -> tuple[int, bytes]:
    """One request on a new connection with the standard library's client: (status, body). httpx would build an
    SSL context per call, and 48 of them at once take a 2-core machine's CPU from the server being measured."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request(method, parts.path or "/", body=body,
                     headers={"Content-Type": "application/json"} if body is not None else {})
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


@dataclass
class Outcome:
    """What an attack function returns: the answers it got (status -> count; a refusal's `exit N`), how many
    requests it sent, a note for the table, and where its own bar was not met."""

    statuses: Counter = field(default_factory=Counter)
    requests: int = 0
    note: str = ""
    problems: list[str] = field(default_factory=list)  # the attack's own bar, where it was not met


class Server:
    """`leanagent serve SOURCE --port 0 ARGS` as a user runs it: its URL from the banner, its log collected by a
    thread (so the pipe never fills), its process for psutil."""

    def __init__(self, source: Path, args: tuple[str, ...], stdout: Path, nofile: int | None = None) -> None:
        """`nofile`: the process's limit of open files, soft and hard (`ulimit -n`)."""
        limit = None if nofile is None else lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        with open(stdout, "a") as out:  # uvicorn's access log, when asked for
            self.proc = subprocess.Popen([sys.executable, "-m", "leanagent.cli", "serve", str(source), "--port",
                                          "0", *args], stderr=subprocess.PIPE, stdout=out, text=True,
                                         env={**os.environ, "HF_HUB_OFFLINE": "1"}, preexec_fn=limit)
        self.lines: list[str] = []
        banner = self._read_banner()
        self.url = banner.split(" at ", 1)[1].split(";", 1)[0]
        if "--token-file" in args and self.url.endswith("/TOKEN"):  # the banner names the file, not the token
            token = Path(args[args.index("--token-file") + 1]).read_text().strip()
            self.url = self.url[: -len("TOKEN")] + token
        self.process = psutil.Process(self.proc.pid)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.idle_rss_mb = self.rss_mb()

    def _read_banner(self) -> str:
        while True:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError(f"leanagent serve did not start: {''.join(self.lines)[-2000:]}")
            self.lines.append(line)
            if line.startswith("serving "):
                return line

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    def cpu_s(self) -> float:
        times = self.process.cpu_times()
        return times.user + times.system

    def rss_mb(self) -> float:
        return self.process.memory_info().rss / 2**20

    def peak_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return self.rss_mb()

    def reset_peak(self) -> None:
        """Linux: the resident high-water mark starts again from the current size (clear_refs, value 5)."""
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout=120)
        self.reader.join(timeout=10)
        return code


class HealthWatch:
    """GET /health every 100 ms on a new connection while an attack runs: the worst latency and any failure.

    Asked from a process of its own: in the bench's process, its thread would wait for the interpreter's lock
    behind the attack's own client threads (48 of them), and that wait would be counted as the server's."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.latencies: list[float] = []
        self.failures: list[str] = []  # what each failed ask got
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> HealthWatch:
        self._proc = subprocess.Popen([sys.executable, "-m", "leanagent.bench.target", self.url],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self._proc.stdout.readline().strip() != "ready":  # asking from here on
            raise RuntimeError("the /health watcher did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        out, _ = self._proc.communicate("stop\n", timeout=120)  # its stdin closed: it stops and reports
        for line in out.splitlines():
            kind, _, value = line.partition(" ")
            if kind == "ok":
                self.latencies.append(float(value))
            elif kind == "failed":
                self.failures.append(value)


def _watch(url: str) -> None:
    """The watcher's process: asks until its stdin closes, then prints `ok SECONDS` or `failed WHAT` per ask."""
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    results = []
    print("ready", flush=True)
    while not stop.is_set():
        start = time.perf_counter()
        try:
            status, _ = request(f"{url}/health", timeout=60)
            results.append(f"ok {time.perf_counter() - start:.4f}" if status == 200 else f"failed {status}")
        except (OSError, http.client.HTTPException) as exc:
            results.append(f"failed {type(exc).__name__}")
        stop.wait(HEALTH_EVERY_S)
    print("\n".join(results), flush=True)


if __name__ == "__main__":
    _watch(sys.argv[1])
