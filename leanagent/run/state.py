"""The run manifest and the run_dir lock: what a lifelong run has finished, and who is running it.

Why a manifest at all: a lifelong run is a chain of jobs (train, Fisher, evaluations per
repository) that takes days; after a crash or a cancel the rerun must skip every finished stage
and never touch its checkpoint. The manifest is rewritten atomically after every stage, so a
reader (the UI, a rerun, a person) always sees a whole file.

Why a fingerprint: a rerun with a changed hyper-parameter would otherwise resume from
checkpoints trained under the old one and silently mix two experiments. Keys that cannot change
a result (where the run lives, how its jobs are launched, logging cadence, dataloader workers,
multi-node addressing) are left out of the fingerprint, so moving such a knob does not lock the user
out of their run. How a job is launched is `launcher` and every launcher's section, whatever launchers
exist: the fingerprint keeps only the keys the ground config itself interprets.

Why the repositories are not in the fingerprint: a lifelong run learns repositories that arrive
later. The fingerprint guards the experiment (model, data, trainer, lifelong settings); the
sequence of repositories is data that only grows at its end (`check_sequence`). Each recorded
repository keeps its position, name and dataset (the SHA-256 of every file the run reads), so a
removed, renamed, reordered or edited one is refused by name before anything is written.

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
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from leanagent.atomic import read_json, write_json_atomic
from leanagent.config import ABSENT_MEANS, PipelineConfig

MANIFEST_NAME = "manifest.json"
LOCK_NAME = ".lock"
# 2: the repositories left the fingerprint, each recorded with its dataset's digests; version 1 manifests load.
MANIFEST_VERSION = 2
# Where the run's repositories come from: the sequence, which may grow, not the experiment.
SEQUENCE_KEYS = ("repos", "repos_dir")
# Dotted keys that do not change what a run computes; see the module docstring (model.embed_premises: which
# premises are embedded, never what a premise's embedding or a context's ranking is). Not model.sort_by_length,
# model.token_budget or model.compile: beyond float rounding they change which dropout masks training draws.
RUN_IRRELEVANT_KEYS = (
    "run_dir",
    "launcher",
    "data.num_workers",
    "model.embed_premises",
    "trainer.log_every_n_steps",
    "trainer.node_rank",
    "trainer.rdzv_endpoint",
)


class RunLockedError(RuntimeError):
    """Another process holds the run_dir; nothing was written."""


class ManifestMismatchError(ValueError):
    """The run_dir holds another experiment, or a sequence of repositories the config does not extend; nothing
    was written."""


class RunStateWriteError(OSError):
    """The manifest could not be written (a full disk, a read-only folder); the file on disk is as it was."""


class ManifestUnreadableError(ManifestMismatchError):
    """The run_dir's manifest.json is cut short, not JSON, or not a manifest; nothing was written."""


def read_manifest(path: Path) -> dict[str, Any]:
    """A run's manifest.json, or ManifestUnreadableError naming the file, what is wrong and what to do (a file
    cut short by a full disk or a copy, or edited by hand, is never overwritten)."""
    try:
        data = read_json(path)
    except UnicodeDecodeError as exc:
        raise ManifestUnreadableError(f"{path}: not UTF-8 text (byte {exc.start}); {_UNREADABLE}") from None
    except json.JSONDecodeError as exc:
        raise ManifestUnreadableError(f"{path}: not valid JSON at line {exc.lineno} column {exc.colno} "
                                      f"({exc.msg}); {_UNREADABLE}") from None
    except OSError as exc:
        raise ManifestUnreadableError(f"{path}: cannot be read ({exc.strerror}); nothing was changed") from None
    if not isinstance(data, dict) or not isinstance(data.get("repos", {}), dict):
        raise ManifestUnreadableError(f"{path}: a JSON {type(data).__name__}, not a run manifest (an object with "
                                      f"\"repos\"); {_UNREADABLE}")
    return data


_UNREADABLE = ("it was cut short or edited. Restore it from a copy, or move the run_dir aside to start the run "
               "afresh; nothing was changed")


@dataclass(frozen=True)
class RepoEntry:
    """A repository as the sequence knows it: its display name, its folder, and {file: SHA-256} of its dataset
    (`leanagent.data.merge.digests`; None when its folder is missing, which the preflight reports)."""

    name: str
    path: Path
    dataset: dict[str, str] | None = None


def fingerprint_fields(cfg: PipelineConfig) -> dict[str, Any]:
    """The config as JSON, minus RUN_IRRELEVANT_KEYS, the repositories and the launchers' sections: what two runs
    must agree on to share a run_dir."""
    data = {key: value for key, value in cfg.model_dump(mode="json").items() if key in PipelineConfig.model_fields}
    for key in SEQUENCE_KEYS:
        data.pop(key, None)
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


TRAIN, FISHER, EVAL_UNTRAINED, MERGE = "train", "fisher", "eval-untrained", "merge"


def eval_stage(target_index: int, target_name: str) -> str:
    """The evaluation, after training on a repository, of the model on repository `target_index`'s test split."""
    return f"eval-{target_index:02d}-{target_name}"


def stage_name(index: int, name: str, stage: str) -> str:
    """`00-name/train`, `00-name/fisher`, `00-name/eval-01-other`: also the job folder under run_dir/jobs."""
    return f"{repo_key(index, name)}/{stage}"


def repo_stages(index: int, names: list[str], merged: bool = False) -> list[str]:
    """Every stage of repository `index` of the sequence `names`: its untrained evaluation, (its merge,) its
    training, its Fisher, and the evaluations of its model on repositories 0..index."""
    name = names[index]
    stages = [EVAL_UNTRAINED, *([MERGE] if merged else []), TRAIN, FISHER,
              *(eval_stage(j, names[j]) for j in range(index + 1))]
    return [stage_name(index, name, stage) for stage in stages]


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
        self._lock_or_refuse(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def probe(self) -> None:
        """Refuse now, writing nothing, when another process holds the lock (`leanagent run` asks before it starts
        Prefect). A shared lock, taken and let go at once: no lock file means nobody holds it."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return
        self._lock_or_refuse(fd, fcntl.LOCK_SH)
        os.close(fd)

    def _lock_or_refuse(self, fd: int, kind: int) -> None:
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunLockedError(f"{self.path.parent} is in use by another run (pid {holder}); wait for it to end, "
                                 f"or choose another run_dir") from None

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
        self._stored: str | None = None  # the manifest as read: `extend` writes only what differs from it
        if self.path.is_file():
            self.data: dict[str, Any] = read_manifest(self.path)
            self._stored = json.dumps(self.data, sort_keys=True)
            _check_config(self.path, self.data, fields)
            self.data["given"] = _given_before(self.data)  # a version 1 manifest has it in the config replaced next
            # Only knobs added since, at their defaults (or none): the same experiment, in today's terms.
            self.data["fingerprint"], self.data["config"] = fingerprint, fields
        else:
            self.data = {"version": MANIFEST_VERSION, "fingerprint": fingerprint, "config": fields, "order": None,
                         "repos": {}, "created_at": _now()}

    def extend(self, ordered: list[RepoEntry], given: list[RepoEntry]) -> None:
        """Record the run's sequence: the recorded repositories (checked against `given` again, under the lock),
        then the new ones of `ordered`. The manifest is written only when something changed."""
        recorded = check_sequence(self.path, self.data, given)
        if [e.name for e in ordered[: len(recorded)]] != [e.name for e in recorded]:
            raise ManifestMismatchError(
                f"{self.path}: another run recorded the repositories {[e.name for e in recorded]} while this one was "
                f"being checked (it ordered {[e.name for e in ordered]}); nothing was written: run it again")
        for i, entry in enumerate(ordered):
            repo = self.data["repos"].setdefault(repo_key(i, entry.name), {"index": i, "name": entry.name,
                                                                           "stages": {}})
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
        return _entry(self.data, name)

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
        self.data["version"] = MANIFEST_VERSION
        self.data["updated_at"] = _now()
        try:
            write_json_atomic(self.path, self.data)
        except OSError as exc:  # the atomic write leaves the manifest as it was
            raise RunStateWriteError(f"{self.path}: could not be written ({exc.strerror or exc}); free space on its "
                                     f"disk (or make its folder writable) and rerun the same command: what the "
                                     f"manifest holds is kept, and an unrecorded stage runs again") from None
        self._stored = json.dumps(self.data, sort_keys=True)


def check_experiment(path: Path, manifest: dict[str, Any], cfg: PipelineConfig) -> None:
    """Refuse a manifest of another experiment (`path` names it in the message); reads nothing itself."""
    _check_config(path, manifest, fingerprint_fields(cfg))


def _check_config(path: Path, manifest: dict[str, Any], fields: dict[str, Any]) -> None:
    # A version 1 manifest's config holds the repositories: they are the sequence, checked on their own.
    old = {k: v for k, v in manifest.get("config", {}).items() if k not in SEQUENCE_KEYS}
    if config_changes(old, fields):
        raise ManifestMismatchError(
            f"{path} belongs to a run of a different config ({describe_differences(old, fields)}); resuming it would "
            f"mix two experiments. Restore the config or choose another run_dir.")


def recorded_sequence(manifest: dict[str, Any]) -> list[RepoEntry]:
    """The repositories a manifest has recorded, in their order (a version 1 manifest's have no digests)."""
    repos = manifest.get("repos", {})
    out = []
    for i, name in enumerate(manifest.get("order") or []):
        repo = repos.get(repo_key(i, name), {})
        out.append(RepoEntry(name, Path(repo.get("path", "")), repo.get("dataset")))
    return out


def _given_before(manifest: dict[str, Any]) -> list[str]:
    """The names in the order the run's config gave them (a version 1 manifest has them in its config)."""
    if manifest.get("given") is not None:
        return list(manifest["given"])
    listed = manifest.get("config", {}).get("repos") or []
    return [r.get("name") or Path(r.get("path", "")).name for r in listed if isinstance(r, dict)]


def check_sequence(path: Path, manifest: dict[str, Any], given: list[RepoEntry]) -> list[RepoEntry]:
    """The recorded sequence, once every repository of it is found in `given` under its name, with the same dataset
    and in the same relative order as before; raises ManifestMismatchError naming the first one that is not.

    A run only grows at its end: its checkpoints, Fisher files and results were trained in this order on these
    datasets, so a repository removed, renamed, reordered or edited would make the run a mix of two experiments.
    """
    recorded = recorded_sequence(manifest)
    known = {e.name for e in recorded}
    by_name = {e.name: e for e in given}
    for i, old in enumerate(recorded):
        new = by_name.get(old.name)
        where = f"repository {old.name!r} (#{i + 1} of this run's sequence, {old.path})"
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
    old_given = _given_before(manifest)
    now = [e.name for e in given if e.name in known and e.name in old_given]
    before = [n for n in old_given if n in now]
    if now != before:
        k = next(k for k, (a, b) in enumerate(zip(before, now, strict=True)) if a != b)
        raise ManifestMismatchError(
            f"{path}: the config lists repository {now[k]!r} before {before[k]!r}, but this run was given "
            f"{before[k]!r} first; restore the order (new repositories go after the recorded ones either way), "
            f"or choose another run_dir")
    return recorded


def _short(digest: str | None) -> str:
    return "missing" if digest in (None, "missing") else str(digest)[:12]


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def waiting_repositories(manifest: dict[str, Any]) -> list[str]:
    """The repositories of a manifest's sequence with a stage still to run (not finished, failed or interrupted)."""
    names = list(manifest.get("order") or [])
    merged = manifest.get("config", {}).get("lifelong", {}).get("dataset_strategy") == "merge_all"
    return [names[i] for i in range(len(names))
            if any(_finished_result(_entry(manifest, stage)) is None for stage in repo_stages(i, names, merged))]


def _entry(manifest: dict[str, Any], stage: str) -> dict[str, Any] | None:
    key, _, name = stage.partition("/")
    return manifest.get("repos", {}).get(key, {}).get("stages", {}).get(name)


def stage_result(manifest: dict[str, Any], index: int, name: str, stage: str) -> dict | None:
    """A finished stage's result from a manifest read from disk; None if it has not finished."""
    return _finished_result(_entry(manifest, stage_name(index, name, stage)))


def _finished_result(entry: dict[str, Any] | None) -> dict | None:
    """What "finished" means, for the flow resuming a run and for a report read from disk alike."""
    return entry["result"] if entry and entry.get("status") == "done" else None


INDEX_DIR = "index"  # run_dir/index/00-name: the premise index of the stage trained through that repository


def stage_indexes(manifest: dict[str, Any]) -> list[tuple[int, str, str]]:
    """(position, repository, index folder) of every finished stage whose evaluation wrote a premise index, in
    the run's order: a stage is finished when its evaluations of every repository seen so far are done."""
    names = list(manifest.get("order") or [])
    out = []
    for i, name in enumerate(names):
        evaluations = [stage_result(manifest, i, name, eval_stage(j, names[j])) for j in range(i + 1)]
        if any(e is None for e in evaluations):
            continue
        jobs = [e.get("job") for e in evaluations if isinstance(e, dict)]
        folder = next((job["index"] for job in jobs if isinstance(job, dict) and isinstance(job.get("index"), str)),
                      None)
        if folder is not None:
            out.append((i, name, folder))
    return out
