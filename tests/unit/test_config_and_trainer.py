"""The seed's settings as defaults, config refusal, and the Trainer the factory builds from them."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from pytorch_lightning.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from pytorch_lightning.strategies import DDPStrategy

from leanagent.ground.config import (
    ONE_YEAR_SECONDS,
    ConfigError,
    PipelineConfig,
    Precision,
    TrainerConfig,
    load_config,
)
from leanagent.model.dtypes import resolve_precision
from leanagent.model.loading import load_retriever
from leanagent.train.trainer import build_fisher_trainer, build_training_trainer, ddp_strategy, job_precision


def test_seed_values_are_the_defaults():
    cfg = PipelineConfig()
    t = cfg.trainer
    assert (t.accelerator, t.devices, t.precision) == ("gpu", 4, "bf16-mixed")
    assert t.ddp_timeout_seconds == 7 * 24 * 60 * 60 * 52 == ONE_YEAR_SECONDS
    assert (t.gradient_clip_val, t.accumulate_grad_batches, t.log_every_n_steps, t.num_sanity_val_steps) == (
        1.0, 4, 1, 0)
    assert (t.early_stopping_patience, t.save_top_k) == (5, -1)
    assert cfg.model.name_or_path == "kaiyuy/leandojo-lean4-retriever-byt5-small"


def test_leanagent_hyper_parameters_are_the_defaults():
    """leanagent.py: lr 1e-3, warmup 1000, batch 4, eval batch 64, 3 negatives (1 in-file), 4 workers, seed 3407,
    1024-byte training sequences, the corpus embedded at the model's 512, EWC off, the newest checkpoint."""
    cfg = PipelineConfig()
    m, d, life = cfg.model, cfg.data, cfg.lifelong
    assert (m.lr, m.warmup_steps, m.max_seq_len, m.num_retrieved) == (1e-3, 1000, 512, 100)
    assert (d.batch_size, d.eval_batch_size, d.num_negatives, d.num_in_file_negatives, d.max_seq_len,
            d.num_workers) == (4, 64, 3, 1, 1024, 4)
    assert cfg.trainer.seed == 3407
    assert (life.ewc_lambda, life.fisher_estimator, life.checkpoint, life.epochs_per_repo) == (
        0.0, "per_example", "latest", 1)
    ewc = load_config(Path(__file__).resolve().parents[2] / "configs" / "leanagent-ewc.yaml")
    assert ewc.lifelong.ewc_lambda == 0.1
    assert ewc.model_dump(exclude={"lifelong", "run_dir", "repos"}) == cfg.model_dump(exclude={"lifelong", "run_dir",
                                                                                               "repos"})
    assert life.dataset_strategy == "single"
    configs = Path(__file__).resolve().parents[2] / "configs"
    for name, ewc_lambda in (("leanagent-merge-all.yaml", 0.0), ("leanagent-merge-all-ewc.yaml", 0.1)):
        merge = load_config(configs / name)
        assert (merge.lifelong.dataset_strategy, merge.lifelong.ewc_lambda) == ("merge_all", ewc_lambda), name
        assert merge.lifelong.model_dump(exclude={"dataset_strategy", "ewc_lambda"}) == life.model_dump(
            exclude={"dataset_strategy", "ewc_lambda"})
        assert merge.model_dump(exclude={"lifelong", "run_dir", "repos"}) == cfg.model_dump(
            exclude={"lifelong", "run_dir", "repos"})


def test_speed_levers_defaults_and_reach_the_retriever(tmp_path, tiny_model):
    # Sorting is on by default (the same loss, another dropout stream); compiling is on under CUDA only.
    assert (PipelineConfig().model.sort_by_length, PipelineConfig().model.token_budget,
            PipelineConfig().model.compile) == (True, 16384, "auto")
    path = tmp_path / "cfg.yaml"
    path.write_text(f"model: {{name_or_path: {tiny_model}, sort_by_length: false, token_budget: 2048, "
                    f"compile: true}}\n")
    model = load_retriever(load_config(path), None)
    assert (model.options.sort_by_length, model.options.token_budget, model.options.compile) == (
        False, 2048, True)


def test_seed_strategy_timeout():
    strategy = ddp_strategy(TrainerConfig())
    assert isinstance(strategy, DDPStrategy)
    assert strategy._timeout == timedelta(seconds=ONE_YEAR_SECONDS)
    assert strategy.process_group_backend == "nccl"


@pytest.mark.parametrize(
    "yaml_text, key",
    [
        ("trainer: {devcies: 2}\n", "trainer.devcies"),
        ("trainer: {devices: two}\n", "trainer.devices"),
        ("lifelong: {ewc_lambda: -1}\n", "lifelong.ewc_lambda"),
        ("unknown_section: 1\n", "unknown_section"),
        ("data: {num_negatives: 1, num_in_file_negatives: 2}\n", "data"),
        ("model: {compile: sometimes}\n", "model.compile"),
        ("model: {token_budget: 0}\n", "model.token_budget"),
        ("lifelong: {dataset_strategy: replay, replay_fraction: 0}\n", "lifelong.replay_fraction: 0.0 is outside"),
        ("lifelong: {dataset_strategy: replay, replay_fraction: 1.01}\n", "lifelong.replay_fraction: 1.01 is outside"),
        ("lifelong: {dataset_strategy: replay}\n", "replay needs lifelong.replay_fraction"),
        ("lifelong: {replay_fraction: 0.5}\n", "lifelong.replay_fraction (0.5) is set but lifelong.dataset_strategy is "
                                               "single"),
    ],
)
def test_bad_config_is_refused_naming_the_key(tmp_path, yaml_text, key):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value) and key in str(info.value)


def test_relative_paths_resolve_against_the_config_file(tmp_path):
    (tmp_path / "model").mkdir()
    path = tmp_path / "sub" / "cfg.yaml"
    path.parent.mkdir()
    path.write_text("model: {name_or_path: ../model}\nrun_dir: runs\nrepos: [{path: ../data/r}]\n")
    cfg = load_config(path)
    assert cfg.model.name_or_path == str((tmp_path / "model").resolve())
    assert cfg.run_dir == (tmp_path / "sub" / "runs").resolve()
    assert cfg.repos[0].path == (tmp_path / "data" / "r").resolve() and cfg.repos[0].display_name == "r"


def test_training_trainer_has_every_seed_setting(tmp_path):
    cfg = TrainerConfig(accelerator="cpu", devices=1)
    trainer = build_training_trainer(cfg, tmp_path, max_epochs=3)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert os.environ["NCCL_TIMEOUT"] == str(ONE_YEAR_SECONDS * 1000)
    assert trainer.gradient_clip_val == 1.0 and trainer.accumulate_grad_batches == 4
    assert trainer.max_epochs == 3 and trainer.log_every_n_steps == 1 and trainer.num_sanity_val_steps == 0
    assert trainer.default_root_dir == str(tmp_path)
    assert trainer.precision == "bf16-mixed"
    assert isinstance(trainer.strategy, DDPStrategy)
    assert trainer.strategy._timeout == timedelta(seconds=ONE_YEAR_SECONDS)
    lr = [c for c in trainer.callbacks if isinstance(c, LearningRateMonitor)]
    assert lr and lr[0].logging_interval == "step"
    ckpt = trainer.checkpoint_callback
    assert isinstance(ckpt, ModelCheckpoint)
    assert (ckpt.monitor, ckpt.mode, ckpt.save_top_k, ckpt._every_n_epochs) == ("Recall@10_val", "max", -1, 1)
    stop = [c for c in trainer.callbacks if isinstance(c, EarlyStopping)]
    assert stop and (stop[0].monitor, stop[0].patience, stop[0].mode) == ("Recall@10_val", 5, "max")


def test_early_stopping_starts_afresh_on_a_new_repository(tmp_path):
    cfg = TrainerConfig(accelerator="cpu", devices=1)
    previous_repo = {"wait_count": 4, "stopped_epoch": 0, "best_score": torch.tensor(0.9), "patience": 5}
    fresh = build_training_trainer(cfg, tmp_path / "new", 2, resuming_this_job=False).early_stopping_callback
    fresh.load_state_dict(previous_repo)
    assert fresh.wait_count == 0 and fresh.best_score.item() == float("-inf")
    retry = build_training_trainer(cfg, tmp_path / "retry", 2, resuming_this_job=True).early_stopping_callback
    retry.load_state_dict(previous_repo)
    assert retry.wait_count == 4


def test_fisher_trainer_matches_strategy_precision_devices(tmp_path):
    cfg = TrainerConfig(accelerator="cpu", devices=1)
    trainer = build_fisher_trainer(cfg, tmp_path)
    assert trainer.max_epochs == 1 and trainer.precision == "bf16-mixed"
    assert trainer.strategy._timeout == timedelta(seconds=ONE_YEAR_SECONDS)


def test_precision_takes_lightnings_values_and_auto() -> None:
    """The config's Literal is written out (the ground floor loads no Lightning): it must be Lightning's own list."""
    import typing

    from lightning_fabric.connector import _PRECISION_INPUT

    lightning = {str(v) for part in typing.get_args(_PRECISION_INPUT) for v in typing.get_args(part)}
    assert set(typing.get_args(Precision)) == lightning | {"auto"}
    assert TrainerConfig(precision=32).precision == "32"  # YAML's `precision: 32` is a number


def _enumerated_settings() -> list[tuple[str, str, list]]:
    """(section, key, choices) of every enumerated setting of the config: each Literal, Literal | bool or bool."""
    from leanagent.ground.config import _enumerated

    return [(section, key, _enumerated(field.annotation))
            for section in ("model", "data", "trainer", "lifelong")
            for key, field in PipelineConfig.model_fields[section].annotation.model_fields.items()
            if _enumerated(field.annotation)]


@pytest.mark.parametrize(("section", "key", "choices"), _enumerated_settings(),
                         ids=[f"{s}.{k}" for s, k, _ in _enumerated_settings()])
def test_every_enumerated_setting_refuses_a_typo_naming_the_key_the_value_and_the_nearest(tmp_path, section, key,
                                                                                          choices):
    meant = next((str(c) for c in choices if isinstance(c, str) and len(c) > 2), "false")  # a bool: true, false
    typo = meant[:-1]  # the last letter dropped, as `bf16-mixe`, `per_exampl` or `fals`
    path = tmp_path / "cfg.yaml"
    path.write_text(f"{section}: {{{key}: {typo}}}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert len(message.splitlines()) == 1, message
    assert message.startswith(f"{path}: {section}.{key}: '{typo}' is not a valid value (did you mean '{meant}'?); "
                              f"one of: "), message


@pytest.mark.parametrize(("text", "expected"), [
    ("trainer: {precision: bf16-mix}", "trainer.precision: 'bf16-mix' is not a valid value (did you mean "
                                       "'bf16-mixed'?); one of: auto, bf16-mixed, 32-true,"),
    ("trainer: {accelerator: gpuu}", "trainer.accelerator: 'gpuu' is not a valid value (did you mean 'gpu'?); "
                                     "one of: gpu, cpu, cuda, auto"),
    ("model: {compile: atuo}", "model.compile: 'atuo' is not a valid value (did you mean 'auto'?); one of: auto, "
                               "true, false"),  # named once, though pydantic refuses each branch of the union
])
def test_a_bad_value_is_one_line_with_the_nearest_choice(tmp_path, text, expected):
    path = tmp_path / "cfg.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: {expected}") and "\n" not in str(info.value), str(info.value)


def test_auto_precision_reaches_lightning_resolved(tmp_path):
    """A trainer built from `precision: auto` runs Lightning's concrete precision for this CPU (the ranks resolve it
    once for the job first, `job_precision`; the builders resolve a config that was not)."""
    cfg = TrainerConfig(accelerator="cpu", devices=1, precision="auto")
    assert build_fisher_trainer(cfg, tmp_path).precision == resolve_precision("auto", "cpu") == job_precision(cfg)
