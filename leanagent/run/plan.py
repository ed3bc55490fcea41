"""What a run of a config will do in its run_dir, found out reading only: the checks before anything is written.

One function, `plan_run`, for the flow (`flows/lifelong.py`, wherever it is started from: the CLI, a schedule, a
UI trigger, Python) and for `leanagent run` before it starts Prefect, so a bad input answers in a second or two:

1. the repositories: those `repos` lists, then every ready folder of `repos_dir`, by folder name;
2. the run_dir's manifest, if any: the same experiment (`run_state` fingerprint), and a sequence of repositories
   that the config extends at its end (`run_state.check_sequence`: none removed, renamed, reordered or edited,
   each dataset compared by the SHA-256 of its files);
3. the run's preflight (launcher, model, disk) and the validation of every dataset the run has not recorded
   with the same digests: a repository trained weeks ago is not read again, only hashed.

`repos_dir` is for uploads that arrive while runs come and go (a weekly schedule). Its readiness rule: a folder
whose name starts with "." is never read, so a dataset is copied in under a dot-name and renamed when complete
(`cp -r new DIR/.new && mv DIR/.new DIR/new`; a rename is atomic on one filesystem). A folder that does not
validate (a copy that did not follow the rule, a broken upload) is not an error: it is skipped for this run with
its first problem (file:line), listed as not ready, and read again by the next run. A folder the run has
already recorded is different: it is part of the run, and a change to it is refused like any other.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from leanagent.data.merge import dataset_files, digests
from leanagent.data.validate import validate_dataset
from leanagent.ground.config import ConfigError, PipelineConfig, RepoConfig
from leanagent.ground.job import JobInputError
from leanagent.preflight.checks import PreflightError, preflight_run
from leanagent.run.fingerprint import check_experiment
from leanagent.run.manifest import (
    MANIFEST_NAME,
    ManifestMismatchError,
    RepoEntry,
    read_manifest,
    recorded_sequence,
    waiting_repositories,
)
from leanagent.run.state import RunLockedError, RunStateWriteError, check_sequence

# What a refused run raises, each with one message naming the file, key or repository (PreflightError is a
# JobInputError): no traceback, nothing written.
BAD_INPUT = (ConfigError, ManifestMismatchError, RunLockedError, JobInputError)
# What ends a run in one line though nothing was wrong with its input: the manifest could not be written.
UNRECORDED = (RunStateWriteError,)


@dataclass(frozen=True)
class NotReady:
    """A folder of repos_dir skipped by this run, with the reason."""

    name: str
    path: Path
    problem: str

    def line(self) -> str:
        return f"{self.name}: not ready, skipped this run ({self.problem})"


@dataclass
class RunPlan:
    """The repositories of a run as the config gives them, checked against the run_dir."""

    repos: list[RepoConfig]  # `repos`, then the ready folders of repos_dir
    entries: dict[str, RepoEntry]  # by display name: the folder and its dataset's digests
    recorded: list[RepoEntry]  # the sequence the manifest holds ([] for a new run_dir), a prefix of every order
    not_ready: list[NotReady] = field(default_factory=list)
    manifest: dict | None = None  # as read

    def nothing_new(self) -> str | None:
        """`nothing new: 14 repositories trained, 0 waiting` when the run has nothing to do; None otherwise.

        Read without the run's lock: a run in progress has stages to run, so it never reads as nothing new."""
        waiting = waiting_repositories(self.manifest) if self.manifest is not None else []
        if self.new or waiting:
            return None
        return f"nothing new: {progress_line(len(self.recorded), 0, len(self.not_ready))}"

    @property
    def given(self) -> list[RepoEntry]:
        return [self.entries[r.display_name] for r in self.repos]

    @property
    def new(self) -> list[RepoConfig]:
        """The repositories the run has not recorded: they are ordered among themselves and appended."""
        known = {e.name for e in self.recorded}
        return [r for r in self.repos if r.display_name not in known]


def plan_run(cfg: PipelineConfig, free_bytes: int | None = None, device_count: int | None = None) -> RunPlan:
    """Every check of a run before anything is written: raises ConfigError, ManifestMismatchError or PreflightError
    (each naming the file, key or repository), or returns the plan.

    A run is planned once: `leanagent run` plans before it starts Prefect (a refusal answered in a second), and the
    flow it then runs in the same process takes that plan instead of hashing and validating every new dataset
    again, as long as nothing it read has changed since (`_inputs`: the config, the manifest, each dataset file's
    size and modification time, the folders of repos_dir)."""
    key = _inputs(cfg) if free_bytes is None and device_count is None else None
    cached = _LAST_PLAN.get(key) if key is not None else None
    if cached is not None and time.monotonic() - cached[0] < PLAN_FRESH_S:
        return cached[1]
    plan = _plan(cfg, free_bytes, device_count)
    if key is not None:
        _LAST_PLAN.clear()
        _LAST_PLAN[key] = (time.monotonic(), plan)
    return plan


# The last plan of this process, by what it read, and when. A served deployment plans in one process week after
# week: a plan older than this is made again, so the disk and the devices are checked as they are now.
_LAST_PLAN: dict[str, tuple[float, RunPlan]] = {}
PLAN_FRESH_S = 300.0


def _inputs(cfg: PipelineConfig) -> str:
    """What a plan reads, as one key: the config, and the size and modification time of the manifest, of every
    dataset file of the listed repositories and of repos_dir's folders (a new upload is a new key)."""
    files = [cfg.run_dir / MANIFEST_NAME]
    folders = [Path(r.path) for r in cfg.repos]
    if cfg.repos_dir is not None and cfg.repos_dir.is_dir():
        files.append(cfg.repos_dir)
        folders += sorted(p for p in cfg.repos_dir.iterdir() if p.is_dir())
    files += [folder / name for folder in folders for name in dataset_files(cfg.data.split)]
    stats = []
    for path in files:
        try:
            st = path.stat()
            stats.append((str(path), st.st_size, st.st_mtime_ns))
        except OSError:
            stats.append((str(path), None, None))
    return json.dumps([cfg.model_dump(mode="json"), stats], sort_keys=True, default=str)


def _plan(cfg: PipelineConfig, free_bytes: int | None, device_count: int | None) -> RunPlan:
    manifest_path = cfg.run_dir / MANIFEST_NAME
    manifest = read_manifest(manifest_path) if manifest_path.is_file() else None
    if manifest is not None:
        check_experiment(manifest_path, manifest, cfg)
    recorded = {e.name: e for e in recorded_sequence(manifest)} if manifest is not None else {}
    listed = list(cfg.repos)
    folders, not_ready, validated = _repos_dir(cfg, listed, recorded)
    repos = listed + folders
    entries = {r.display_name: _entry(r, cfg.data.split) for r in repos}
    given = [entries[r.display_name] for r in repos]
    sequence = check_sequence(manifest_path, manifest, given) if manifest is not None else []
    unread = [r for r in repos if r.display_name not in validated and not _unchanged(recorded.get(r.display_name),
                                                                                     entries[r.display_name])]
    preflight_run(cfg, repos, unread, free_bytes, device_count)
    return RunPlan(repos, entries, sequence, not_ready, manifest)


def progress_line(trained: int, waiting: Sequence[str] | int, not_ready: int = 0) -> str:
    """`14 repositories trained, 0 waiting`, or `4 repositories trained, 1 waiting (repo_4)` given the waiting
    names (and how many folders of repos_dir are not ready, after them: the names belong to "waiting")."""
    count = waiting if isinstance(waiting, int) else len(waiting)
    names = "" if isinstance(waiting, int) or not waiting else f" ({', '.join(waiting)})"
    line = f"{trained} {'repository' if trained == 1 else 'repositories'} trained, {count} waiting{names}"
    return line + (f", {not_ready} not ready in repos_dir" if not_ready else "")


def _entry(repo: RepoConfig, split: str) -> RepoEntry:
    path = Path(repo.path)
    return RepoEntry(repo.display_name, path, digests(path, split) if path.is_dir() else None)


def _unchanged(recorded: RepoEntry | None, now: RepoEntry) -> bool:
    """Recorded with these very files, so validated when it was recorded: not read again."""
    return recorded is not None and recorded.dataset is not None and recorded.dataset == now.dataset


def _repos_dir(cfg: PipelineConfig, listed: list[RepoConfig], recorded: dict[str, RepoEntry]
               ) -> tuple[list[RepoConfig], list[NotReady], set[str]]:
    """The folders of repos_dir as repositories (sorted by name), those skipped as not ready, and the names of
    those validated here.

    A folder the run has recorded is always taken, unread: a change to it is the sequence check's to refuse.
    """
    root = cfg.repos_dir
    if root is None:
        return [], [], set()
    if not root.is_dir():
        raise PreflightError(f"repos_dir {root}: no such folder")
    names = {r.display_name: r.path for r in listed}
    paths = {Path(r.path).resolve() for r in listed}
    ready: list[RepoConfig] = []
    skipped: list[NotReady] = []
    validated: set[str] = set()
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if folder.resolve() in paths:
            continue  # listed under `repos` as well: it is that repository
        repo = RepoConfig(path=folder)
        if folder.name in names:
            skipped.append(NotReady(folder.name, folder, f"named like the repository {names[folder.name]} of "
                                                         f"`repos`; rename one"))
            continue
        if folder.name in recorded:
            ready.append(repo)
            continue
        problems = validate_dataset(folder, cfg.data.split)
        validated.add(folder.name)
        if problems:
            more = f"; and {len(problems) - 1} more" if len(problems) > 1 else ""
            skipped.append(NotReady(folder.name, folder, f"{problems[0]}{more}"))
        else:
            ready.append(repo)
    return ready, skipped, validated
