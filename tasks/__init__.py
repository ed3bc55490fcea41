"""Prefect tasks: launch a job or order the repositories, forward the logs, return the result.

Training logic lives in `leanagent`; these modules only connect it to Prefect.
"""

from leanagent.tasks.data import order_curriculum
from leanagent.tasks.jobs import rank_job
from leanagent.tasks.options import JobOptions

__all__ = ["JobOptions", "order_curriculum", "rank_job"]
