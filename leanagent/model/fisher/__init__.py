"""The diagonal Fisher information of the retriever, for EWC: LeanAgent's estimator and the empirical one."""

from leanagent.model.fisher.per_example import AUTO_METHOD, METHODS, FisherModule
from leanagent.model.fisher.reference import ReferenceFisherModule

__all__ = ["AUTO_METHOD", "METHODS", "FisherModule", "ReferenceFisherModule"]
