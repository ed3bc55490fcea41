"""The diagonal Fisher information of the retriever, for EWC: LeanAgent's estimator and the empirical one."""

from leanagent.model.fisher.base import FisherEstimator
from leanagent.model.fisher.per_example import AUTO_METHOD, METHODS, FisherModule
from leanagent.model.fisher.reference import ReferenceFisherModule
from leanagent.model.fisher.registry import ESTIMATORS, fisher_estimator

__all__ = ["AUTO_METHOD", "ESTIMATORS", "METHODS", "FisherEstimator", "FisherModule", "ReferenceFisherModule",
           "fisher_estimator"]
