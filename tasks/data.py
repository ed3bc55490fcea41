"""The Prefect task that orders the repositories before any job is launched.

The curriculum order is a task of its own so that the order chosen, and why, is in the flow run's
logs and its own box in the UI. The datasets it reads were validated by the flow's preflight
(`leanagent.preflight.checks.preflight_run`), so it meets no bad input.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from leanagent.data.curriculum import curriculum_of_datasets, describe
from leanagent.ground.config import RepoConfig
from leanagent.ground.names import DEFAULT_SPLIT


@task(name="order-curriculum", cache_policy=NO_CACHE)
def order_curriculum(repos: list[RepoConfig], curriculum: bool, split: str = DEFAULT_SPLIT,
                     kept: list[str] | None = None) -> list[RepoConfig]:
    """LeanAgent's order (most Easy theorems first, ties keep the given order) or the given order, after the
    repositories the run already has.

    The same `curriculum_of_datasets` as `leanagent curriculum`, so the command shows what a run will do. The
    percentiles are taken over all `repos`, kept and new.

    Args:
        repos: The repositories, with distinct display names (the preflight checks them).
        curriculum: Order by LeanAgent's curriculum; False keeps the given order.
        split: The split folder whose theorems are counted.
        kept: Display names of `repos` already in the run's sequence, in its order: they keep their places, and
            the others are ordered among themselves and appended.
    """
    logger = get_run_logger()
    kept = list(kept or [])
    by_name = {r.display_name: r for r in repos}
    if not curriculum:
        ordered = [by_name[name] for name in kept] + [r for r in repos if r.display_name not in kept]
        logger.info("curriculum off: repositories in the given order, new ones after those of the run: "
                    + ", ".join(r.display_name for r in ordered))
        return ordered
    result = curriculum_of_datasets({name: r.path for name, r in by_name.items()}, split=split, kept=kept)
    for line in describe(result):
        logger.info(f"curriculum: {line}")
    return [by_name[name] for name in result.order]
