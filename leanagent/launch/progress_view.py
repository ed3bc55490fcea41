"""The launcher's view of rank 0's progress: a live bar on a terminal, a plain line every N seconds elsewhere.

A bar is only readable where something redraws it; in CI logs and Prefect's run logs it would be
thousands of carriage returns, so there a `[progress] ...` line is printed through the same path as
the job's output, every `LEANAGENT_PROGRESS_INTERVAL` seconds (default 30). `LEANAGENT_PROGRESS=bar`,
`plain` or `off` overrides the choice made from whether stderr is a terminal.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from tqdm import tqdm

MODE_ENV = "LEANAGENT_PROGRESS"
INTERVAL_ENV = "LEANAGENT_PROGRESS_INTERVAL"
DEFAULT_INTERVAL_SECONDS = 30.0


def format_duration(seconds: float) -> str:
    """`4m10s`, `1h02m`, `35s`."""
    seconds = max(0, int(round(seconds)))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def rate_and_eta(p: Mapping[str, Any]) -> tuple[float | None, float | None]:
    """Examples per second and seconds left, from this attempt's own counts."""
    elapsed, done = float(p.get("elapsed") or 0.0), int(p.get("done") or 0)
    if elapsed <= 0 or done <= 0:
        return None, None
    rate = float(p.get("examples") or 0) / elapsed
    total, step = p.get("total"), int(p.get("step") or 0)
    eta = elapsed / done * max(0, int(total) - step) if total else None
    return rate, eta


def heading(label: str, p: Mapping[str, Any]) -> str:
    """`train repo_1`, or `train repo_1 (validate)` while the job is in another stage than its own."""
    stage = p.get("stage", "?")
    return label if label.split(" ", 1)[0] == stage else f"{label} ({stage})"


def epoch_text(p: Mapping[str, Any]) -> str | None:
    return f"epoch {p.get('epoch')}/{p['epochs']}" if p.get("epochs") else None


def speed_texts(p: Mapping[str, Any]) -> list[str]:
    """`32-true` (the precision the job runs in: `trainer.precision`, `auto` resolved), `85.2 examples/s` and
    `ETA 4m10s`, each when known."""
    rate, eta = rate_and_eta(p)
    return ([str(p["precision"])] if p.get("precision") else []) + \
        ([f"{rate:.1f} examples/s"] if rate is not None else []) + \
        ([f"ETA {format_duration(eta)}"] if eta is not None else [])


def describe(label: str, p: Mapping[str, Any]) -> str:
    """`train repo_1: epoch 2/5, step 120/400 (30%), bf16-mixed, 85.2 examples/s, ETA 4m10s`."""
    epoch = epoch_text(p)
    total, step = p.get("total"), int(p.get("step") or 0)
    parts = ([epoch] if epoch else []) + \
        [f"step {step}/{total} ({100 * step / total:.0f}%)" if total else f"step {step}"] + speed_texts(p)
    return f"{heading(label, p)}: {', '.join(parts)}"


def interval_from_env() -> float:
    try:
        value = float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL_SECONDS))
    except ValueError:
        return DEFAULT_INTERVAL_SECONDS
    return value if value > 0 else DEFAULT_INTERVAL_SECONDS


class PlainProgress:
    """`[progress] train repo_1: epoch 2/5, ...` through `emit`, at most every `interval_s` seconds."""

    def __init__(self, label: str, emit: Callable[[str], None], interval_s: float) -> None:
        self.label = label
        self.emit = emit
        self.interval_s = interval_s
        self._next = time.monotonic() + interval_s
        self._last: Mapping[str, Any] | None = None
        self._emitted: Mapping[str, Any] | None = None
        self._line = ""

    def update(self, progress: Mapping[str, Any]) -> None:
        self._last = progress
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.interval_s
            self._emit(progress)

    def _emit(self, progress: Mapping[str, Any]) -> None:
        line = f"[progress] {describe(self.label, progress)}"
        if line != self._line:  # a job that has not moved says nothing new
            self.emit(line)
        self._emitted, self._line = progress, line

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        yield

    def close(self) -> None:
        """Where the job ended: a job shorter than the interval still says how far it got."""
        if self._last is not None and self._last != self._emitted:
            self._emit(self._last)


class BarProgress:
    """A tqdm bar on stderr; job lines are printed above it (`writing`) instead of through it."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.bar: tqdm | None = None
        self._key: tuple | None = None

    def update(self, progress: Mapping[str, Any]) -> None:
        stage, total = progress.get("stage"), progress.get("total")
        key = (stage, total, progress.get("epochs"))
        if self.bar is None or key != self._key:
            self.close()
            self._key = key
            self.bar = tqdm(total=total, file=sys.stderr, dynamic_ncols=True, leave=False,
                            bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt}{postfix}")
        epoch = epoch_text(progress)
        self.bar.set_description_str(heading(self.label, progress) + (f" {epoch}" if epoch else ""), refresh=False)
        self.bar.set_postfix_str(", ".join(speed_texts(progress)), refresh=False)
        self.bar.n = int(progress.get("step") or 0)
        self.bar.refresh()

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        with tqdm.external_write_mode(file=sys.stderr):
            yield

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def progress_view(label: str, emit: Callable[[str], None], interval_s: float | None = None
                  ) -> PlainProgress | BarProgress | None:
    """The view for this process's output: bar on a terminal, plain lines elsewhere, None when switched off."""
    mode = os.environ.get(MODE_ENV, "auto").strip().lower()
    if mode == "off":
        return None
    if mode == "bar" or (mode != "plain" and sys.stderr.isatty()):
        return BarProgress(label)
    return PlainProgress(label, emit, interval_from_env() if interval_s is None else interval_s)
