"""The order-curriculum task on repositories whose Easy counts are worked out by hand.

Three repositories, 12 theorems with 1, 3 or 5 tactics (difficulty e^1, e^3, e^5, four each).
numpy's linear percentiles over the 12 sorted values: p33 at index 3.63 lies between e^1 and
e^3, p67 at index 7.37 between e^3 and e^5; so Easy = 1 tactic, Medium = 3, Hard = 5.
  alpha: 1 x one tactic, 3 x five   -> 1 Easy
  beta:  3 x one tactic, 1 x five   -> 3 Easy
  gamma: 4 x three tactics          -> 0 Easy
Curriculum order (most Easy first): beta, alpha, gamma.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prefect import flow

from leanagent.config import RepoConfig
from tasks.data import DatasetValidationError, order_curriculum

pytestmark = [pytest.mark.prefect, pytest.mark.usefixtures("prefect_harness")]

TACTIC_COUNTS = {"alpha": [1, 5, 5, 5], "beta": [1, 1, 1, 5], "gamma": [3, 3, 3, 3]}


def _theorem(name: str, tactics: int) -> dict:
    return {"full_name": name, "file_path": "A.lean", "start": [1, 1], "end": [2, 1],
            "traced_tactics": [{"tactic": "simp", "state_before": "⊢ p", "state_after": "no goals"}] * tactics}


def _write_repo(root: Path, name: str, counts: list[int]) -> Path:
    split = root / name / "random"
    split.mkdir(parents=True)
    theorems = [_theorem(f"{name}.t{k}", n) for k, n in enumerate(counts)]
    (split / "train.json").write_text(json.dumps(theorems[:2]))
    (split / "val.json").write_text(json.dumps(theorems[2:3]))
    (split / "test.json").write_text(json.dumps(theorems[3:]))
    return root / name


@flow
def order_in_a_flow(repos: list[RepoConfig], curriculum: bool) -> list[RepoConfig]:
    """The task as the lifelong flow calls it, so its log lines have a flow run to go to."""
    return order_curriculum(repos, curriculum=curriculum)


@pytest.fixture
def repos(tmp_path: Path) -> list[RepoConfig]:
    return [RepoConfig(path=_write_repo(tmp_path, name, counts)) for name, counts in TACTIC_COUNTS.items()]


def test_curriculum_orders_by_easy_theorems(repos: list[RepoConfig]) -> None:
    ordered = order_in_a_flow(repos, curriculum=True)
    assert [r.display_name for r in ordered] == ["beta", "alpha", "gamma"]


def test_without_curriculum_the_given_order_is_kept(repos: list[RepoConfig]) -> None:
    ordered = order_in_a_flow(repos, curriculum=False)
    assert [r.display_name for r in ordered] == ["alpha", "beta", "gamma"]


def test_duplicate_display_names_are_refused(repos: list[RepoConfig]) -> None:
    twins = [repos[0], RepoConfig(path=repos[1].path, name="alpha")]
    with pytest.raises(DatasetValidationError, match="both named 'alpha'"):
        order_in_a_flow(twins, curriculum=True)
