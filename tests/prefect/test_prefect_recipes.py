"""`model.loss: infonce` with `data.negatives: mined` through the real flow, beside the session's `mse` run.

Two demo repositories, the tiny model, 2 gloo ranks, one epoch each (so the first repository's negatives are
random, and the second starts from no table: a new repository mines from its own first validation). The run
completes, reruns without launching anything, and `leanagent report` prints it beside `lifelong_run3` (the
session's LeanAgent-recipe run of the same repositories and one more).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from leanagent.flows.lifelong import lifelong_retrieval
from tests.conftest import FinishedRun, file_times, read_json

pytestmark = [pytest.mark.prefect, pytest.mark.ddp]


@pytest.fixture(scope="module")
def infonce_run(prefect_harness: None, tmp_path_factory: pytest.TempPathFactory, demo_assets, write_cpu_config
                ) -> tuple[Path, Path, dict]:
    root = tmp_path_factory.mktemp("recipes")
    config = write_cpu_config(root / "infonce.yaml", root / "infonce", demo_assets.repos[:2],
                              model={"loss": "infonce"}, data={"negatives": "mined", "mined_pool": 8},
                              lifelong={"epochs_per_repo": 2})
    state = lifelong_retrieval(config_path=str(config), return_state=True)
    assert state.is_completed(), state.message
    return config, root / "infonce", state.result()


def test_the_run_trains_with_mined_negatives_and_reruns_without_retraining(infonce_run) -> None:
    config, run_dir, summary = infonce_run
    assert len(summary["order"]) == 2
    trains = sorted((run_dir / "jobs").glob("*/train/result.json"))
    assert len(trains) == 2
    for result in map(read_json, trains):
        last = torch.load(result["latest_checkpoint"], map_location="cpu", weights_only=True)
        assert last["hyper_parameters"]["loss"] == "infonce"
        assert last["RetrievalDataModule"]["mined"].shape[1] == 8  # mined at its repository's validations
    before = file_times(run_dir / "jobs")
    state = lifelong_retrieval(config_path=str(config), return_state=True)
    assert state.is_completed(), state.message
    assert file_times(run_dir / "jobs") == before  # nothing launched or rewritten
    assert state.result()["rows"] == summary["rows"]


def test_report_prints_it_beside_the_mse_run(infonce_run, lifelong_run3: FinishedRun, tmp_path: Path) -> None:
    _, run_dir, summary = infonce_run
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "leanagent.cli", "report", str(lifelong_run3.run_dir), str(run_dir),
                           "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "1:single" in proc.stdout and "2:infonce" in proc.stdout
    setup = next(line for line in proc.stdout.splitlines() if line.startswith("setup "))
    assert "infonce + mined negatives" in setup
    for row in ("final R@1", "final R@10", "final MRR"):
        assert len(next(line for line in proc.stdout.splitlines() if line.startswith(row)).split()) == 4, row
    mse, infonce = json.loads(out.read_text())["runs"]
    assert "infonce" not in mse["setup"] and "infonce + mined negatives, precision " in infonce["setup"]
    assert infonce["repositories"] == 2 and mse["repositories"] == 3
    assert infonce["avg"] == pytest.approx(summary["lifelong"]["avg"])
