"""Request latency (p50, p99) and requests/s of `leanagent serve` at 1, 8 and 32 concurrent clients, batched and not.

    python scripts/measure_serve.py WORKDIR [--preset tiny] [--device cpu] [--json OUT] [--skip-mathlib]
                                    [--modes batched,unbatched] [--serve-args "--dtype bf16"]
                                    [--bodies "new client,old client"]

Builds, under WORKDIR (reused when present): the demo index (the tiny random encoder over the third demo
repository, as `scripts/demo.sh` writes it and docs/serving.md indexes it: 90 premises) and a mathlib-scale
index (`leanagent demo-data --mathlib-scale`: 2,000 files, 76,000 premises). Each is served by a real `leanagent
serve` process on 127.0.0.1; the clients are threads of this process, each with its own httpx connection,
sending requests one after another. Two bodies are measured:

- new client: every module of the corpus in `imported_modules`, 16 new premises (the same ones each time, so
  cached after the first request, as a client's unchanged file would send them), k = 32;
- old client: every premise position in `local_premises` (what clients <= v4.30 send: 76,000 integers at
  mathlib scale, about 450 kB), no new premises, k = 32.

Each index is served twice in the same run, with `--batching` (the default) and with `--no-batching`, and each
server's cold start is timed: from starting the command to its first answer. `--json OUT` writes, beside every row, flat
keys for the mathlib-scale index and the new client's body: `rps_32_batched`, `rps_32_unbatched`,
`p50_ms_1_batched`, `p50_ms_1_unbatched`, `p99_ms_32_batched`, `p99_ms_32_unbatched`, their ratios and
`cold_start_s_*`. States are the test split's, a different one per request. The server and the clients share
the machine's cores; each row also gives the server process's CPU time per request and the load average, since
on a shared machine the latencies move with whatever else runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

REPO_ROOT = Path(__file__).resolve().parents[1]
CLIENTS = (1, 8, 32)
REQUESTS = {1: 200, 8: 40, 32: 12}  # per client: 200, 320 and 384 requests per level
WARMUP = 8


def _env() -> dict[str, str]:
    """This checkout first on the path, and whatever the caller's PYTHONPATH adds (packages installed with
    `pip --target`, as the device run installs the ones its machine lacks)."""
    path = os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH"))))
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}


def _cli(*argv: str) -> None:
    subprocess.run([sys.executable, "-m", "leanagent.cli", *argv], check=True, env=_env(), cwd=REPO_ROOT)


def build(work: Path, preset: str, device: str, mathlib: bool) -> dict[str, tuple[Path, Path]]:
    """{name: (index folder, dataset)}, built once."""
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
            start = time.perf_counter()
            _cli("index", "--model", str(model), "--dataset", str(dataset), "--out", str(index), "--device", device,
                 "--force")
            print(f"built {index} in {time.perf_counter() - start:.0f} s", flush=True)
    return out


def states(dataset: Path) -> list[str]:
    theorems = json.loads((dataset / "random" / "test.json").read_text())
    found = [t["state_before"] for th in theorems for t in th["traced_tactics"]]
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
        self.proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO_ROOT,
                                     preexec_fn=pin)
        line = self.proc.stderr.readline()
        if " at " not in line:
            raise SystemExit(f"leanagent serve did not start: {line}{self.proc.stderr.read()}")
        self.url = line.split(" at ", 1)[1].split(";", 1)[0]
        answer = httpx.post(f"{self.url}/retrieve", json={"state": state, "k": 32}, timeout=600)
        self.cold_start_s = time.perf_counter() - start
        if answer.status_code != 200:
            raise SystemExit(f"first request failed: {answer.status_code} {answer.text[:200]}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def bodies(url: str, pool: list[str], fmt: str, count: int) -> list[bytes]:
    modules = httpx.get(f"{url}/indexed-modules", timeout=60).json()
    premises = httpx.get(f"{url}/indexed-premises", timeout=60).json()
    new = [{"name": f"Measure.new_{i}", "decl": f"theorem Measure.new_{i} (x : Nat) : Eq (frob (quon x)) {i}"}
           for i in range(16)]
    out = []
    for i in range(count):
        body: dict = {"state": pool[i % len(pool)], "k": 32}
        if fmt == "new client":
            body.update(local_premises=[], imported_modules=list(range(len(modules))), new_premises=new,
                        caller_in_module_system=False, imported_all_modules=[])
        else:
            body.update(local_premises=list(range(len(premises))), new_premises=[])
        out.append(json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode())
    return out


def cpu_seconds(pid: int) -> float:
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
                    raise SystemExit(f"request failed: {answer.status_code} {answer.text[:200]}")
        return times

    with httpx.Client(timeout=600, headers={"Content-Type": "application/json"}) as http:
        for payload in payloads[-WARMUP:]:  # the new premises' cache, torch's first passes
            http.post(f"{url}/retrieve", content=payload)
    with ThreadPoolExecutor(clients) as pool:
        cpu, start = cpu_seconds(pid), time.perf_counter()
        latencies = sorted(t for times in pool.map(client, range(clients)) for t in times)
        wall, cpu = time.perf_counter() - start, cpu_seconds(pid) - cpu
    p99 = latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))]
    return {"clients": clients, "requests": len(latencies), "p50_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * p99, "requests_per_s": len(latencies) / wall,
            "server_cpu_ms_per_request": 1000 * cpu / len(latencies), "load_average": os.getloadavg()[0]}


def flat(rows: list[dict], cold: dict[str, float]) -> dict[str, float]:
    """The keys issue 22 asks for, at mathlib scale with the new client's body: requests/s at 32 clients, p50 at 1
    client, p99 at 32, batched and unbatched, their ratios, and the cold starts."""
    out: dict[str, float] = {}
    for row in rows:
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
    out.update({f"cold_start_s_{key}": value for key, value in cold.items()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--preset", default="tiny", choices=["tiny", "byt5-small"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--skip-mathlib", action="store_true")
    parser.add_argument("--modes", default="batched,unbatched", help="which servers to measure, in this order")
    parser.add_argument("--serve-args", default="", help="more `leanagent serve` options, e.g. '--dtype bf16'")
    parser.add_argument("--bodies", default="new client,old client",
                        help="which request bodies to measure, in this order (the flat keys are the new client's)")
    parser.add_argument("--server-cpus", default="",
                        help="Linux: run the server on these CPUs (e.g. '0') and the clients on the others, so that "
                             "the load generator does not take the server's cores; default: both share every CPU")
    args = parser.parse_args()
    server_cpus = {int(c) for c in args.server_cpus.split(",") if c.strip()}
    client_cpus = set(range(os.cpu_count() or 1)) - server_cpus
    if server_cpus and not client_cpus:
        parser.error(f"--server-cpus {args.server_cpus}: leaves no CPU for the clients")
    kinds = [b.strip() for b in args.bodies.split(",") if b.strip()]
    if not kinds or set(kinds) - {"new client", "old client"}:
        parser.error(f"--bodies: 'new client', 'old client' or both, comma-separated; got {args.bodies!r}")
    rows, cold = [], {}
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    built = build(args.work, args.preset, args.device, not args.skip_mathlib)
    if server_cpus:
        os.sched_setaffinity(0, client_cpus)
    for name, (index, dataset) in built.items():
        pool = states(dataset)
        premises = json.loads((index / "index.json").read_text())["num_premises"]
        for mode in modes:
            served = Served(index, args.device, mode == "batched", pool[0], tuple(args.serve_args.split()),
                            server_cpus or None)
            cold[f"{name}_{mode}".replace("-", "_")] = served.cold_start_s
            print(f"{name:>14} {mode}: cold start {served.cold_start_s:.1f} s (command to first answer)", flush=True)
            try:
                for fmt in kinds:
                    payloads = bodies(served.url, pool, fmt, 512)
                    for clients in CLIENTS:
                        row = {"index": name, "premises": premises, "batching": mode == "batched", "body": fmt,
                               "body_kb": len(payloads[0]) / 1024,
                               **measure(served.url, payloads, clients, REQUESTS[clients], served.proc.pid)}
                        rows.append(row)
                        print(f"{name:>14} {premises:>6} premises  {mode:<9} {fmt:<10} ({row['body_kb']:6.1f} kB)  "
                              f"{clients:>2} clients  p50 {row['p50_ms']:7.1f} ms  p99 {row['p99_ms']:7.1f} ms  "
                              f"{row['requests_per_s']:7.1f} req/s  server CPU "
                              f"{row['server_cpu_ms_per_request']:6.1f} ms/request  load {row['load_average']:.1f}",
                              flush=True)
            finally:
                served.stop()
    summary = flat(rows, cold)
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "preset": args.preset, "cpus": os.cpu_count(),
                                         "server_cpus": sorted(server_cpus) or "all",
                                         "serve_args": args.serve_args, **summary, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
