"""What a run of a config will do in its run_dir, found out reading only: the checks before anything is written.

One function, `plan_run`, makes the plan a run follows, once: `leanagent run` makes it before it starts Prefect (so
a bad input answers in a second or two) and hands it to the flow, and the flow makes it itself when a deployment
starts it (a schedule, a UI trigger). Nothing keeps a plan between runs: each run checks the disk, the devices and
the datasets as they are when it starts.

1. the repositories: those `repos` lists, then every ready folder of `repos_dir`, by folder name;
2. the run_dir's manifest, if any: the same experiment (`run_state` fingerprint), and a sequence of repositories
   that the config extends at its end, or of which it lists the beginning (`run_state.check_sequence`: none
   removed from the middle, renamed, reordered or edited, each dataset compared by the SHA-256 of its files). A
   config that lists only the beginning is behind the run, not against it: it has nothing new (`RunPlan.ahead`);
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

from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from leanagent.data.merge import digests
from leanagent.data.validate import validate_dataset
from leanagent.ground.config import ConfigError, PipelineConfig, RepoConfig
from leanagent.ground.job import JobInputError
from leanagent.ground.results import ResultUnreadableError
from leanagent.preflight.checks import PreflightError, preflight_run
from leanagent.run.fingerprint import check_experiment
from leanagent.run.manifest import (
    MANIFEST_NAME,
    ManifestMismatchError,
    RepoEntry,
    given_before,
    read_manifest,
    recorded_sequence,
    repo_key,
    waiting_repositories,
)
from leanagent.run.state import RunLockedError, RunStateWriteError, check_sequence

# What a refused run raises, each with one message naming the file, key or repository (PreflightError is a
# JobInputError; a finished job's result.json that is not one, a ResultUnreadableError): no traceback, nothing
# written.
BAD_INPUT = (ConfigError, ManifestMismatchError, RunLockedError, JobInputError, ResultUnreadableError)
# What ends a run in one line though nothing was wrong with its input: the manifest could not be written.
UNRECORDED = (RunStateWriteError,)
INLINE = "a config given inline"  # where a config handed over as a value (the UI form, Python) came from


class NotReady(BaseModel):
    """A folder of repos_dir skipped by this run, with the reason."""

    name: str
    path: Path
    problem: str

    def line(self) -> str:
        return f"{self.name}: not ready, skipped this run ({self.problem})"


class Ahead(BaseModel):
    """A repository the run has recorded after all those the config lists, and the config that gave it."""

    name: str
    given_by: str | None = None


class RunPlan(BaseModel):
    """A run of a config, checked against its run_dir: what `leanagent run` hands to the flow (a flow parameter, so
    typed and JSON-serializable), and what the flow makes itself when a deployment starts it."""

    model_config = ConfigDict(frozen=True)

    cfg: PipelineConfig
    source: str  # where the config came from: its file as given, or INLINE; recorded with the repositories it adds
    repos: list[RepoConfig]  # `repos`, then the ready folders of repos_dir
    entries: dict[str, RepoEntry]  # by display name: the folder and its dataset's digests
    recorded: list[RepoEntry]  # the sequence the manifest holds ([] for a new run_dir), a prefix of every order
    not_ready: list[NotReady] = []
    waiting: list[str] = []  # repositories of this config the manifest has with a stage still to run
    ahead: list[Ahead] = []  # the recorded repositories after the last one this config lists

    def nothing_new(self) -> str | None:
        """`nothing new: 14 repositories trained, 0 waiting`, or `nothing new: the run is ahead of this config
        (repo_3, from demo/more.yaml)`, when the run has nothing to do; None otherwise.

        Read without the run's lock: a run in progress has stages to run, so it never reads as nothing new."""
        if self.new or self.waiting:
            return None
        if self.ahead:
            return f"nothing new: the run is ahead of this config ({describe_ahead(self.ahead)})"
        return f"nothing new: {progress_line(len(self.recorded), 0, len(self.not_ready))}"

    @property
    def given(self) -> list[RepoEntry]:
        return [self.entries[r.display_name] for r in self.repos]

    @property
    def new(self) -> list[RepoConfig]:
        """The repositories the run has not recorded: they are ordered among themselves and appended."""
        known = {e.name for e in self.recorded}
        return [r for r in self.repos if r.display_name not in known]

    @property
    def kept_repos(self) -> list[RepoConfig]:
        """The repositories of `kept`, as the config gives them."""
        by_name = {r.display_name: r for r in self.repos}
        return [by_name[name] for name in self.kept]

    @property
    def kept(self) -> list[str]:
        """The recorded repositories this config runs, in the run's order (all of them unless the run is ahead)."""
        behind = {a.name for a in self.ahead}
        return [e.name for e in self.recorded if e.name not in behind]


def describe_ahead(ahead: Sequence[Ahead]) -> str:
    """`repo_3, from demo/more.yaml`; `repo_3, repo_4, from a.yaml; repo_5, from b.yaml`; `repo_3` (source unknown)."""
    groups: list[tuple[str | None, list[str]]] = []
    for a in ahead:
        if groups and groups[-1][0] == a.given_by:
            groups[-1][1].append(a.name)
        else:
            groups.append((a.given_by, [a.name]))
    return "; ".join(", ".join(names) + (f", from {source}" if source else "") for source, names in groups)


def plan_run(cfg: PipelineConfig, source: str = INLINE, free_bytes: int | None = None,
             device_count: int | None = None) -> RunPlan:
    """Every check of a run before anything is written: raises ConfigError, ManifestMismatchError or PreflightError
    (each naming the file, key or repository), or returns the plan. `source` names the config (its file)."""
    listed = list(cfg.repos)
    found, not_ready = _repos_dir(cfg.repos_dir, listed)
    manifest_path = cfg.run_dir / MANIFEST_NAME
    manifest = read_manifest(manifest_path) if manifest_path.is_file() else None
    recorded = recorded_sequence(manifest) if manifest is not None else []
    given_before_now = given_before(manifest) if manifest is not None else []
    waiting = waiting_repositories(manifest) if manifest is not None else []
    records = manifest.repos if manifest is not None else {}
    given_by = {e.name: record.given_by if (record := records.get(repo_key(i, e.name))) else None
                for i, e in enumerate(recorded)}
    if manifest is not None:
        check_experiment(manifest_path, manifest, cfg)
    # A new folder of repos_dir that does not validate is skipped for this run (and read again by the next one); a
    # folder the run has recorded is taken unread: a change to it is the sequence check's to refuse.
    known = {e.name: e for e in recorded}
    problems = {folder.name: validate_dataset(folder, cfg.data.split) for folder in found if folder.name not in known}
    not_ready += [NotReady(name=name, path=cfg.repos_dir / name, problem=str(bad[0]) + (
                      f"; and {len(bad) - 1} more" if len(bad) > 1 else "")) for name, bad in problems.items() if bad]
    repos = listed + [RepoConfig(path=folder) for folder in found if not problems.get(folder.name)]
    entries = {r.display_name: RepoEntry(r.display_name, Path(r.path), digests(Path(r.path), cfg.data.split)
                                         if Path(r.path).is_dir() else None) for r in repos}
    given = [entries[r.display_name] for r in repos]
    sequence = check_sequence(manifest_path, recorded, given_before_now, given) if manifest is not None else []
    ahead = [Ahead(name=e.name, given_by=given_by.get(e.name)) for e in sequence if e.name not in entries]
    unread = [r for r in repos if r.display_name not in problems and not _unchanged(known.get(r.display_name),
                                                                                    entries[r.display_name])]
    preflight_run(cfg, repos, unread, free_bytes, device_count)
    return RunPlan(cfg=cfg, source=source, repos=repos, entries=entries, recorded=sequence, not_ready=not_ready,
                   waiting=[name for name in waiting if name in entries], ahead=ahead)


def progress_line(trained: int, waiting: Sequence[str] | int, not_ready: int = 0) -> str:
    """`14 repositories trained, 0 waiting`, or `4 repositories trained, 1 waiting (repo_4)` given the waiting
    names (and how many folders of repos_dir are not ready, after them: the names belong to "waiting")."""
    count = waiting if isinstance(waiting, int) else len(waiting)
    names = "" if isinstance(waiting, int) or not waiting else f" ({', '.join(waiting)})"
    line = f"{trained} {'repository' if trained == 1 else 'repositories'} trained, {count} waiting{names}"
    return line + (f", {not_ready} not ready in repos_dir" if not_ready else "")


def _unchanged(recorded: RepoEntry | None, now: RepoEntry) -> bool:
    """Recorded with these very files, so validated when it was recorded: not read again."""
    return recorded is not None and recorded.dataset is not None and recorded.dataset == now.dataset


def _repos_dir(root: Path | None, listed: list[RepoConfig]) -> tuple[list[Path], list[NotReady]]:
    """The folders of repos_dir, sorted by name, that may be repositories (not yet validated), and those skipped as
    not ready because a repository of `repos` has their name."""
    if root is None:
        return [], []
    if not root.is_dir():
        raise PreflightError(f"repos_dir {root}: no such folder")
    names = {r.display_name: r.path for r in listed}
    paths = {Path(r.path).resolve() for r in listed}
    found: list[Path] = []
    skipped: list[NotReady] = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if folder.resolve() in paths:
            continue  # listed under `repos` as well: it is that repository
        if folder.name in names:
            problem = f"named like the repository {names[folder.name]} of `repos`; rename one"
            skipped.append(NotReady(name=folder.name, path=folder, problem=problem))
        else:
            found.append(folder)
    return found, skipped
