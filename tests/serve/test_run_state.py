"""A run's state read back through its schemas: 15 manifests of the wrong shape (valid JSON, mostly), each given to
`run`, `report`, `serve` and `retrieve` as a user types them, answer one line naming the file and the key, exit 1,
no traceback; the undamaged manifest gives each command's normal answer. (index.json's keys:
tests/unit/test_index_integrity.py; result.json's: tests/unit/test_run_state_models.py.)

In process, through `leanagent.cli.main`: every command reads the manifest before it loads a model or starts
Prefect, which is what is under test, and 60 command starts as processes would take minutes.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from leanagent.cli.main import main
from leanagent.data.merge import digests
from leanagent.ground.config import PipelineConfig, RepoConfig, TrainerConfig
from leanagent.run.manifest import EVAL_UNTRAINED, FISHER, TRAIN, RepoEntry, eval_stage, stage_name
from leanagent.run.state import RunState

from .conftest import STATE, command_alone

EVAL = {"metrics": {"Recall@1": 10.0, "Recall@10": 50.0, "MRR": 0.25, "num_contexts": 7}, "world_size": 1}


@pytest.fixture(scope="module")
def run(built, tmp_path_factory) -> dict[str, Any]:
    """A finished one-repository run, written by RunState as the flow writes it, its stage index inside it, and
    the config that ran it: (config file, run_dir, the manifest as written)."""
    root = tmp_path_factory.mktemp("state")
    cfg = PipelineConfig(trainer=TrainerConfig(accelerator="cpu", devices=1), run_dir=root / "run",
                         repos=[RepoConfig(path=built["repo"])])
    cfg.model.name_or_path = str(built["root"] / "model")
    index = shutil.copytree(built["root"] / "index", cfg.run_dir / "index" / "00-repo_0")
    state = RunState(cfg.run_dir, cfg)
    entry = RepoEntry("repo_0", built["repo"], digests(built["repo"], "random"))
    state.extend([entry], [entry])
    job = {"out": "00-repo_0/evaluate-00", "index": str(index), "timings": {"embed": 0.1, "total": 1.0}}
    state.record(stage_name(0, "repo_0", EVAL_UNTRAINED), {**EVAL, "checkpoint": cfg.model.name_or_path})
    state.record(stage_name(0, "repo_0", TRAIN), {"checkpoint": "ckpt", "epoch": 1, "metrics": {"Recall@10_val": 60.0}})
    state.record(stage_name(0, "repo_0", FISHER), {"fisher": "fisher.safetensors"})
    state.record(stage_name(0, "repo_0", eval_stage(0, "repo_0")), {**EVAL, "checkpoint": "ckpt", "job": job})
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump(json.loads(cfg.model_dump_json())))
    return {"config": config, "run_dir": cfg.run_dir, "manifest": json.loads(state.path.read_text())}


def _stages(m: dict) -> dict:
    return m["repos"]["00-repo_0"]["stages"]


def _set(edit: Callable[[dict], None]) -> Callable[[dict], Any]:
    def damaged(m: dict) -> dict:
        edit(m)
        return m
    return damaged


# (what is damaged, the manifest's new content: a dict, or bytes as they are, and what the line must name)
DAMAGED: list[tuple[str, Callable[[dict], Any], str]] = [
    ("cut short", lambda m: json.dumps(m).encode()[: len(json.dumps(m)) // 2], "cut short"),
    ("an array", lambda m: [m], "a JSON list, not a run manifest"),
    ("order a number", _set(lambda m: m.update(order=5)), "order: "),
    ("order holding a number", _set(lambda m: m.update(order=["repo_0", 7])), "order.1: "),
    ("repos an array", _set(lambda m: m.update(repos=[])), "repos: "),
    ("a repository an array", _set(lambda m: m["repos"].update({"00-repo_0": []})), "repos.00-repo_0: "),
    ("stages an array", _set(lambda m: m["repos"]["00-repo_0"].update(stages=[])), "repos.00-repo_0.stages: "),
    ("a stage a string", _set(lambda m: _stages(m).update(train="done")), "stages.train: "),
    ("a result a string", _set(lambda m: _stages(m)["train"].update(result="fine")), "stages.train.result: "),
    ("config an array", _set(lambda m: m.update(config=[])), "config: "),
    ("a config section an array", _set(lambda m: m["config"].update(lifelong=[])), "config.lifelong: "),
    ("a finished stage without result", _set(lambda m: _stages(m)["fisher"].pop("result")), "stages.fisher: "),
    ("a recall a string", _set(lambda m: _stages(m)["eval-00-repo_0"]["result"]["metrics"].update(
        {"Recall@10": "high"})), "result.metrics.Recall@10: "),
    ("the index a number", _set(lambda m: _stages(m)["eval-00-repo_0"]["result"]["job"].update(index=5)),
     "result.job.index: "),
    ("an epoch below 0", _set(lambda m: _stages(m)["train"]["result"].update(epoch=-3)), "result.epoch: "),
]

COMMANDS = {
    "run": lambda run: ["run", "--config", str(run["config"])],
    "report": lambda run: ["report", str(run["run_dir"])],
    "serve": lambda run: ["serve", str(run["run_dir"]), "--port", "0"],
    "retrieve": lambda run: ["retrieve", str(run["run_dir"]), "--state", STATE, "-k", "3"],
}


def _command(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as ended:
        main(argv)
    return int(ended.value.code or 0)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("what, damage, names", DAMAGED, ids=[d[0] for d in DAMAGED])
def test_a_manifest_of_the_wrong_shape_is_one_line_naming_the_file_and_key(run, capsys, command, what, damage,
                                                                          names) -> None:
    path = run["run_dir"] / "manifest.json"
    content = damage(copy.deepcopy(run["manifest"]))
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    try:
        code = _command(COMMANDS[command](run))
    finally:
        path.write_text(json.dumps(run["manifest"]))
    err = capsys.readouterr().err
    assert code == 1, (what, command, err)
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("error: "), (what, command, err)
    assert str(path) in err and names in err, (what, command, err)


@pytest.mark.parametrize("command", ["run", "report", "retrieve"])
def test_the_undamaged_manifest_gives_each_commands_answer(run, capsys, command) -> None:
    assert _command(COMMANDS[command](run)) == 0
    out = capsys.readouterr().out
    assert {"run": "nothing new: 1 repository trained, 0 waiting", "report": "repo_0",
            "retrieve": "RepoA"}[command] in out, out


@pytest.mark.parametrize("command", ["report", "serve", "retrieve"])
def test_a_manifest_of_gigabytes_is_refused_from_its_size(run, tmp_path, command) -> None:
    """A manifest.json that is a 2 GB sparse file cost 4.1-4.6 GB of memory per read: `report` 20.8 s, `serve` 28.5
    s, `retrieve` still running at 60 s. Now one line from its size, before torch, in the memory of a refusal."""
    big = tmp_path / "run"
    big.mkdir()
    with open(big / "manifest.json", "wb") as f:
        f.truncate(2 << 30)
    argv = COMMANDS[command]({"run_dir": big, "config": run["config"]})
    code, torch_loaded, err, peak = command_alone(argv, tmp_path)
    assert code == 1 and not torch_loaded and err.count("\n") == 1, err
    assert err.startswith(f"error: {big / 'manifest.json'}: 2.1 GB, more than a run manifest ever holds"), err
    idle = command_alone(COMMANDS[command]({"run_dir": tmp_path / "none", "config": run["config"]}), tmp_path)
    assert idle[0] == 1 and peak - idle[3] < 100 * 2**20, (peak, idle)  # a refusal's memory, not the file's
