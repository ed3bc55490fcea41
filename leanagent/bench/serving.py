"""`leanagent bench serve`: request latency (p50, p99) and requests/s of real `leanagent serve` processes at 1, 8 and
32 concurrent clients, batched and not.

Under `work` (reused when present) it builds the demo's index (the tiny random encoder over the third demo
repository, as `scripts/demo.sh` writes it: 90 premises) and, with `mathlib`, a Mathlib-sized one (`leanagent
demo-data --mathlib-scale`: 2,000 files, 76,000 premises). Each is served by a `leanagent serve` process on
127.0.0.1, once per mode (`--batching`, `--no-batching`), its cold start timed from starting the command to its first
answer; the clients are threads of this process, each with its own connection, sending requests one after another.
Two bodies:

- new client: every module of the corpus in `imported_modules`, 16 new premises (the same each time, so cached after
  the first request, as a client's unchanged file sends them), k = 32;
- old client: every premise position in `local_premises` (what clients <= v4.30 send: 76,000 integers at Mathlib
  size, about 450 kB), no new premises, k = 32.

States are the test split's, a different one per request. The server and the clients share the machine's cores
unless `server_cpus` parts them; each row gives the server process's CPU time per request and the load average,
since on a shared machine the latencies move with whatever else runs. The flat figures (`--json`) are the
Mathlib-sized index's with the new client's body: `rps_32_*`, `p50_ms_1_*`, `p99_ms_32_*`, their ratios, and every
cold start.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from leanagent.bench.options import ServeOptions
from leanagent.bench.results import Section
from leanagent.data.theorems import load_states
from leanagent.ground.names import DEFAULT_SPLIT, TEST_PART, part_file

CLIENTS = (1, 8, 32)
REQUESTS = {1: 200, 8: 40, 32: 12}  # per client: 200, 320 and 384 requests per level
WARMUP = 8
K = 32


@dataclass
class ServeFigures(Section):
    device: str
    preset: str
    serve_args: str
    rows: list[dict] = field(default_factory=list)
    cold_start_s: dict[str, float] = field(default_factory=dict)

    def flat(self) -> dict:
        out: dict = {"device": self.device, "preset": self.preset, "serve_args": self.serve_args}
        for row in self.rows:
            if row["index"] != "mathlib-scale" or row["body"] != "new client":
                continue
            mode = "batched" if row["batching"] else "unbatched"
            if row["clients"] == 32:
                out[f"rps_32_{mode}"] = row["requests_per_s"]
                out[f"p99_ms_32_{mode}"] = row["p99_ms"]
            if row["clients"] == 1:
                out[f"p50_ms_1_{mode}"] = row["p50_ms"]
        if "rps_32_unbatched" in out and "rps_32_batched" in out:
            out["rps_32_ratio"] = out["rps_32_batched"] / out["rps_32_unbatched"]
            out["p50_ms_1_ratio"] = out["p50_ms_1_batched"] / out["p50_ms_1_unbatched"]
        out.update({f"cold_start_s_{key}": value for key, value in self.cold_start_s.items()})
        return {**out, "rows": self.rows}


def _cli(*argv: str) -> None:
    done = subprocess.run([sys.executable, "-m", "leanagent.cli", *argv], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"leanagent {' '.join(argv[:2])} failed: {done.stderr.strip()[-2000:]}")


def build(work: Path, preset: str, device: str, mathlib: bool) -> dict[str, tuple[Path, Path]]:
    """{name: (index folder, dataset)}, built once under `work`."""
    model = work / f"model-{preset}"
    if not model.exists():
        _cli("init-model", str(model), "--preset", preset)
    if not (work / "demo").exists():  # scripts/demo.sh's data: its repo_2 index holds 90 premises
        _cli("demo-data", str(work / "demo"), "--repos", "3", "--scale", "3", "--theorems", "90")
    out = {"demo": (work / f"index-demo-{preset}", work / "demo" / "repo_2")}
    if mathlib:
        if not (work / "mathlib").exists():
            _cli("demo-data", str(work / "mathlib"), "--mathlib-scale")
        out["mathlib-scale"] = (work / f"index-mathlib-{preset}", work / "mathlib")
    for index, dataset in out.values():
        if not (index / "index.json").exists():
            _cli("index", "--model", str(model), "--dataset", str(dataset), "--out", str(index), "--device", device,
                 "--force")
    return out


def states(dataset: Path) -> list[str]:
    found = load_states([dataset / DEFAULT_SPLIT / part_file(TEST_PART)])
    return found or ["x : Nat\n⊢ Eq x x"]


class Served:
    """`leanagent serve INDEX --port 0` as a user runs it; its URL from the line it prints, and its cold start:
    the seconds from starting the command to the first answer of a `/retrieve` (a first state, k = 32)."""

    def __init__(self, index: Path, device: str, batching: bool, state: str, extra: tuple[str, ...] = (),
                 cpus: set[int] | None = None) -> None:
        argv = [sys.executable, "-m", "leanagent.cli", "serve", str(index), "--port", "0", "--device", device,
                "--batching" if batching else "--no-batching", *extra]
        start = time.perf_counter()
        # `cpus`: the server's CPUs, set before it starts, so torch's thread pool is sized to them (Linux only)
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        self.proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, preexec_fn=pin,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1"})
        line = self.proc.stderr.readline()
        if " at " not in line:
            self.stop()
            raise RuntimeError(f"leanagent serve did not start: {line.strip()}")
        self.url = line.split(" at ", 1)[1].split(";", 1)[0]
        try:
            answer = httpx.post(f"{self.url}/retrieve", json={"state": state, "k": K}, timeout=600)
        except httpx.HTTPError:
            self.stop()
            raise
        self.cold_start_s = time.perf_counter() - start
        if answer.status_code != 200:
            self.stop()
            raise RuntimeError(f"first request failed: {answer.status_code} {answer.text[:200]}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def bodies(url: str, pool: list[str], body: str, count: int) -> list[bytes]:
    modules = httpx.get(f"{url}/indexed-modules", timeout=60).json()
    premises = httpx.get(f"{url}/indexed-premises", timeout=60).json()
    new = [{"name": f"Measure.new_{i}", "decl": f"theorem Measure.new_{i} (x : Nat) : Eq (frob (quon x)) {i}"}
           for i in range(16)]
    out = []
    for i in range(count):
        request: dict = {"state": pool[i % len(pool)], "k": K}
        if body == "new client":
            request.update(local_premises=[], imported_modules=list(range(len(modules))), new_premises=new,
                           caller_in_module_system=False, imported_all_modules=[])
        else:
            request.update(local_premises=list(range(len(premises))), new_premises=[])
        out.append(json.dumps(request, ensure_ascii=False, separators=(",", ":")).encode())
    return out


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far: what the server spent, whatever else the machine runs."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def measure(url: str, payloads: list[bytes], clients: int, per_client: int, pid: int) -> dict:
    def client(c: int) -> list[float]:
        times = []
        with httpx.Client(timeout=600, headers={"Content-Type": "application/json"}) as http:
            for m in range(per_client):
                start = time.perf_counter()
                answer = http.post(f"{url}/retrieve", content=payloads[(c * per_client + m) % len(payloads)])
                times.append(time.perf_counter() - start)
                if answer.status_code != 200 or not isinstance(answer.json(), list):
                    raise RuntimeError(f"request failed: {answer.status_code} {answer.text[:200]}")
        return times

    with httpx.Client(timeout=600, headers={"Content-Type": "application/json"}) as http:
        for payload in payloads[-WARMUP:]:  # the new premises' cache, torch's first passes
            http.post(f"{url}/retrieve", content=payload)
    with ThreadPoolExecutor(clients) as pool:
        cpu, start = _cpu_seconds(pid), time.perf_counter()
        latencies = sorted(t for times in pool.map(client, range(clients)) for t in times)
        wall, cpu = time.perf_counter() - start, _cpu_seconds(pid) - cpu
    p99 = latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))]
    return {"clients": clients, "requests": len(latencies), "p50_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * p99, "requests_per_s": len(latencies) / wall,
            "server_cpu_ms_per_request": 1000 * cpu / len(latencies), "load_average": os.getloadavg()[0]}


def bench_serve(options: ServeOptions, on_row=None) -> ServeFigures:
    server_cpus = set(options.server_cpus)
    client_cpus = set(range(os.cpu_count() or 1)) - server_cpus
    if server_cpus and not client_cpus:
        raise ValueError(f"--server-cpus {','.join(map(str, sorted(server_cpus)))}: leaves no CPU for the clients")
    figures = ServeFigures(options.device, options.preset, options.serve_args)
    built = build(options.work, options.preset, options.device, options.mathlib)
    if server_cpus:
        os.sched_setaffinity(0, client_cpus)
    for name, (index, dataset) in built.items():
        pool = states(dataset)
        premises = json.loads((index / "index.json").read_text())["num_premises"]
        for mode in options.modes:
            served = Served(index, options.device, mode == "batched", pool[0], tuple(options.serve_args.split()),
                            server_cpus or None)
            figures.cold_start_s[f"{name}_{mode}".replace("-", "_")] = served.cold_start_s
            try:
                for body in options.bodies:
                    payloads = bodies(served.url, pool, body, 512)
                    for clients in CLIENTS:
                        row = {"index": name, "premises": premises, "batching": mode == "batched", "body": body,
                               "body_kb": len(payloads[0]) / 1024,
                               **measure(served.url, payloads, clients, REQUESTS[clients], served.proc.pid)}
                        figures.rows.append(row)
                        if on_row is not None:
                            on_row(_row_line(row))
            finally:
                served.stop()
    return figures


def _row_line(row: dict) -> str:
    mode = "batched" if row["batching"] else "unbatched"
    return (f"{row['index']:>14} {row['premises']:>6} premises  {mode:<9} {row['body']:<10} ({row['body_kb']:6.1f} kB)"
            f"  {row['clients']:>2} clients  p50 {row['p50_ms']:7.1f} ms  p99 {row['p99_ms']:7.1f} ms  "
            f"{row['requests_per_s']:7.1f} req/s  server CPU {row['server_cpu_ms_per_request']:6.1f} ms/request  "
            f"load {row['load_average']:.1f}")


def serve_table(figures: ServeFigures) -> str:
    extra = f", {figures.serve_args}" if figures.serve_args else ""
    lines = [f"`leanagent serve` ({figures.preset}, {figures.device}{extra})"]
    lines += [f"  cold start {key}: {s:.1f} s (command to first answer)" for key, s in figures.cold_start_s.items()]
    lines += ["  " + _row_line(row) for row in figures.rows]
    return "\n".join(lines)
