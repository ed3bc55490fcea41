"""The jobs a sweep's setups share: each run once in sweep_dir/shared, then made each setup's own.

A job whose identity (`leanagent.run.identity`) another setup's job has is run once, in a folder of the sweep's own,
`shared/jobs/PROGRAM-ID` (its premise index, if it writes one, in `shared/indexes/ID`), whichever setup gets there
first; the Prefect task that launches it caches its result under the identity (`leanagent.tasks.shared`), so a
setup that needs it later, or at the same time, records that result instead of running it again.

Why a folder of the sweep's own, not the first setup's: the job belongs to no setup more than another. An
interrupted job is resumed there by whichever setup reruns it first, from its last checkpoint, as a run resumes its
own; and each setup's job folder is then made exactly what running it alone leaves (`SharedWork.materialize`):
every file hard-linked (copied across filesystems) into the setup's job folder and index folder, and the job's
result.json and the index's index.json rewritten with the setup's own paths (the dataset, checkpoint and Fisher it
gave, its job folder, its index). A setup's manifest, report, index and server then read only its own run_dir.

`request.json` in a shared job folder is the request the job last ran with (its inputs' paths, which its result
names): written by whoever launches it, read by every setup that takes its result.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, field_serializer

from leanagent.ground.atomic import write_json_atomic
from leanagent.ground.job import JobRequest, result_filename
from leanagent.ground.json_files import MIB, read_json_file, read_model
from leanagent.ground.names import INDEX_FILE
from leanagent.ground.results import JobResult, StageResult, read_result

REQUEST_FILE = "request.json"
ID_CHARS = 20  # of the identity's SHA-256 in a shared folder's name (80 bits)
ID_SEP = "-"  # a shared job's folder is PROGRAM-ID


class SharedJobError(RuntimeError):
    """A shared job's files cannot be made a setup's own (its folder is gone, a disk is full)."""


class SharedRun(BaseModel):
    """What a shared job's task returns, and Prefect's cache keeps under its identity: the request it ran with and
    its result, its program's model (paths of the shared folder and of the inputs of the setup that ran it)."""

    model_config = ConfigDict(frozen=True)

    job: JobRequest
    result: StageResult

    @field_serializer("result")
    def _as_its_file(self, result: JobResult) -> dict[str, Any]:
        """The result as its result.json holds it (the keys it was given, none added as null): what a setup that
        takes it from Prefect's cache writes is then what the setup that ran it wrote."""
        return result.as_json()


class SharedWork(BaseModel):
    """A sweep's shared folder: `jobs/`, `indexes/`, and Prefect's cache of their results (`results/`, `locks/`)."""

    model_config = ConfigDict(frozen=True)

    root: Path

    @property
    def jobs(self) -> Path:
        return self.root / "jobs"

    @property
    def indexes(self) -> Path:
        return self.root / "indexes"

    @property
    def results(self) -> Path:
        return self.root / "results"

    @property
    def locks(self) -> Path:
        return self.root / "locks"

    def request(self, job: JobRequest, identity: str) -> JobRequest:
        """`job` as the sweep runs it: in its shared folder, writing its index (if any) into a shared one."""
        short = identity[:ID_CHARS]
        return job.model_copy(update={"out": self.jobs / f"{job.program}{ID_SEP}{short}",
                                      "index": self.indexes / short if job.index is not None else None})

    def materialize(self, ran: SharedRun, own: JobRequest, log: Callable[[str], None] = print) -> JobResult:
        """Make the shared job `ran` the job `own` of a setup: its files linked into `own.out` (and `own.index`), its
        result rewritten with `own`'s paths and written as `own.out/result.json` (last: the job reads as finished
        only once everything is there); returns that result."""
        shared = ran.job
        if not (shared.out / result_filename()).is_file():
            raise SharedJobError(f"{shared.out}: the shared job's folder has no {result_filename()} any more (moved "
                                 f"or deleted?); delete {self.results} to have the sweep run its shared jobs again")
        moves = path_moves(shared, own)
        try:
            _set_aside_if_foreign(own.out, shared.out, (result_filename(), REQUEST_FILE), log)
            link_tree(shared.out, own.out, skip=(result_filename(), REQUEST_FILE))
            if shared.index is not None and own.index is not None:
                _set_aside_if_foreign(own.index, shared.index, (INDEX_FILE,), log)
                link_tree(shared.index, own.index, skip=(INDEX_FILE,))
                meta = read_json_file(shared.index / INDEX_FILE, MIB, INDEX_FILE)
                write_json_atomic(own.index / INDEX_FILE, relocate(meta, moves))
            result = own.spec.result.model_validate(relocate(ran.result.as_json(), moves))
            write_json_atomic(own.out / result_filename(), result.as_json())
        except (OSError, ValueError) as exc:  # ValueError: a shared file that is not what it should be
            raise SharedJobError(f"{own.out}: the shared job {shared.out} could not be linked in ({exc}); free space "
                                 f"and rerun: nothing finished is lost") from None
        return result


def shared_program(folder: Path) -> str:
    """The program of the shared job in `folder` (`SharedWork.request` names it `PROGRAM-ID`)."""
    return Path(folder).name.split(ID_SEP, 1)[0]


def record_request(job: JobRequest) -> None:
    """The request a shared job is launched with, in its folder (`REQUEST_FILE`)."""
    write_json_atomic(job.out / REQUEST_FILE, job.model_dump(mode="json"))


def recorded_request(job: JobRequest) -> JobRequest:
    """The request the job in `job.out` last ran with (`job` itself if it has none recorded)."""
    path = job.out / REQUEST_FILE
    # Capped at a MiB: it carries the whole config, its repositories listed.
    return read_model(path, JobRequest, MIB, "job request") if path.exists() else job


def finished_result(job: JobRequest) -> JobResult | None:
    """A setup's job folder that holds its result already (linked in before a crash, or run before the sweep)."""
    path = job.out / result_filename()
    return read_result(path, job.spec.result) if path.is_file() else None


def path_moves(shared: JobRequest, own: JobRequest) -> list[tuple[str, str]]:
    """(old, new) path prefixes, longest first: the shared job's folder, index and inputs, as `own` has them. Each
    path twice, as given and resolved (the ranks receive resolved paths)."""
    pairs: list[tuple[Path | None, Path | None]] = [
        (shared.out, own.out), (shared.index, own.index), (shared.checkpoint, own.checkpoint),
        (shared.fisher, own.fisher), (shared.index_after, own.index_after),
        *zip(shared.datasets, own.datasets, strict=True),
        *zip(shared.index_datasets, own.index_datasets, strict=False)]
    moves: dict[str, str] = {}
    for old, new in pairs:
        if old is None or new is None:
            continue
        for a, b in ((Path(old), Path(new)), (Path(old).resolve(), Path(new).resolve())):
            moves.setdefault(str(a), str(b))
    return sorted(moves.items(), key=lambda m: -len(m[0]))


def relocate(value: Any, moves: list[tuple[str, str]]) -> Any:
    """`value` (JSON) with every string that is one of the old paths, or lies under one, moved to the new one."""
    if isinstance(value, dict):
        return {k: relocate(v, moves) for k, v in value.items()}
    if isinstance(value, list):
        return [relocate(v, moves) for v in value]
    if isinstance(value, str):
        for old, new in moves:
            if value == old or value.startswith(old + os.sep):
                return new + value[len(old):]
    return value


def link_tree(source: Path, target: Path, skip: tuple[str, ...] = ()) -> None:
    """Every file under `source` hard-linked at the same place under `target` (copied where a link cannot be made:
    another filesystem), except the top-level names in `skip`. A file already linked there is left as it is."""
    for folder, _, files in os.walk(source):
        here = Path(folder)
        relative = here.relative_to(source)
        (target / relative).mkdir(parents=True, exist_ok=True)
        for name in files:
            if relative == Path(".") and name in skip:
                continue
            src, dst = here / name, target / relative / name
            if dst.exists() and os.path.samefile(src, dst):
                continue
            try:
                os.link(src, dst)
            except FileExistsError:  # another file of that name: a partial earlier attempt's, replaced
                dst.unlink()
                os.link(src, dst)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                    raise
                shutil.copy2(src, dst)


def _set_aside_if_foreign(folder: Path, source: Path, own: tuple[str, ...], log: Callable[[str], None]) -> None:
    """A setup folder holding files that are not the shared job's (a job of this setup interrupted before the
    sweep): moved aside beside it, not overwritten, with a line saying where."""
    if not folder.is_dir():
        return
    for path in folder.rglob("*"):
        if not path.is_file() or path.relative_to(folder) in {Path(name) for name in own}:
            continue  # the files written for the setup itself
        twin = source / path.relative_to(folder)
        if twin.exists() and os.path.samefile(path, twin):
            continue
        aside = folder.with_name(f"{folder.name}.before-sweep-{time.strftime('%Y%m%d-%H%M%S')}")
        folder.rename(aside)
        log(f"{folder}: held files of an earlier attempt of this job; moved to {aside} (the sweep's shared job "
            f"{source} takes its place)")
        return
