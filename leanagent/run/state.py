"""The run_dir lock and the manifest's writer: who is running a run, and what it has finished.

The sequence of repositories only grows at its end (`check_sequence`): each recorded repository keeps its position,
name and dataset (the SHA-256 of every file the run reads), so a removed, renamed, reordered or edited one is
refused by name before anything is written.

Why a lock: two flows writing one run_dir would race on the same job folders. The lock is an fcntl.flock
(`leanagent.ground.pid_lock`), so the kernel releases it when the holder dies and a stale lock file never blocks.
This module knows nothing of Prefect: the flow is one caller among others.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from leanagent.ground.atomic import write_json_atomic
from leanagent.ground.config import PipelineConfig
from leanagent.ground.names import AUTO
from leanagent.ground.pid_lock import LockHeld, PidLock
from leanagent.run.fingerprint import (
    DECIDED_BY_THE_RUN,
    check_config,
    fields_fingerprint,
    fingerprint_fields,
    keep_decided,
    recorded_setting,
    set_setting,
)
from leanagent.run.manifest import (
    MANIFEST_NAME,
    MANIFEST_VERSION,
    ManifestMismatchError,
    RepoEntry,
    finished_result,
    given_before,
    read_manifest,
    recorded_sequence,
    repo_key,
    stage_entry,
    waiting_repositories,
)

LOCK_NAME = ".lock"


class RunLockedError(RuntimeError):
    """Another process holds the run_dir; nothing was written."""


class RunStateWriteError(OSError):
    """The manifest could not be written (a full disk, a read-only folder); the file on disk is as it was."""


class RunLock(PidLock):
    """An exclusive, non-blocking flock on run_dir/.lock, holding the owner's pid for the error message."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(Path(run_dir) / LOCK_NAME)

    def acquire(self, wait_s: float = 0.0, on_wait: Callable[[str], None] | None = None) -> RunLock:
        """Take the lock (once: acquiring a held lock again is a no-op, so `with lock:` may follow)."""
        try:
            super().acquire(wait_s, on_wait)
        except LockHeld as exc:
            raise self._refusal(exc) from None
        return self

    def probe(self) -> None:
        """Refuse now, writing nothing, when another process holds the lock (`leanagent run` asks before it starts
        Prefect)."""
        try:
            super().probe()
        except LockHeld as exc:
            raise self._refusal(exc) from None

    def _refusal(self, exc: LockHeld) -> RunLockedError:
        return RunLockedError(f"{self.path.parent} is in use by another run (pid {exc.holder}); wait for it to end, "
                              f"or choose another run_dir")


class RunState:
    """The manifest of one run_dir. Open it while holding the RunLock; every change is written at once."""

    def __init__(self, run_dir: Path, cfg: PipelineConfig) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / MANIFEST_NAME
        self._stored: str | None = None  # the manifest as read: `extend` writes only what differs from it
        stored = read_manifest(self.path) if self.path.is_file() else None
        given = given_before(stored) if stored is not None else []  # a version 1 manifest has it in its config
        fields = fingerprint_fields(cfg)
        if stored is not None:
            self.data: dict[str, Any] = stored
            self._stored = json.dumps(self.data, sort_keys=True)
            check_config(self.path, self.data, fields)
            self.data["given"] = given
            # Only knobs added since, at their defaults (or none): the same experiment, in today's terms; what the
            # run decided (its precision) where the config says auto.
            fields = keep_decided(self.data.get("config") or {}, fields)
            self.data["fingerprint"], self.data["config"] = fields_fingerprint(fields), fields
        else:
            self.data = {"version": MANIFEST_VERSION, "fingerprint": fields_fingerprint(fields), "config": fields,
                         "order": None, "repos": {}, "created_at": _now()}

    def decided(self, cfg: PipelineConfig) -> PipelineConfig:
        """`cfg` as this run continues it, the config its jobs get: each setting the run decided (DECIDED_BY_THE_RUN:
        the precision its first job ran under `trainer.precision: auto`) at the recorded value where `cfg` says
        auto, so that a run goes on in its precision on a CPU that would resolve auto otherwise."""
        data = cfg.model_dump(mode="json")
        kept = keep_decided(self.data["config"], data)
        return cfg if kept == data else PipelineConfig.model_validate(kept)

    def extend(self, ordered: list[RepoEntry], given: list[RepoEntry], given_by: str | None = None) -> None:
        """Record the run's sequence: the recorded repositories (checked against `given` again, under the lock),
        then the new ones of `ordered`, each with the config that gave it (`given_by`, its file). The manifest is
        written only when something changed; a config the run is ahead of changes nothing."""
        recorded = check_sequence(self.path, recorded_sequence(self.data), self.data.get("given") or [], given)
        beyond = ahead_of(recorded, given)
        if beyond:
            if [e.name for e in ordered] != [e.name for e in recorded[: len(recorded) - len(beyond)]]:
                raise ManifestMismatchError(f"{self.path}: the run's sequence changed while this run was being "
                                            f"checked; nothing was written: run it again")
            return
        if [e.name for e in ordered[: len(recorded)]] != [e.name for e in recorded]:
            raise ManifestMismatchError(
                f"{self.path}: another run recorded the repositories {[e.name for e in recorded]} while this one was "
                f"being checked (it ordered {[e.name for e in ordered]}); nothing was written: run it again")
        for i, entry in enumerate(ordered):
            repo = self.data["repos"].setdefault(repo_key(i, entry.name), {"index": i, "name": entry.name,
                                                                           "given_by": given_by, "stages": {}})
            repo["path"] = str(entry.path)  # a folder moved with its data unchanged is the same repository
            if entry.dataset is not None:
                repo["dataset"] = dict(entry.dataset)
        self.data["order"] = [e.name for e in ordered]
        self.data["given"] = [e.name for e in given]
        if json.dumps(self.data, sort_keys=True) != self._stored:
            self._write()

    def waiting(self) -> list[str]:
        """The repositories of the recorded sequence with a stage still to run."""
        return waiting_repositories(self.data)

    def _stage(self, name: str) -> dict[str, Any] | None:
        return stage_entry(self.data, name)

    def stage_done(self, name: str) -> dict | None:
        """The result of a finished stage, or None when it still has to run."""
        return finished_result(self._stage(name))

    def start(self, name: str) -> None:
        self._set(name, {"status": "running", "started_at": _now()})

    def record(self, name: str, result: dict) -> None:
        """The stage is done with `result`; the first result of a run whose config says `auto` for a setting the run
        decides (DECIDED_BY_THE_RUN) records what that job ran as the run's value."""
        for dotted, key in DECIDED_BY_THE_RUN.items():
            if recorded_setting(self.data["config"], dotted) == AUTO and isinstance(result.get(key), str):
                set_setting(self.data["config"], dotted, result[key])
                self.data["fingerprint"] = fields_fingerprint(self.data["config"])
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
        self.data["version"] = MANIFEST_VERSION
        self.data["updated_at"] = _now()
        try:
            write_json_atomic(self.path, self.data)
        except OSError as exc:  # the atomic write leaves the manifest as it was
            raise RunStateWriteError(f"{self.path}: could not be written ({exc.strerror or exc}); free space on its "
                                     f"disk (or make its folder writable) and rerun the same command: what the "
                                     f"manifest holds is kept, and an unrecorded stage runs again") from None
        self._stored = json.dumps(self.data, sort_keys=True)


def check_sequence(path: Path, recorded: list[RepoEntry], old_given: list[str], given: list[RepoEntry]
                   ) -> list[RepoEntry]:
    """The recorded sequence (`recorded_sequence` of the manifest at `path`), once every repository of it is found in
    `given` under its name, with the same dataset and in the same relative order as the run's configs gave them
    (`old_given`, `given_before`); raises ManifestMismatchError naming the first one that is not.

    A run only grows at its end: its checkpoints, Fisher files and results were trained in this order on these
    datasets, so a repository removed, renamed, reordered or edited would make the run a mix of two experiments.
    A config that lists the beginning of the sequence and nothing new (the run's first config, rerun after a
    continuation added repositories) is not refused: the run is ahead of it (`ahead_of`).
    """
    known = {e.name for e in recorded}
    by_name = {e.name: e for e in given}
    ahead = {e.name for e in ahead_of(recorded, given)}
    for i, old in enumerate(recorded):
        new = by_name.get(old.name)
        where = f"repository {old.name!r} (#{i + 1} of this run's sequence, {old.path})"
        if new is None and old.name in ahead:
            continue
        if new is None:
            renamed = next((e for e in given if e.name not in known and (
                e.path == old.path or (old.dataset is not None and e.dataset == old.dataset))), None)
            if renamed is not None:
                raise ManifestMismatchError(
                    f"{path}: {where} is now named {renamed.name!r}; its job folders and results are kept under its "
                    f"name, so restore the name {old.name!r} (or choose another run_dir)")
            raise ManifestMismatchError(
                f"{path}: {where} is not in the config any more; a run only grows at its end, so put it back "
                f"(or choose another run_dir)")
        if old.dataset is not None and new.dataset is not None and new.dataset != old.dataset:
            file = next(f for f in sorted(old.dataset.keys() | new.dataset.keys())
                        if old.dataset.get(f) != new.dataset.get(f))
            raise ManifestMismatchError(
                f"{path}: the dataset of {where} changed since the run recorded it ({new.path / file}: sha256 "
                f"{_short(old.dataset.get(file))}, now {_short(new.dataset.get(file))}); restore it, give the new "
                f"data another name (a new repository), or choose another run_dir")
    now = [e.name for e in given if e.name in known and e.name in old_given]
    before = [n for n in old_given if n in now]
    if now != before:
        k = next(k for k, (a, b) in enumerate(zip(before, now, strict=True)) if a != b)
        raise ManifestMismatchError(
            f"{path}: the config lists repository {now[k]!r} before {before[k]!r}, but this run was given "
            f"{before[k]!r} first; restore the order (new repositories go after the recorded ones either way), "
            f"or choose another run_dir")
    return recorded


def ahead_of(recorded: list[RepoEntry], given: list[RepoEntry]) -> list[RepoEntry]:
    """The recorded repositories the run has beyond a config that lists the beginning of its sequence and nothing
    new (every repository it gives is recorded, and those it leaves out all come after them); [] otherwise."""
    names = {e.name for e in given}
    if not names <= {e.name for e in recorded}:
        return []  # something new: a continuation, which must list every recorded repository
    listed = len(names)
    if {e.name for e in recorded[:listed]} != names:
        return []  # a hole in the middle: refused by name
    return recorded[listed:]


def _short(digest: str | None) -> str:
    return "missing" if digest in (None, "missing") else str(digest)[:12]


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
