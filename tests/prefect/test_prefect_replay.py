"""`lifelong.dataset_strategy: replay` through the real flow, with EWC and the InfoNCE loss.

Two demo repositories, the tiny model, 2 gloo ranks, one epoch each: 2 training, 2 Fisher and 3 evaluation jobs.
The second repository trains, and computes its Fisher, on itself plus half of the first one's training theorems
(run_dir/merged/01-name), anchored by the first one's Fisher, under the InfoNCE loss; evaluation is on each
repository's own test split.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from leanagent.flows.lifelong import lifelong_retrieval

from leanagent.data.example_files import write_example_files
from leanagent.data.replay import kept_count
from leanagent.ground.atomic import read_json
from leanagent.ground.config import DataConfig
from leanagent.report import run_setup

pytestmark = [pytest.mark.prefect, pytest.mark.ddp]


def _train_examples(dataset: Path, out: Path) -> int:
    return write_example_files(dataset, out, DataConfig(), seed=0)["train"]


def test_replay_trains_on_its_draw_with_ewc_and_infonce(prefect_harness: None, demo_assets, write_cpu_config,
                                                         tmp_path: Path) -> None:
    repos = demo_assets.repos[:2]
    config = write_cpu_config(tmp_path / "replay.yaml", tmp_path / "replay", repos, model={"loss": "infonce"},
                              lifelong={"dataset_strategy": "replay", "replay_fraction": 0.5})
    state = lifelong_retrieval(config_path=str(config), return_state=True)
    assert state.is_completed(), state.message
    run_dir, summary = tmp_path / "replay", state.result()
    names = summary["order"]
    by_name = {r.name: r for r in repos}
    manifest = read_json(run_dir / "manifest.json")
    assert run_setup(manifest["config"]).startswith("replay 0.5, curriculum, EWC 0.1, infonce + random negatives")
    key = f"01-{names[1]}"
    merged = run_dir / "merged" / key
    train, fisher = (read_json(run_dir / "jobs" / key / part / "result.json") for part in ("train", "fisher"))
    assert Path(train["dataset"]) == merged and Path(fisher["dataset"]) == merged and train["ewc"] is True
    # The draw: half of the first repository's training theorems, recorded with the merge.
    draw = manifest["repos"][key]["stages"]["merge"]["result"]["replay"][str(by_name[names[0]])]
    theorems = len(read_json(by_name[names[0]] / "random" / "train.json"))
    assert (draw["fraction"], draw["of"], draw["kept"]) == (0.5, theorems, kept_count(theorems, 0.5))
    # Training and the Fisher saw exactly the replayed dataset's examples: more than the repository alone has, fewer
    # than the merge of both.
    replayed = _train_examples(merged, tmp_path / "examples" / "replayed")
    alone = _train_examples(by_name[names[1]], tmp_path / "examples" / "alone")
    first = _train_examples(by_name[names[0]], tmp_path / "examples" / "first")
    assert train["num_train_examples"] == fisher["num_examples"] == replayed
    assert alone < replayed < alone + first
    # Evaluation is on each repository's own test split.
    evaluated = read_json(run_dir / "jobs" / key / "evaluate-00-01" / "result.json")["evaluations"]
    assert [Path(e["dataset"]) for e in evaluated] == [by_name[n] for n in names]
    assert len(summary["matrix"]) == 2 and all(row for row in summary["matrix"])
