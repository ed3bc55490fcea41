"""A `leanagent serve` process under attack, as `leanagent bench abuse` watches it: its log, CPU and memory, and
/health asked all along. What an attack returns (`Outcome`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

HEALTH_EVERY_S = 0.1


@dataclass
class Outcome:
    """What an attack function returns: the answers it got (status -> count; a refusal's `exit N`), how many
    requests it sent, and a note for the table."""

    statuses: Counter = field(default_factory=Counter)
    requests: int = 0
    note: str = ""


class Server:
    """`leanagent serve SOURCE --port 0 ARGS` as a user runs it: its URL from the banner, its log collected by a
    thread (so the pipe never fills), its process for psutil."""

    def __init__(self, source: Path, args: tuple[str, ...], stdout: Path) -> None:
        with open(stdout, "a") as out:  # uvicorn's access log, when asked for
            self.proc = subprocess.Popen([sys.executable, "-m", "leanagent.cli", "serve", str(source), "--port",
                                          "0", *args], stderr=subprocess.PIPE, stdout=out, text=True,
                                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
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
    """GET /health every 100 ms on a new connection while an attack runs: the worst latency and any failure."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.latencies: list[float] = []
        self.failures: list[str] = []  # what each failed ask got
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            try:
                status = httpx.get(f"{self.url}/health", timeout=60).status_code
                got = "" if status == 200 else str(status)
            except httpx.HTTPError as exc:
                got = type(exc).__name__
            if got:
                self.failures.append(got)
            else:
                self.latencies.append(time.perf_counter() - start)
            self._stop.wait(HEALTH_EVERY_S)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)
