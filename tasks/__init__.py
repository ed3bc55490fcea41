"""Prefect tasks: launch a job or look at the datasets, forward the logs, return the result.

Training logic lives in `leanagent`; these modules only connect it to Prefect.
"""

from tasks.data import DatasetValidationError, order_curriculum, validate_datasets
from tasks.jobs import compute_fisher, evaluate_retriever, train_retriever
from tasks.options import JobOptions

__all__ = ["DatasetValidationError", "JobOptions", "compute_fisher", "evaluate_retriever", "order_curriculum",
           "train_retriever", "validate_datasets"]
