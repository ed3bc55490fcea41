"""scripts/compare_recipes.py: its three configs differ in the recipe only, so the runs train equal steps."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from leanagent.config import load_config

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compare_recipes.py"


def test_the_three_configs_differ_in_the_recipe_only(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("compare_recipes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = argparse.Namespace(accelerator="cpu", devices=2, epochs=3, mined_pool=50)
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
