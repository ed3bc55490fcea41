"""The launcher registry: `launcher: NAME` and each launcher's own section, checked where config.py cannot.

config.py (the ground layer) knows no launcher: it keeps a launcher's section as written; the registry
validates it with that launcher's model, wherever a config is loaded for a run or a job. Real files throughout.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from leanagent.cli import main as cli_main
from leanagent.ground.config import ConfigError, PipelineConfig, dump_config, load_config
from leanagent.launch import local, slurm, warm
from leanagent.launch.base import LauncherPlugin
from leanagent.launch.registry import config_problems, launcher_for, load_checked_config, plugins
from leanagent.run.fingerprint import config_fingerprint
from leanagent.run.sweep import load_sweep_file

REPO_ROOT = Path(__file__).resolve().parents[2]


def problems(raw: dict) -> list[str]:
    return config_problems(PipelineConfig.model_validate(raw))


def test_the_built_in_launchers_are_found_by_their_modules():
    assert plugins() == {"local": local.PLUGIN, "slurm": slurm.PLUGIN, "warm": warm.PLUGIN}
    assert launcher_for(PipelineConfig()).__class__.__name__ == "LocalLauncher"
    assert launcher_for(PipelineConfig(launcher="slurm")).__class__.__name__ == "SlurmLauncher"
    assert launcher_for(PipelineConfig(launcher="warm")).__class__.__name__ == "WarmLauncher"


@pytest.mark.parametrize(("raw", "expected"), [
    ({"launcher": "slrum"},
     "launcher: 'slrum' is not a known launcher (did you mean 'slurm'?); known: local, slurm, warm"),
    ({"launcher": "kubernetes"}, "launcher: 'kubernetes' is not a known launcher; known: local, slurm, warm"),
    ({"slrum": {"partition": "gpu"}}, "slrum: unknown key (did you mean 'slurm'?)"),
    ({"trainr": {"devices": 2}}, "trainr: unknown key (did you mean 'trainer'?)"),
    ({"slurm": {"partitions": "gpu"}}, "slurm.partitions: unknown key (did you mean 'partition'?)"),
    ({"slurm": {"nodes": 0}}, "slurm.nodes: Input should be greater than 0"),
    ({"launcher": "slurm", "slurm": {"gpus_per_node": 8}},
     "slurm.gpus_per_node is 8 but trainer.devices is 4: the ranks are trainer.devices x trainer.num_nodes, so set "
     "both alike"),
])
def test_each_mistake_is_one_line_naming_the_key(raw, expected):
    assert problems(raw) == [expected]


def test_good_sections_pass_and_cross_checks_are_the_chosen_launchers():
    assert problems({}) == [] and problems({"slurm": None}) == []  # `slurm:` with nothing under it: its defaults
    two_nodes = {"trainer": {"num_nodes": 2}}
    # Under SLURM the job finds its first node; the local launcher needs node 0's address.
    assert problems({**two_nodes, "launcher": "slurm"}) == []
    [needed] = problems(two_nodes)
    assert needed.startswith("trainer.rdzv_endpoint (host:port of node 0) is required when trainer.num_nodes > 1 "
                             "with launcher: local")
    assert problems({"trainer": {"num_nodes": 2, "rdzv_endpoint": "host0:29500"}}) == []


def test_a_loaded_config_names_its_file_and_keeps_the_sections_it_does_not_interpret(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("launcher: slurm\nslurm: {partition: debug, time: '1:00:00'}\n")
    cfg = load_checked_config(path)
    assert slurm.PLUGIN.settings(cfg).partition == "debug" and cfg.section("slurm") == {"partition": "debug",
                                                                                         "time": "1:00:00"}
    # Written for the ranks and read back there by the ground layer alone: the section travels as written.
    dump_config(cfg, tmp_path / "dumped.yaml")
    assert load_config(tmp_path / "dumped.yaml").section("slurm") == cfg.section("slurm")
    path.write_text("launcher: slurm\nslurm: {partiton: debug}\n")
    load_config(path)  # the ground layer does not know it...
    with pytest.raises(ConfigError) as info:  # ...the registry does, before anything starts
        load_checked_config(path)
    assert str(info.value) == f"{path}: slurm.partiton: unknown key (did you mean 'partition'?)"
    path.write_text("run_dr: runs\n")  # a scalar is no launcher's section: refused by the ground layer itself
    with pytest.raises(ConfigError, match="run_dr: unknown key"):
        load_config(path)


def test_the_example_configs_still_load():
    for path in sorted((REPO_ROOT / "configs").glob("*.yaml")):
        if "setups" in yaml.safe_load(path.read_text()):  # a sweep file (`leanagent sweep`): tests/unit/test_sweep.py
            assert load_sweep_file(path).sweep.setups, path
            continue
        cfg = load_checked_config(path)
        assert cfg.launcher in plugins(), path
    settings = slurm.PLUGIN.settings(load_checked_config(REPO_ROOT / "configs" / "slurm.yaml"))
    assert (settings.partition, settings.max_requeues, settings.poll_s) == ("gpu", 10, 30)


def test_how_a_job_is_launched_is_not_the_experiment(tmp_path):
    base = yaml.safe_load((REPO_ROOT / "configs" / "slurm.yaml").read_text())
    slurm_run = PipelineConfig.model_validate(base)
    local_run = PipelineConfig.model_validate({k: v for k, v in base.items() if k not in ("launcher", "slurm")})
    assert config_fingerprint(slurm_run) == config_fingerprint(local_run)
    other = PipelineConfig.model_validate({**base, "slurm": {**base["slurm"], "partition": "big"}})
    assert config_fingerprint(other) == config_fingerprint(slurm_run)
    changed = PipelineConfig.model_validate({**base, "trainer": {**base["trainer"], "devices": 2}})
    assert config_fingerprint(changed) != config_fingerprint(slurm_run)


def test_status_and_cancel_of_a_run_with_nothing_queued_say_so(tmp_path, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "jobs" / "00-repo" / "train").mkdir(parents=True)  # a local run's job folder: no queue knows it
    for command, expected in (("status", f"{run_dir}: nothing queued (no job of this run was submitted to a queue)"),
                              ("cancel", f"{run_dir}: nothing queued, nothing cancelled")):
        with pytest.raises(SystemExit) as info:
            cli_main([command, str(run_dir)])
        assert info.value.code == 0 and capsys.readouterr().out == expected + "\n"


@pytest.mark.parametrize("command", ["status", "cancel"])
def test_status_and_cancel_of_a_path_that_is_no_run_say_so_and_exit_1(command, tmp_path, capsys):
    """"nothing queued" would tell a user with a typo in the path that the run is idle."""
    notes = tmp_path / "notes.txt"
    notes.write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "manifest-only").mkdir()
    (tmp_path / "manifest-only" / "manifest.json").write_text("{}")  # a run before its first job: one all the same
    for path, expected in ((tmp_path / "missing", "no such folder (not a run_dir of `leanagent run`)"),
                           (notes, "a file, not a run_dir of `leanagent run`"),
                           (tmp_path / "empty", "a folder with neither manifest.json nor jobs/ (not a run_dir of "
                                                "`leanagent run`)")):
        with pytest.raises(SystemExit) as info:
            cli_main([command, str(path)])
        captured = capsys.readouterr()
        assert info.value.code == 1 and captured.out == "" and captured.err == f"error: {path}: {expected}\n"
    with pytest.raises(SystemExit) as info:
        cli_main([command, str(tmp_path / "manifest-only")])
    assert info.value.code == 0 and "nothing queued" in capsys.readouterr().out


def test_the_docs_sketch_of_a_launcher_of_ones_own_is_a_plugin():
    page = (REPO_ROOT / "docs" / "slurm.md").read_text()
    part = page[page.index("## Write your own launcher"):page.index("## How it is tested")]
    [code] = re.findall(r"```python\n(.*?)```", part, re.S)
    namespace: dict = {}
    exec(compile(code, "docs/slurm.md", "exec"), namespace)
    plugin = namespace["PLUGIN"]
    assert isinstance(plugin, LauncherPlugin) and plugin.name == "kube"
    cfg = PipelineConfig.model_validate({"launcher": "kube", "kube": {"namespace": "lean"}})
    assert plugin.launcher(cfg).kube.namespace == "lean" and plugin.check_config(cfg) == []
