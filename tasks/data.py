"""Prefect tasks that look at the datasets before any job is launched.

Validation runs for every repository up front because a lifelong run is long: a broken fifth
dataset found after four repositories of training costs days. The curriculum order is a task of
its own so that the order chosen, and why, is in the flow run's logs.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from leanagent.config import RepoConfig
from leanagent.data.curriculum import curriculum_of_datasets, describe
from leanagent.data.validate import validate_dataset


class DatasetValidationError(ValueError):
    """One or more datasets are unusable; the message names each and its problems. Nothing was launched."""


def _check_unique_names(repos: list[RepoConfig]) -> None:
    """Display names key the curriculum and the job folders, so two repositories may not share one."""
    seen: dict[str, str] = {}
    for repo in repos:
        if repo.display_name in seen:
            raise DatasetValidationError(
                f"two repositories are both named {repo.display_name!r} ({seen[repo.display_name]} and {repo.path}); "
                f"give one a distinct `name`")
        seen[repo.display_name] = str(repo.path)


@task(name="validate-datasets", cache_policy=NO_CACHE)
def validate_datasets(repos: list[RepoConfig], split: str = "random", max_listed: int = 20) -> None:
    """Raise DatasetValidationError naming every bad dataset and (up to `max_listed` of) its problems."""
    if not repos:
        raise DatasetValidationError("the config lists no repository (`repos` is empty)")
    _check_unique_names(repos)
    logger = get_run_logger()
    reports = []
    for repo in repos:
        problems = validate_dataset(repo.path, split=split)
        if not problems:
            logger.info(f"{repo.display_name}: dataset {repo.path} is valid")
            continue
        listed = "\n".join(f"    {p}" for p in problems[:max_listed])
        more = f"\n    ... and {len(problems) - max_listed} more" if len(problems) > max_listed else ""
        reports.append(f"  {repo.display_name} ({repo.path}): {len(problems)} problem(s)\n{listed}{more}")
    if reports:
        raise DatasetValidationError(f"{len(reports)} of {len(repos)} dataset(s) are invalid; nothing was trained:\n"
                                     + "\n".join(reports))


@task(name="order-curriculum", cache_policy=NO_CACHE)
def order_curriculum(repos: list[RepoConfig], curriculum: bool, split: str = "random") -> list[RepoConfig]:
    """LeanAgent's order (most Easy theorems first, ties keep the given order) or the given order.

    The same `curriculum_of_datasets` as `leanagent curriculum`, so the command shows what a run will do.
    """
    logger = get_run_logger()
    if not curriculum:
        logger.info("curriculum off: repositories in the given order: " + ", ".join(r.display_name for r in repos))
        return list(repos)
    _check_unique_names(repos)
    by_name = {r.display_name: r for r in repos}
    result = curriculum_of_datasets({name: r.path for name, r in by_name.items()}, split=split)
    for line in describe(result):
        logger.info(f"curriculum: {line}")
    return [by_name[name] for name in result.order]
