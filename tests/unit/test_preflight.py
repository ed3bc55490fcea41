"""Preflight refuses, before any launch and without writing anything: too few GPUs, a bad rendezvous endpoint,
a missing model folder, an unknown hub id offline, too little disk, an invalid dataset. Real files throughout."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from transformers import T5EncoderModel

from leanagent.data.synthetic import write_demo_repos
from leanagent.ground.config import PipelineConfig, RepoConfig, TrainerConfig
from leanagent.ground.job import JobInputError, JobRequest
from leanagent.launch.local import check_rendezvous
from leanagent.launch.registry import config_problems
from leanagent.launch.slurm import PLUGIN
from leanagent.model.presets import PRESETS, encoder_config, write_random_encoder
from leanagent.preflight.checks import (
    PreflightError,
    count_parameters,
    estimate_run,
    preflight_job,
    preflight_run,
    resolve_model,
)
from leanagent.preflight.run_job import check_job

BIG = 1 << 50  # free bytes that fit anything


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("preflight")
    repos = write_demo_repos(root / "data", 2, seed=5)
    return {"root": root, "repo": repos[0], "repo_b": repos[1], "model": write_random_encoder(root / "model", "tiny")}


def cpu_config(assets, tmp_path: Path, **sections) -> PipelineConfig:
    raw = {"model": {"name_or_path": str(assets["model"])}, "trainer": {"accelerator": "cpu", "devices": 2},
           "run_dir": str(tmp_path / "run"), "repos": [{"path": str(assets["repo"])}, {"path": str(assets["repo_b"])}]}
    for key, values in sections.items():
        raw.setdefault(key, {}).update(values)
    return PipelineConfig.model_validate(raw)


def _job(cfg: PipelineConfig, program: str, dataset: Path, out: Path, **fields) -> JobRequest:
    return JobRequest(program=program, config=cfg, datasets=(dataset,), out=out, **fields)


def refusal(call, *args, **kwargs) -> str:
    with pytest.raises(PreflightError) as info:
        call(*args, **kwargs)
    assert isinstance(info.value, JobInputError)  # bad input: the CLI exits 1, the flow does not retry
    return str(info.value)


def test_a_good_job_and_run_pass(assets, tmp_path):
    cfg = cpu_config(assets, tmp_path)
    preflight_job(_job(cfg, "train", assets["repo"], tmp_path / "job"), free_bytes=BIG)
    preflight_run(cfg, free_bytes=BIG)
    assert not (tmp_path / "job").exists() and not (tmp_path / "run").exists()  # nothing written


def test_too_few_gpus_names_both_numbers(assets, tmp_path):
    visible = torch.cuda.device_count()  # 0 on this machine
    devices = max(4, visible + 1)
    cfg = cpu_config(assets, tmp_path, trainer={"accelerator": "gpu", "devices": devices})
    message = refusal(preflight_job, _job(cfg, "evaluate", assets["repo"], tmp_path / "job"))
    assert f"trainer.devices: {devices}" in message and f"torch sees {visible}" in message
    assert len(message.splitlines()) == 1
    assert f"torch sees {visible}" in refusal(preflight_run, cfg)
    cuda = cpu_config(assets, tmp_path, trainer={"accelerator": "cuda", "devices": 2})
    assert "sees 1" in refusal(preflight_run, cuda, device_count=1, free_bytes=BIG)
    preflight_run(cuda, device_count=2, free_bytes=BIG)


@pytest.mark.parametrize("endpoint", ["host0", "host0:port", "host0:70000", ":29500", "host0:29500/x"])
def test_bad_rendezvous_endpoint_is_refused(assets, tmp_path, endpoint):
    trainer = {"num_nodes": 2, "rdzv_endpoint": endpoint}
    message = refusal(preflight_job, _job(cpu_config(assets, tmp_path, trainer=trainer), "evaluate", assets["repo"],
                                          tmp_path / "job"))
    assert f"trainer.rdzv_endpoint {endpoint!r} is not host:port" in message


def test_good_rendezvous_endpoints_pass():
    for endpoint in ("host0:29500", "10.0.0.1:1", "[::1]:29500"):
        assert check_rendezvous(TrainerConfig(num_nodes=2, rdzv_endpoint=endpoint)) == []
    assert check_rendezvous(TrainerConfig(num_nodes=1, rdzv_endpoint="whatever")) == []


def test_missing_model_folder_is_refused(assets, tmp_path):
    missing = tmp_path / "models" / "byt5"
    cfg = cpu_config(assets, tmp_path, model={"name_or_path": str(missing)})
    message = refusal(preflight_job, _job(cfg, "train", assets["repo"], tmp_path / "job"))
    assert message == f"model.name_or_path {missing}: no such model folder; point it at a folder holding " \
                      f"config.json, or at a hub id"
    empty = tmp_path / "empty_model"
    empty.mkdir()
    cfg = cpu_config(assets, tmp_path, model={"name_or_path": str(empty)})
    assert "a folder without config.json" in refusal(preflight_run, cfg)


def test_unknown_hub_id_offline_is_refused_with_the_fix(assets, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    hub_id = "leanagent-tests/no-such-retriever"
    cfg = cpu_config(assets, tmp_path, model={"name_or_path": hub_id})
    message = refusal(preflight_run, cfg)
    assert f"model.name_or_path {hub_id!r}" in message and "HF_HUB_OFFLINE" in message
    assert f"hf download {hub_id}" in message and "local model folder" in message
    # A job that starts from a checkpoint carries its architecture: no model needed.
    checkpoint = tmp_path / "start.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"encoder_config": encoder_config("tiny").to_dict()}},
               checkpoint)
    preflight_job(_job(cfg, "evaluate", assets["repo"], tmp_path / "job", checkpoint=checkpoint), free_bytes=BIG)


def test_a_cached_hub_id_resolves_offline(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    repo = tmp_path / "hf-cache" / "models--someone--retriever"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    (snapshot / "config.json").write_text(encoder_config("tiny").to_json_string())
    config, problem = resolve_model("someone/retriever")
    assert problem is None and config["d_model"] == 64


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_parameter_count_from_config_json_matches_the_model(preset):
    config = encoder_config(preset)
    with torch.device("meta"):
        model = T5EncoderModel(config)
    assert count_parameters(config.to_dict()) == sum(p.numel() for p in model.parameters())


def test_too_little_disk_says_needed_free_and_the_option(assets, tmp_path):
    cfg = cpu_config(assets, tmp_path, lifelong={"epochs_per_repo": 3})
    parameters = count_parameters(yaml.safe_load((assets["model"] / "config.json").read_text()))
    everything = estimate_run(cfg, parameters)
    assert (everything.checkpoints, everything.fishers) == (2 * (3 + 1), 2)  # save_top_k=-1: 3 epochs + last each
    message = refusal(preflight_run, cfg, free_bytes=everything.total - 1)
    assert message.startswith(f"disk: {cfg.run_dir} needs about ")
    assert "8 checkpoint(s) at once" in message and "2 Fisher file(s)" in message and "free" in message
    assert "lifelong.keep_checkpoints: best_and_last" in message
    preflight_run(cfg, free_bytes=everything.total)

    pruned = cpu_config(assets, tmp_path, lifelong={"epochs_per_repo": 3, "keep_checkpoints": "best_and_last"})
    smaller = estimate_run(pruned, parameters)
    assert smaller.checkpoints == 3 + (3 + 1) and smaller.total < everything.total
    preflight_run(pruned, free_bytes=smaller.total)

    # One training job: its epoch checkpoints and last.ckpt in --out's filesystem.
    message = refusal(preflight_job, _job(cfg, "train", assets["repo"], tmp_path / "job"), free_bytes=1000)
    assert "4 checkpoint(s) at once" in message and "1.0 KB free" in message and "trainer.save_top_k" in message
    assert not (tmp_path / "job").exists() and not cfg.run_dir.exists()


def test_invalid_dataset_is_refused_naming_the_file(assets, tmp_path):
    broken = shutil.copytree(assets["repo"], tmp_path / "broken")
    (broken / "corpus.jsonl").write_text((broken / "corpus.jsonl").read_text() + "{not json\n")
    cfg = cpu_config(assets, tmp_path)
    message = refusal(check_job, _job(cfg, "train", broken, tmp_path / "job"))
    assert message.startswith(f"{broken}: ") and "corpus.jsonl" in message and "nothing was launched" in message
    preflight_job(_job(cfg, "train", broken, tmp_path / "job", datasets_checked=True), free_bytes=BIG)  # the flow's


def test_every_problem_at_once_one_message_each(assets, tmp_path):
    cfg = cpu_config(assets, tmp_path, trainer={"accelerator": "gpu", "devices": 64, "num_nodes": 2,
                                                "rdzv_endpoint": "nohost"},
                     model={"name_or_path": str(tmp_path / "absent")})
    with pytest.raises(PreflightError) as info:
        preflight_run(cfg)
    problems = info.value.problems
    assert len(problems) == 3 and [p.split(" ", 1)[0] for p in problems] == [
        "trainer.accelerator:", "trainer.rdzv_endpoint", "model.name_or_path"]
    again = pickle.loads(pickle.dumps(info.value))  # Prefect stores a task's exception
    assert again.problems == problems and str(again) == str(info.value)


def test_a_refused_flow_writes_nothing_into_run_dir(assets, tmp_path):
    from leanagent.flows.lifelong import lifelong_retrieval

    cfg = cpu_config(assets, tmp_path, trainer={"accelerator": "gpu", "devices": 64})
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    state = lifelong_retrieval.fn(config_path=str(config))  # the flow's body, before any Prefect task
    # The flow run ends Failed with the reason as its message (what the UI shows), not with a traceback.
    assert state.is_failed() and "trainer.devices: 64" in state.message and isinstance(state.data, PreflightError)
    assert not cfg.run_dir.exists()


def test_a_run_dir_or_job_folder_that_cannot_be_written_is_refused_first(assets, tmp_path, unwritable_folder):
    """A file where run_dir goes (or where a parent of it goes), or a folder that takes no file, is one problem
    naming run_dir, listed first: the flow would otherwise fail at its lock, after Prefect started."""
    notes = tmp_path / "notes.txt"
    notes.write_text("a user's file")
    for run_dir, expected in ((notes, f"run_dir {notes} exists and is not a folder; nothing was overwritten"),
                              (notes / "run", f"run_dir {notes / 'run'}: its parent {notes} is not a folder"),
                              (unwritable_folder / "run", f"run_dir {unwritable_folder / 'run'}: cannot write in "
                                                          f"{unwritable_folder} (")):
        cfg = cpu_config(assets, tmp_path).model_copy(update={"run_dir": run_dir})
        with pytest.raises(PreflightError) as info:
            preflight_run(cfg, free_bytes=BIG)
        assert info.value.problems[0].startswith(expected) and len(info.value.problems) == 1, info.value.problems
        with pytest.raises(PreflightError) as info:
            preflight_job(_job(cfg, "train", assets["repo"], run_dir / "jobs" / "train"), free_bytes=BIG)
        assert info.value.problems[0].startswith("job folder ") and len(info.value.problems) == 1
    assert notes.read_text() == "a user's file" and not any(unwritable_folder.iterdir())


def test_repositories_need_distinct_names_and_at_least_one(assets, tmp_path):
    twins = cpu_config(assets, tmp_path).model_copy(update={"repos": [RepoConfig(path=assets["repo"]),
                                               RepoConfig(path=assets["repo_b"], name=assets["repo"].name)]})
    message = refusal(preflight_run, twins, free_bytes=BIG)
    assert f"both named {assets['repo'].name!r}" in message and "give one a distinct `name`" in message
    empty = twins.model_copy(update={"repos": []})
    assert "lists no repository" in refusal(preflight_run, empty, free_bytes=BIG)


def test_the_slurm_section_is_checked_with_the_config(assets, tmp_path):
    base = {"launcher": "slurm", "trainer": {"accelerator": "cpu", "devices": 2, "num_nodes": 2}}
    cfg = PipelineConfig.model_validate(base)  # no rdzv_endpoint needed: the job finds its first node
    slurm = PLUGIN.settings(cfg)
    assert config_problems(cfg) == [] and slurm.nodes is None and slurm.max_requeues == 3
    assert config_problems(PipelineConfig.model_validate({**base, "slurm": {"nodes": 3}})) == [
        "slurm.nodes is 3 but trainer.num_nodes is 2: the ranks are trainer.devices x trainer.num_nodes, so set "
        "both alike"]
    assert config_problems(PipelineConfig.model_validate({**base, "slurm": {"partitions": "gpu"}})) == [
        "slurm.partitions: unknown key (did you mean 'partition'?)"]
    [local] = config_problems(PipelineConfig.model_validate({**base, "launcher": "local"}))
    assert local.startswith("trainer.rdzv_endpoint (host:port of node 0) is required when trainer.num_nodes > 1")
    # The preflight asks the same (a config built in Python, or in the Prefect UI), under any launcher.
    bad = cpu_config(assets, tmp_path, slurm={"partitions": "gpu"})
    assert refusal(preflight_run, bad, free_bytes=BIG) == "slurm.partitions: unknown key (did you mean 'partition'?)"


def test_launcher_slurm_without_slurms_commands_is_refused_naming_them(assets, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # a machine without SLURM
    cfg = cpu_config(assets, tmp_path).model_copy(update={"launcher": "slurm"})
    message = refusal(preflight_run, cfg, free_bytes=BIG)
    assert message.startswith("launcher: slurm needs SLURM's commands, but sbatch, squeue, scontrol, scancel, sinfo "
                              "is not on PATH"), message
    assert "\n" not in message
