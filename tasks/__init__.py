"""Prefect tasks: launch a job or order the repositories, forward the logs, return the result.

Training logic lives in `leanagent`; these modules only connect it to Prefect.
"""

from tasks.data import order_curriculum
from tasks.jobs import compute_fisher, evaluate_retriever, train_retriever
from tasks.options import JobOptions

__all__ = ["JobOptions", "compute_fisher", "evaluate_retriever", "order_curriculum", "train_retriever"]
