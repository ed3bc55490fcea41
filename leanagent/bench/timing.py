"""How the bench times things on a shared, noisy machine: rates over a minimum time, best-of-rounds; another
process's memory (this process's: `leanagent.ground.timings`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch


def process_rss_mb(pid: int) -> float:
    """Another process's resident memory now, in MiB (this process's: `leanagent.ground.timings.rss_mb`)."""
    return psutil.Process(pid).memory_info().rss / 2**20


def process_peak_rss_mb(pid: int) -> float:
    """Another process's resident high-water mark, in MiB: Linux's VmHWM, read by hand (psutil has no peak; this
    process's: `leanagent.ground.timings.peak_rss_mb`)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmHWM")


def rate(fn: Callable[[], int], min_seconds: float, min_calls: int = 3) -> float:
    """Items per second of `fn` (which returns how many items it did), after one warm-up call."""
    fn()
    done, calls, start = 0, 0, time.perf_counter()
    while calls < min_calls or time.perf_counter() - start < min_seconds:
        done += fn()
        calls += 1
    return done / (time.perf_counter() - start)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_of_rounds(passes: dict[str, Callable[[], Any]], device: torch.device, min_seconds: float,
                   rounds: int = 2) -> tuple[dict[str, float], dict[str, Any]]:
    """Seconds of each pass, the best of at least `rounds` rounds in which the passes take turns, and what each
    pass returned last. These machines are shared: interleaving gives every pass the same neighbours, and other
    work only ever slows a pass down, so its fastest round is the closest to its own cost."""
    best = {name: float("inf") for name in passes}
    last: dict[str, Any] = {}
    done, start = 0, time.perf_counter()
    while done < rounds or time.perf_counter() - start < min_seconds * len(passes):
        for name, run in passes.items():
            t0 = time.perf_counter()
            last[name] = run()
            sync(device)
            best[name] = min(best[name], time.perf_counter() - t0)
        done += 1
    return best, last


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def median_seconds(fn: Callable[[], Any], repeats: int, device: torch.device | None = None) -> float:
    """The median seconds of `repeats` calls of `fn`, after one warm-up call (the first allocates)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if device is not None:
            sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
