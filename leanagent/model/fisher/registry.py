"""The Fisher estimators by name: what `lifelong.fisher_estimator` picks (and `leanagent.train.programs` fits)."""

from __future__ import annotations

from leanagent.ground.names import FISHER_ESTIMATORS, check_table
from leanagent.model.fisher.base import FisherEstimator
from leanagent.model.fisher.per_example import FisherModule
from leanagent.model.fisher.reference import ReferenceFisherModule

ESTIMATORS: dict[str, type[FisherEstimator]] = {cls.name: cls for cls in (FisherModule, ReferenceFisherModule)}
# `lifelong.fisher_estimator`'s choices are the names of leanagent.ground.names (the config cannot import this table).
check_table("leanagent.model.fisher.registry.ESTIMATORS", FISHER_ESTIMATORS, ESTIMATORS)


def fisher_estimator(name: str) -> type[FisherEstimator]:
    """The estimator class `lifelong.fisher_estimator: NAME` names; an unknown name is refused with the list."""
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown Fisher estimator {name!r}; choose one of {sorted(ESTIMATORS)}") from None
