"""A sweep's shared jobs as Prefect runs them: the task `rank_job`'s launch, cached by the job's identity.

What carries the sharing is Prefect's own result caching, not a cache of ours:

- the cache key is the job's identity (`leanagent.run.identity`: the content of its inputs and the settings that
  change its result, never a path): `JobIdentityPolicy`;
- the results are persisted in the sweep's folder (`shared/results`, JSON), so a setup of a later run of the sweep
  finds them, and a task that finds one ends "Cached" in the UI without launching anything;
- the isolation level is SERIALIZABLE: a task takes the identity's lock before it looks for a result, so two setups
  that reach one job at the same time never both run it: one runs it, the other waits for its result.

The lock is ours (`FlockLockManager`, Prefect's `LockManager` protocol on `leanagent.ground.pid_lock.PidLock`, an
`fcntl.flock`), because Prefect's file-system lock manager leaves its lock file behind when its holder is killed,
and a sweep killed mid-job must be rerun without anyone deleting files: the kernel lets go of a flock when its
holder dies, however it dies.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from pathlib import Path
from typing import Any

from prefect import Task, task
from prefect.cache_policies import CachePolicy
from prefect.locking.protocol import LockManager

from leanagent.ground.job import JobRequest, result_filename
from leanagent.ground.pid_lock import POLL_S, LockHeld, PidLock
from leanagent.preflight.run_job import run_job
from leanagent.run.identity import job_identity
from leanagent.run.shared import SharedRun, SharedWork, record_request, recorded_request
from leanagent.tasks.jobs import forward_to_run_logger, rank_job


class FlockLockManager(LockManager):
    """Prefect's `LockManager` on `PidLock` (an `fcntl.flock`), one lock file per key in `folder`: released by the
    kernel when its holder's process dies. Each acquisition is a lock of its own on the file, opened anew, so two
    threads of one process exclude each other as two processes do (flock locks an open file, not a process)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self._held: dict[str, tuple[PidLock, str]] = {}
        self._mutex = threading.Lock()

    def _lock(self, key: str) -> PidLock:
        return PidLock(self.folder / f"{key}.lock")

    def acquire_lock(self, key: str, holder: str, acquire_timeout: float | None = None,
                     hold_timeout: float | None = None) -> bool:
        lock = self._lock(key)
        try:
            lock.acquire(wait_s=math.inf if acquire_timeout is None else acquire_timeout)
        except LockHeld:
            return False
        with self._mutex:
            self._held[key] = (lock, holder)
        return True

    async def aacquire_lock(self, key: str, holder: str, acquire_timeout: float | None = None,
                            hold_timeout: float | None = None) -> bool:
        return await asyncio.to_thread(self.acquire_lock, key, holder, acquire_timeout, hold_timeout)

    def release_lock(self, key: str, holder: str) -> None:
        with self._mutex:
            held = self._held.get(key)
            if held is None or held[1] != holder:
                raise ValueError(f"no lock held by {holder} for {key}")
            del self._held[key]
        held[0].release()

    def is_locked(self, key: str) -> bool:
        with self._mutex:
            if key in self._held:
                return True
        try:
            self._lock(key).probe()
        except LockHeld:
            return True
        return False

    def is_lock_holder(self, key: str, holder: str) -> bool:
        with self._mutex:
            held = self._held.get(key)
        return held is not None and held[1] == holder

    def wait_for_lock(self, key: str, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.is_locked(key):
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)
        return True

    async def await_for_lock(self, key: str, timeout: float | None = None) -> bool:
        return await asyncio.to_thread(self.wait_for_lock, key, timeout)


class JobIdentityPolicy(CachePolicy):
    """The cache key of a shared job: its identity's digest (`leanagent.run.identity.job_identity`)."""

    def compute_key(self, task_ctx: Any, inputs: dict[str, Any], flow_parameters: dict[str, Any],
                    **kwargs: Any) -> str | None:
        return job_identity(inputs["job"]).digest()


@task(name="rank-job")
def shared_rank_job(job: JobRequest) -> SharedRun:
    """A job the sweep's setups share, launched as `rank_job` launches one, in its shared folder; returns the request
    it ran with beside its result, what every setup needs to make the job its own.

    Args:
        job: The job, in its shared folder (`leanagent.run.shared.SharedWork.request`), with the config of the setup
            that launches it (what its identity does not name is read by no job).
    """
    if not (job.out / result_filename()).is_file():
        record_request(job)
    result = run_job(job, on_line=forward_to_run_logger(), reuse_finished=True)
    return SharedRun(job=recorded_request(job), result=result)


def shared_task(work: SharedWork, **options: Any) -> Task:
    """`shared_rank_job` with rank_job's retries, cached by identity in `work` (module docstring); `options` as
    `Task.with_options` takes them (the run name, the retries)."""
    policy = JobIdentityPolicy().configure(isolation_level="SERIALIZABLE", lock_manager=FlockLockManager(work.locks))
    return shared_rank_job.with_options(
        cache_policy=policy, result_storage=work.results, result_serializer="json", persist_result=True,
        retry_condition_fn=rank_job.retry_condition_fn, **options)
