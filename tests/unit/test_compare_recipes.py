"""scripts/compare_recipes.py: its three configs differ in the recipe only (so the runs train equal steps), and
its mathlib-scale repositories are valid, with contexts of the lengths asked for."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

from leanagent.data.theorems import format_context, load_split
from leanagent.data.validate import validate_dataset
from leanagent.ground.config import load_config

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compare_recipes.py"


def _script():
    spec = importlib.util.spec_from_file_location("compare_recipes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_three_configs_differ_in_the_recipe_only(tmp_path: Path) -> None:
    module = _script()
    args = argparse.Namespace(accelerator="cpu", devices=2, epochs=3, mined_pool=50, precision="bf16-mixed",
                              max_seq_len=256, corpus_autocast=False, lr=None, compile=True)
    repos = [tmp_path / "repo_0", tmp_path / "repo_1"]
    configs = {name: load_config(module.write_config(tmp_path / f"{name}.yaml", args, repos, tmp_path / "model",
                                                     loss, negatives))
               for name, (loss, negatives) in module.RECIPES.items()}
    assert {n: (c.model.loss, c.data.negatives) for n, c in configs.items()} == {
        "mse-random": ("mse", "random"), "infonce-random": ("infonce", "random"), "infonce-mined": ("infonce", "mined")}
    recipe = {"model": {"loss"}, "data": {"negatives"}, "run_dir": True}
    dumps = [c.model_dump(exclude=recipe) for c in configs.values()]
    assert dumps[0] == dumps[1] == dumps[2]
    assert {c.run_dir.name for c in configs.values()} == set(module.RECIPES)


def test_parallel_recipes_each_log_their_own_run_and_failures_are_named(tmp_path: Path) -> None:
    """`--parallel`: every recipe's `leanagent run` runs (here each is refused: its repository is missing), its
    output in OUT/NAME.log, and the failure names every failed recipe and its log."""
    module = _script()
    args = argparse.Namespace(accelerator="cpu", devices=1, epochs=1, mined_pool=50, precision="32-true",
                              max_seq_len=256, corpus_autocast=False, lr=None, compile=False)
    configs = {name: module.write_config(tmp_path / f"{name}.yaml", args, [tmp_path / f"missing_{name}"],
                                         tmp_path / "model", loss, negatives)
               for name, (loss, negatives) in module.RECIPES.items()}
    try:
        module.run_recipes(configs, tmp_path, parallel=True)
    except SystemExit as exc:
        message = str(exc)
    else:
        raise AssertionError("three refused runs passed")
    for name in module.RECIPES:
        assert f"missing_{name}" in (tmp_path / f"{name}.log").read_text()
        assert name in message and str(tmp_path / f"{name}.log") in message


def test_mathlib_scale_repositories_take_the_states_lengths_of_a_split_file(tmp_path: Path) -> None:
    """`--mathlib-scale`: one valid mathlib-shaped dataset per repository, its contexts as long as those of the
    given split file (here every state is 500 bytes), written under a dot-name and then renamed."""
    module = _script()
    split = tmp_path / "states.json"
    tactic = {"tactic": "simp", "annotated_tactic": ["simp", []], "state_before": "x" * 500, "state_after": "no goals"}
    split.write_text(json.dumps([{"url": "u", "commit": "c", "file_path": "F.lean", "full_name": "t", "start": [1, 1],
                                  "end": [2, 1], "traced_tactics": [tactic]}]))
    args = argparse.Namespace(repos=2, files=30, premises=300, theorems=40, eval_share=0.1, states=split)
    module.write_scale_repos(tmp_path / "data", args)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "states.json"]
    for repo in ("repo_0", "repo_1"):
        assert validate_dataset(tmp_path / "data" / repo) == []
        contexts = [format_context(t) for th in load_split(tmp_path / "data" / repo / "random" / "test.json")
                    for t in th.tactics]
        assert contexts and all(500 <= len(c.encode()) <= 560 for c in contexts)
