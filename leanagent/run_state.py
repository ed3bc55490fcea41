"""The run manifest and the run_dir lock: what a lifelong run has finished, and who is running it.

Why a manifest at all: a lifelong run is a chain of jobs (train, Fisher, evaluations per
repository) that takes days; after a crash or a cancel the rerun must skip every finished stage
and never touch its checkpoint. The manifest is rewritten atomically after every stage, so a
reader (the UI, a rerun, a person) always sees a whole file.

Why a fingerprint: a rerun with a changed hyper-parameter would otherwise resume from
checkpoints trained under the old one and silently mix two experiments. Keys that cannot change
a result (where the run lives, logging cadence, dataloader workers, multi-node addressing) are
left out of the fingerprint, so moving such a knob does not lock the user out of their run.

Why a lock: two flows writing one run_dir would race on the same job folders. The lock is an
fcntl.flock, so the kernel releases it when the holder dies and a stale lock file never blocks.
This module knows nothing of Prefect: the flow is one caller among others.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from leanagent.atomic import read_json, write_json_atomic
from leanagent.config import ABSENT_MEANS, PipelineConfig

MANIFEST_NAME = "manifest.json"
LOCK_NAME = ".lock"
MANIFEST_VERSION = 1
# Dotted keys that do not change what a run computes; see the module docstring. Not model.sort_by_length,
# model.token_budget or model.compile: beyond float rounding they change which dropout masks training draws.
RUN_IRRELEVANT_KEYS = (
    "run_dir",
    "launcher",
    "slurm",
    "data.num_workers",
    "trainer.log_every_n_steps",
    "trainer.node_rank",
    "trainer.rdzv_endpoint",
)


class RunLockedError(RuntimeError):
    """Another process holds the run_dir; nothing was written."""


class ManifestMismatchError(ValueError):
    """The run_dir holds a run of a different config or repository order; nothing was written."""


def fingerprint_fields(cfg: PipelineConfig) -> dict[str, Any]:
    """The config as JSON, minus RUN_IRRELEVANT_KEYS: what two runs must agree on to share a run_dir."""
    data = cfg.model_dump(mode="json")
    for dotted in RUN_IRRELEVANT_KEYS:
        *parents, leaf = dotted.split(".")
        node = data
        for key in parents:
            node = node.get(key, {})
        node.pop(leaf, None)
    return data


def config_fingerprint(cfg: PipelineConfig) -> str:
    canonical = json.dumps(fingerprint_fields(cfg), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def repo_key(index: int, name: str) -> str:
    """`00-name`: the index keeps two repositories of one display name apart and sorts in curriculum order."""
    return f"{index:02d}-{name}"


TRAIN, FISHER, EVAL_UNTRAINED = "train", "fisher", "eval-untrained"


def eval_stage(target_index: int, target_name: str) -> str:
    """The evaluation, after training on a repository, of the model on repository `target_index`'s test split."""
    return f"eval-{target_index:02d}-{target_name}"


def stage_name(index: int, name: str, stage: str) -> str:
    """`00-name/train`, `00-name/fisher`, `00-name/eval-01-other`: also the job folder under run_dir/jobs."""
    return f"{repo_key(index, name)}/{stage}"


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`key: old -> new` for every difference that matters.

    A key absent from the stored config is a knob added by a later version of leanagent; the run was computed
    at the value that reproduces the old behaviour: `ABSENT_MEANS` where that is not today's default (an old
    run without `model.sort_by_length` padded its pools: it continues under false only), else the default.
    At that value it is not a change.
    """
    a, b = _flatten(old), _flatten(new)
    before = {**_flatten(fingerprint_fields(PipelineConfig())), **ABSENT_MEANS}
    return [f"{k}: {_stored(a, before, k)} -> {b.get(k, '(absent)')!r}" for k in sorted(a.keys() | b.keys())
            if a.get(k) != b.get(k) and not (k not in a and k in before and b.get(k) == before[k])]


def _stored(old: dict[str, Any], before: dict[str, Any], key: str) -> str:
    if key in old:
        return repr(old[key])
    return f"(absent: {before[key]!r})" if key in ABSENT_MEANS else repr("(absent)")


def describe_differences(old: dict[str, Any], new: dict[str, Any], limit: int = 10) -> str:
    diffs = config_changes(old, new)
    more = f" (and {len(diffs) - limit} more)" if len(diffs) > limit else ""
    return "; ".join(diffs[:limit]) + more


class RunLock:
    """An exclusive, non-blocking flock on run_dir/.lock, holding the owner's pid for the error message."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        """Take the lock (once: acquiring a held lock again is a no-op, so `with lock:` may follow)."""
        if self._fd is not None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunLockedError(f"{self.path.parent} is in use by another run (pid {holder}); wait for it to end, "
                                 f"or choose another run_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        # Truncate first: a reader between unlock and close must not blame a pid that has let go.
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


class RunState:
    """The manifest of one run_dir. Open it while holding the RunLock; every change is written at once."""

    def __init__(self, run_dir: Path, cfg: PipelineConfig) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / MANIFEST_NAME
        fields = fingerprint_fields(cfg)
        fingerprint = config_fingerprint(cfg)
        if self.path.is_file():
            self.data: dict[str, Any] = read_json(self.path)
            _check_config(self.path, self.data, fields)
            # Only knobs added since, at their defaults (or none): the same experiment, in today's terms.
            self.data["fingerprint"], self.data["config"] = fingerprint, fields
        else:
            self.data = {"version": MANIFEST_VERSION, "fingerprint": fingerprint, "config": fields, "order": None,
                         "repos": {}, "created_at": _now()}

    @staticmethod
    def check(run_dir: Path, cfg: PipelineConfig, order: list[str]) -> None:
        """Refuse, reading only, a run_dir that holds another experiment: before anything is written there."""
        path = Path(run_dir) / MANIFEST_NAME
        if path.is_file():
            data = read_json(path)
            _check_config(path, data, fingerprint_fields(cfg))
            _check_order(path, data, order)

    def set_order(self, order: list[str], paths: list[Path]) -> None:
        """Record the curriculum order, or refuse when the run_dir was started with another one."""
        _check_order(self.path, self.data, order)
        self.data["order"] = list(order)
        for i, (name, path) in enumerate(zip(order, paths, strict=True)):
            self.data["repos"].setdefault(repo_key(i, name), {"index": i, "name": name, "path": str(path),
                                                              "stages": {}})
        self._write()

    def _stage(self, name: str) -> dict[str, Any] | None:
        key, _, stage = name.partition("/")
        repo = self.data["repos"].get(key)
        return None if repo is None else repo["stages"].get(stage)

    def stage_done(self, name: str) -> dict | None:
        """The result of a finished stage, or None when it still has to run."""
        return _finished_result(self._stage(name))

    def start(self, name: str) -> None:
        self._set(name, {"status": "running", "started_at": _now()})

    def record(self, name: str, result: dict) -> None:
        entry = self._stage(name) or {}
        self._set(name, {**entry, "status": "done", "result": result, "finished_at": _now()})

    def fail(self, name: str, error: str) -> None:
        entry = self._stage(name) or {}
        self._set(name, {**entry, "status": "failed", "error": error, "failed_at": _now()})

    def interrupt(self, name: str, reason: str) -> None:
        """The stage was stopped from outside (Ctrl-C, SIGTERM, a cancelled flow run): not done, it reruns."""
        entry = self._stage(name) or {}
        self._set(name, {**entry, "status": "interrupted", "reason": reason, "interrupted_at": _now()})

    def _set(self, name: str, entry: dict[str, Any]) -> None:
        key, _, stage = name.partition("/")
        if key not in self.data["repos"] or not stage:
            raise KeyError(f"{name}: not a stage of this run (known repositories: {list(self.data['repos'])})")
        self.data["repos"][key]["stages"][stage] = entry
        self._write()

    def _write(self) -> None:
        self.data["updated_at"] = _now()
        write_json_atomic(self.path, self.data)


def _check_config(path: Path, manifest: dict[str, Any], fields: dict[str, Any]) -> None:
    old = manifest.get("config", {})
    if config_changes(old, fields):
        raise ManifestMismatchError(
            f"{path} belongs to a run of a different config ({describe_differences(old, fields)}); resuming it would "
            f"mix two experiments. Restore the config or choose another run_dir.")


def _check_order(path: Path, manifest: dict[str, Any], order: list[str]) -> None:
    known = manifest.get("order")
    if known is not None and list(known) != list(order):
        raise ManifestMismatchError(
            f"{path} was started with the repository order {known}, but this run orders them {order} "
            f"(did a dataset change?); resuming would mix two experiments. Choose another run_dir.")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def stage_result(manifest: dict[str, Any], index: int, name: str, stage: str) -> dict | None:
    """A finished stage's result from a manifest read from disk; None if it has not finished."""
    return _finished_result(manifest.get("repos", {}).get(repo_key(index, name), {}).get("stages", {}).get(stage))


def _finished_result(entry: dict[str, Any] | None) -> dict | None:
    """What "finished" means, for the flow resuming a run and for a report read from disk alike."""
    return entry["result"] if entry and entry.get("status") == "done" else None
