"""The order-curriculum task on repositories whose classes are worked out by hand.

Three repositories; each number is a theorem's count of traced tactics (difficulty e^n), "sorry" a
theorem with a sorry tactic (difficulty inf), 0 a theorem without tactics (unrated).
  alpha: 1, 5, 5, 5, sorry
  beta:  1, 1, 1, 5
  gamma: 3, 3, 3, 3, 0, 0, 0, 0
The 13 rated difficulties of all repositories, sorted, inf included as LeanAgent does:
  e x4 (index 0-3), e^3 x4 (4-7), e^5 x4 (8-11), inf (12).
numpy's linear percentiles: p33 at rank 3.96 = e^3 - 0.04 * (e^3 - e) = 19.39;
p67 at rank 8.04, between two e^5, = e^5 exactly. So e is Easy, e^3 and e^5 (<= p67) Medium,
sorry "hard, no proof"; gamma's four unrated theorems: 4 // 3 = 1 Easy, 1 Medium, 2 Hard.
  alpha: easy 1, medium 3, hard 0, no proof 1
  beta:  easy 3, medium 1, hard 0, no proof 0
  gamma: easy 1, medium 5, hard 2, no proof 0
Order, most Easy first, ties (alpha, gamma: 1) in the given order: beta, alpha, gamma.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from prefect import flow

from leanagent.cli import build_parser
from leanagent.ground.config import RepoConfig
from leanagent.tasks.data import order_curriculum
from tests.prefect.prefect_api import wait_for_logs

pytestmark = [pytest.mark.prefect, pytest.mark.usefixtures("prefect_harness")]

SORRY = -1
TACTIC_COUNTS = {"alpha": [1, 5, 5, 5, SORRY], "beta": [1, 1, 1, 5], "gamma": [3, 3, 3, 3, 0, 0, 0, 0]}
P33 = math.exp(3) - 0.04 * (math.exp(3) - math.exp(1))
P67 = math.exp(5)
EXPECTED_LINES = [
    "curriculum: 1. beta: easy 3, medium 1, hard 0, hard (no proof) 0",
    "curriculum: 2. alpha: easy 1, medium 3, hard 0, hard (no proof) 1",
    "curriculum: 3. gamma: easy 1, medium 5, hard 2, hard (no proof) 0",
    f"curriculum: percentiles of difficulty (e^tactics): p33 = {P33:.6g} ({math.log(P33):.3g} tactics), "
    f"p67 = {P67:.6g} (5 tactics)",
    "curriculum: order: beta, alpha, gamma",
]


def _theorem(name: str, tactics: int) -> dict:
    step = {"tactic": "simp", "state_before": "⊢ p", "state_after": "no goals"}
    traced = [{**step, "tactic": "exact sorry"}] if tactics == SORRY else [step] * tactics
    return {"full_name": name, "file_path": "A.lean", "start": [1, 1], "end": [2, 1], "traced_tactics": traced}


def _write_repo(root: Path, name: str, counts: list[int]) -> Path:
    """Theorems spread over train, val and test: the curriculum counts all three files."""
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


def test_curriculum_orders_by_easy_theorems_and_logs_why(repos: list[RepoConfig]) -> None:
    state = order_in_a_flow(repos, curriculum=True, return_state=True)
    assert [r.display_name for r in state.result()] == ["beta", "alpha", "gamma"]
    messages = wait_for_logs(state.state_details.flow_run_id, lambda m: all(line in m for line in EXPECTED_LINES))
    for line in EXPECTED_LINES:
        assert line in messages


def test_ties_keep_the_given_order(repos: list[RepoConfig]) -> None:
    by_name = {r.display_name: r for r in repos}
    ordered = order_in_a_flow([by_name["gamma"], by_name["alpha"], by_name["beta"]], curriculum=True)
    assert [r.display_name for r in ordered] == ["beta", "gamma", "alpha"]


def test_the_cli_shows_the_order_the_flow_uses(repos: list[RepoConfig], tmp_path: Path) -> None:
    out = tmp_path / "curriculum.json"
    args = build_parser().parse_args(["curriculum", *(str(r.path) for r in repos), "--json", str(out)])
    assert args.func(args) == 0
    written = json.loads(out.read_text())
    assert written["order"] == [r.display_name for r in order_in_a_flow(repos, curriculum=True)]
    assert written["counts"]["gamma"] == {"easy": 1, "medium": 5, "hard": 2, "hard_no_proof": 0}
    assert written["percentiles"] == [pytest.approx(P33), P67]


def test_without_curriculum_the_given_order_is_kept(repos: list[RepoConfig]) -> None:
    ordered = order_in_a_flow(repos, curriculum=False)
    assert [r.display_name for r in ordered] == ["alpha", "beta", "gamma"]
