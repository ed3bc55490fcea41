"""`lifelong.fisher_estimator` picks an estimator by name from one registry; both share one base class."""

from __future__ import annotations

import typing

import pytest

from leanagent.ground.config import LifelongConfig
from leanagent.model.fisher import ESTIMATORS, FisherEstimator, FisherModule, ReferenceFisherModule, fisher_estimator


def test_every_configurable_estimator_is_registered_under_its_name() -> None:
    names = typing.get_args(LifelongConfig.model_fields["fisher_estimator"].annotation)
    assert set(names) == set(ESTIMATORS) == {"per_example", "reference"}
    assert fisher_estimator("per_example") is FisherModule and fisher_estimator("reference") is ReferenceFisherModule
    for name, cls in ESTIMATORS.items():
        assert issubclass(cls, FisherEstimator) and cls.name == name


def test_an_unknown_estimator_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown Fisher estimator 'diagonal'; choose one of \['per_example', "
                                         r"'reference'\]"):
        fisher_estimator("diagonal")
