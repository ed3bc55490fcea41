"""The checks of a run before anything is written (`leanagent.run.plan`), on real dataset folders, without Prefect:
which repositories a config gives (`repos`, then `repos_dir`), what a continued run adds, and the first answers
`leanagent run` gives (a key typo, an unreachable hub) without their noise."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from leanagent.data.merge import digests
from leanagent.ground.config import ConfigError, PipelineConfig, RepoConfig, TrainerConfig, load_config
from leanagent.run.manifest import RepoEntry, repo_stages
from leanagent.run.plan import plan_run, progress_line
from leanagent.run.state import RunState


def _cfg(demo_assets, tmp_path: Path, repos: list[Path], **update) -> PipelineConfig:
    cfg = PipelineConfig(trainer=TrainerConfig(accelerator="cpu", devices=2), run_dir=tmp_path / "run",
                         repos=[RepoConfig(path=p) for p in repos])
    cfg.model.name_or_path = str(demo_assets.model)
    return cfg.model_copy(update=update)


def _record(cfg: PipelineConfig, repos: list[Path]) -> None:
    """A run_dir whose manifest holds `repos` as its sequence, as a first run leaves it."""
    entries = [RepoEntry(p.name, p, digests(p, "random")) for p in repos]
    RunState(cfg.run_dir, cfg).extend(entries, entries)


def test_a_config_that_lists_one_more_repository_continues_with_it_alone(demo_assets, tmp_path: Path) -> None:
    first = _cfg(demo_assets, tmp_path, demo_assets.repos[:2])
    assert [e.name for e in plan_run(first).recorded] == []
    _record(first, demo_assets.repos[:2])
    plan = plan_run(_cfg(demo_assets, tmp_path, demo_assets.repos))
    assert [e.name for e in plan.recorded] == ["repo_0", "repo_1"]
    assert [r.display_name for r in plan.new] == ["repo_2"]
    assert plan.nothing_new() is None


def test_repos_dir_takes_ready_folders_by_name_and_skips_the_others(demo_assets, tmp_path: Path) -> None:
    incoming = tmp_path / "incoming"
    for repo in demo_assets.repos[1:]:
        shutil.copytree(repo, incoming / repo.name)
    shutil.copytree(demo_assets.repos[0], incoming / ".arriving")  # being copied: never read
    broken = shutil.copytree(demo_assets.repos[0], incoming / "broken")
    (broken / "corpus.jsonl").write_text("{not json\n")
    shutil.copytree(demo_assets.repos[0], incoming / "repo_0")  # named like a listed repository
    plan = plan_run(_cfg(demo_assets, tmp_path, demo_assets.repos[:1], repos_dir=incoming))
    assert [r.display_name for r in plan.repos] == ["repo_0", "repo_1", "repo_2"]
    assert plan.repos[1].path == incoming / "repo_1"
    skipped = {n.name: n.problem for n in plan.not_ready}
    assert set(skipped) == {"broken", "repo_0"}
    assert skipped["broken"].startswith("broken/corpus.jsonl:1: ")  # the first problem, as file:line
    assert "named like the repository" in skipped["repo_0"]
    with pytest.raises(ValueError, match="repos_dir .*/absent: no such folder"):
        plan_run(_cfg(demo_assets, tmp_path, [], repos_dir=tmp_path / "absent"))


def test_an_empty_repos_dir_is_nothing_new_not_an_error(demo_assets, tmp_path: Path) -> None:
    (tmp_path / "incoming").mkdir()
    plan = plan_run(_cfg(demo_assets, tmp_path, [], repos_dir=tmp_path / "incoming"))
    assert plan.repos == [] and plan.nothing_new() == "nothing new: 0 repositories trained, 0 waiting"
    assert not (tmp_path / "run").exists()


def test_an_unknown_key_names_the_nearest_known_one(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"devcies": 2}, "repo": [], "lifelong": {"zzz": 1}}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "trainer.devcies: unknown key (did you mean 'devices'?)" in message
    assert "repo: unknown key (did you mean 'repos'?)" in message
    assert "lifelong.zzz: unknown key; known here: epochs_per_repo, curriculum" in message


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("offline", [False, True])
def test_a_hub_model_out_of_reach_is_said_once(tmp_path: Path, offline: bool) -> None:
    """An unreachable hub (a closed local port, answered at once) or HF_HUB_OFFLINE: one message, no retries."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}")
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    probe = "from leanagent.preflight.checks import resolve_model; print(resolve_model('owner/model')[1])"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    expected = "the hub is offline (HF_HUB_OFFLINE)" if offline else "cannot be fetched from the hub"
    assert done.stdout.count(expected) == 1, done.stdout
    assert "Retrying" not in done.stderr and done.stderr.strip() == "", done.stderr


def test_the_documented_upload_rule_hides_a_copy_until_it_is_renamed(demo_assets, tmp_path: Path) -> None:
    """docs/continuing.md's upload command, run as written: the copy is invisible under its dot-name, then ready."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "continuing.md").read_text()
    command = docs.split("<!-- upload-rule -->", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0].strip()
    shutil.copytree(demo_assets.repos[2], tmp_path / "demo" / "more" / "repo_3")
    incoming = tmp_path / "incoming"  # configs/scheduled.yaml's repos_dir
    cfg = _cfg(demo_assets, tmp_path, [], repos_dir=incoming)
    incoming.mkdir(parents=True)
    shutil.copytree(demo_assets.repos[2], incoming / ".repo_3")  # what the command's copy leaves before its rename
    assert plan_run(cfg).repos == []
    shutil.rmtree(incoming / ".repo_3")
    subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=tmp_path, check=True, timeout=60)
    assert [r.display_name for r in plan_run(cfg).repos] == ["repo_3"]


def test_the_progress_line_names_the_waiting_repositories_before_the_not_ready_count() -> None:
    assert progress_line(4, ["repo_4"], 1) == "4 repositories trained, 1 waiting (repo_4), 1 not ready in repos_dir"
    assert progress_line(1, [], 0) == "1 repository trained, 0 waiting"
    assert progress_line(3, 0, 2) == "3 repositories trained, 0 waiting, 2 not ready in repos_dir"


@pytest.mark.parametrize("text, says", [('{"version": 2, "repos": {"00-repo_0": {"sta', "not valid JSON at line 1"),
                                        ("[]", "a JSON list, not a run manifest")])
def test_a_cut_or_foreign_manifest_is_one_line_naming_it(demo_assets, tmp_path: Path, text: str, says: str) -> None:
    cfg = _cfg(demo_assets, tmp_path, demo_assets.repos[:1])
    cfg.run_dir.mkdir(parents=True)
    manifest = cfg.run_dir / "manifest.json"
    manifest.write_text(text)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    for command in (["run", "--config", str(config)], ["report", str(cfg.run_dir)]):
        proc = subprocess.run([sys.executable, "-m", "leanagent.cli", *command], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 1, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {manifest}: {says}"), proc.stderr
    assert manifest.read_text() == text  # nothing changed


def test_set_overrides_are_typed_and_checked_as_the_file_is(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  lr: 0.001\nrun_dir: runs/x\n")
    cfg = load_config(config, ["model.lr=2e-4", "lifelong.ewc_lambda=0.1", "trainer.devices=2", "run_dir=runs/y"])
    assert (cfg.model.lr, cfg.lifelong.ewc_lambda, cfg.trainer.devices) == (2e-4, 0.1, 2)
    assert cfg.run_dir == tmp_path / "runs" / "y"  # relative to the file, as its own keys
    with pytest.raises(ConfigError, match=r"model\.lrr: unknown key \(did you mean 'lr'\?\)"):
        load_config(config, ["model.lrr=2e-4"])
    with pytest.raises(ConfigError, match=r"lifelong\.ewc_lambda: Input should be greater than or equal to 0"):
        load_config(config, ["lifelong.ewc_lambda=-1"])
    with pytest.raises(ConfigError, match=r"--set model\.lr: expected KEY=VALUE"):
        load_config(config, ["model.lr"])
    with pytest.raises(ConfigError, match=r"model\.lr is a value, not a section"):
        load_config(config, ["model.lr.x=1"])


def test_run_set_refuses_an_unknown_key_in_one_line(demo_assets, tmp_path: Path) -> None:
    cfg = _cfg(demo_assets, tmp_path, demo_assets.repos[:1])
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    proc = subprocess.run([sys.executable, "-m", "leanagent.cli", "run", "--config", str(config), "--set",
                           "lifelong.ewc_lamda=0.1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"error: {config} with --set lifelong.ewc_lamda=0.1: lifelong.ewc_lamda: unknown key (did you mean "
        f"'ewc_lambda'?)"]
    # A top-level key of --set is checked by the launcher registry (it could be a launcher's section): it names
    # --set as well, not the file alone.
    proc = subprocess.run([sys.executable, "-m", "leanagent.cli", "run", "--config", str(config), "--set",
                           "modle.lr=0.1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"error: {config} with --set modle.lr=0.1: modle: unknown key (did you mean 'model'?)"]
    assert not cfg.run_dir.exists()


def test_a_replay_fraction_outside_zero_one_is_one_line_before_any_job(demo_assets, tmp_path: Path) -> None:
    cfg = _cfg(demo_assets, tmp_path, demo_assets.repos[:2])
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    sets = ["--set", "lifelong.dataset_strategy=replay", "--set", "lifelong.replay_fraction=1.5"]
    proc = subprocess.run([sys.executable, "-m", "leanagent.cli", "run", "--config", str(config), *sets],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"error: {config} with --set lifelong.dataset_strategy=replay lifelong.replay_fraction=1.5: "
        f"lifelong.replay_fraction: 1.5 is outside (0, 1]: the share of each earlier repository's training theorems "
        f"replayed (0 is dataset_strategy: single, 1 is merge_all)"]
    assert not cfg.run_dir.exists()


def _finished(stage: str) -> dict:
    """What a finished stage's result holds at least (the manifest refuses a finished stage without it)."""
    kind = stage.split("/")[-1]
    if kind.startswith("eval-"):
        return {"metrics": {"Recall@10": 50.0}}
    return {"train": {"checkpoint": "c.ckpt"}, "fisher": {"fisher": "f.safetensors"}}.get(kind, {})


def test_a_config_the_run_is_ahead_of_has_nothing_new_and_one_that_contradicts_it_is_refused(
        demo_assets, tmp_path: Path) -> None:
    """The run's first config, rerun after a continuation added repositories, lists the beginning of the sequence:
    nothing new, naming what the run has beyond it and the config that gave it. A hole in the middle, or a prefix
    with something new after it, still contradicts the run."""
    cfg = _cfg(demo_assets, tmp_path, demo_assets.repos)
    entries = [RepoEntry(p.name, p, digests(p, "random")) for p in demo_assets.repos]
    RunState(cfg.run_dir, cfg).extend(entries[:2], entries[:2], "configs/demo.yaml")
    state = RunState(cfg.run_dir, cfg)
    state.extend(entries, entries, "demo/more.yaml")
    names = [e.name for e in entries]
    for stage in (stage for i in range(len(names)) for stage in repo_stages(i, names)):
        state.record(stage, _finished(stage))  # every stage finished, as a run of the three leaves it
    behind = plan_run(_cfg(demo_assets, tmp_path, demo_assets.repos[:2]), source="configs/demo.yaml")
    assert behind.nothing_new() == "nothing new: the run is ahead of this config (repo_2, from demo/more.yaml)"
    assert behind.kept == ["repo_0", "repo_1"] and behind.new == []
    assert plan_run(_cfg(demo_assets, tmp_path, demo_assets.repos[:1])).nothing_new() == (
        "nothing new: the run is ahead of this config (repo_1, from configs/demo.yaml; repo_2, from demo/more.yaml)")
    before = (cfg.run_dir / "manifest.json").read_text()
    RunState(cfg.run_dir, cfg).extend(entries[:2], entries[:2], "configs/demo.yaml")  # what the flow does with it
    assert (cfg.run_dir / "manifest.json").read_text() == before  # the run keeps its sequence
    with pytest.raises(ValueError, match="repository 'repo_1' .* is not in the config any more"):
        plan_run(_cfg(demo_assets, tmp_path, [demo_assets.repos[0], demo_assets.repos[2]]))
    extra = shutil.copytree(demo_assets.repos[2], tmp_path / "data" / "repo_9")
    (extra / "random" / "test.json").write_text((extra / "random" / "test.json").read_text() + "\n")  # other data
    with pytest.raises(ValueError, match="repository 'repo_2' .* is not in the config any more"):
        plan_run(_cfg(demo_assets, tmp_path, [*demo_assets.repos[:2], extra]))


def test_a_plan_is_a_typed_flow_parameter(demo_assets, tmp_path: Path) -> None:
    """`leanagent run` hands its plan to the flow as a parameter: Prefect stores it as JSON, and reads it back."""
    from leanagent.flows.lifelong import lifelong_retrieval

    plan = plan_run(_cfg(demo_assets, tmp_path, demo_assets.repos[:2]), source="run.yaml")
    assert type(plan).model_validate_json(plan.model_dump_json()) == plan
    schema = lifelong_retrieval.parameters.model_dump()["properties"]
    assert {"config", "config_path", "options", "plan"} <= set(schema)
