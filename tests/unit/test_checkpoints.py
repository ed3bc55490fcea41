"""Bad checkpoint and Fisher files are named in one line; a retry skips a truncated last.ckpt; checkpoints are
read weights-only; `prune_checkpoints` keeps exactly the next start, the best and last.ckpt. Real files throughout:
the checkpoints are written by a 1-process Lightning Trainer on CPU, the Fisher by `save_fisher`."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import yaml
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
from transformers import ByT5Tokenizer

from leanagent.checkpoints.files import CheckpointError, FisherFileError, check_fisher, prune_checkpoints
from leanagent.checkpoints.ours import check_checkpoint, read_checkpoint, read_fisher, save_fisher
from leanagent.data.datamodule import RetrievalDataModule
from leanagent.ground.atomic import write_json_atomic
from leanagent.ground.config import DataConfig, PipelineConfig
from leanagent.ground.results import TrainResult
from leanagent.model.loading import load_model, load_retriever
from leanagent.model.options import RetrieverOptions
from leanagent.model.retriever import PremiseRetriever
from leanagent.train.plan import plan_training

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, unit_repo, tiny_model) -> dict:
    """Two epochs of the tiny retriever: epoch=0-step=2.ckpt, epoch=1-step=4.ckpt and last.ckpt, as Lightning
    writes them (state dict, AdamW and scheduler states, loops, callback states with tensors, our hparams)."""
    root = tmp_path_factory.mktemp("trained")
    repo, model_dir = unit_repo, tiny_model
    torch.manual_seed(0)
    model = PremiseRetriever(RetrieverOptions(name_or_path=str(model_dir), lr=1e-3, warmup_steps=1, max_seq_len=64))
    data = RetrievalDataModule(repo, ByT5Tokenizer(), DataConfig(batch_size=4, num_workers=0, max_seq_len=64),
                               premise_max_len=64, seed=0)
    folder = root / "job" / "checkpoints"
    callbacks = [ModelCheckpoint(dirpath=folder, filename="{epoch}-{step}", monitor="loss_train_epoch", mode="min",
                                 save_top_k=-1, save_last=True),
                 EarlyStopping(monitor="loss_train_epoch", mode="min", patience=5)]
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, limit_train_batches=2, limit_val_batches=0,
                         logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(model, datamodule=data)
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"], names
    return {"root": root, "repo": repo, "model_dir": model_dir, "folder": folder, "data": data}


def truncated_copy(source: Path, dest: Path, fraction: float = 0.5) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    data = source.read_bytes()
    dest.write_bytes(data[: int(len(data) * fraction)])
    return dest


def assert_one_line_naming(exc: BaseException, path: Path) -> None:
    message = str(exc)
    assert "\n" not in message, message
    assert message.startswith(str(path)), message
    for noise in ("PytorchStreamReader", "Traceback", "UnpicklingError", "_pickle"):
        assert noise not in message, message


# ---- weights-only reading -------------------------------------------------------------------------

def test_our_checkpoints_load_weights_only_without_extra_safe_globals(trained):
    last = trained["folder"] / "last.ckpt"
    raw = torch.load(last, map_location="cpu", weights_only=True)  # torch's own restricted unpickler, as is
    assert {"state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks", "hyper_parameters"} <= set(raw)
    assert any(isinstance(v, dict) and torch.is_tensor(v.get("best_score")) for v in raw["callbacks"].values())
    checkpoint = read_checkpoint(last)
    assert checkpoint["hyper_parameters"]["encoder_config"]["d_model"] == 64
    info = check_checkpoint(last)
    assert info.size_bytes == last.stat().st_size and info.encoder_config["num_layers"] == 2


def test_the_options_ride_in_the_checkpoint_and_read_back_typed(trained, tmp_path):
    """What Lightning wrote reads back as the options trained with; a checkpoint of ours from before the options
    had `sort_by_length`, `token_budget`, `compile` and `corpus_autocast` (its hparams without them) still loads,
    as the padded model it was, and a job's config still decides what a job runs with."""
    last = trained["folder"] / "last.ckpt"
    options = RetrieverOptions(name_or_path=str(trained["model_dir"]), lr=1e-3, warmup_steps=1, max_seq_len=64)
    checkpoint = read_checkpoint(last)
    assert RetrieverOptions.from_hparams(checkpoint["hyper_parameters"]) == options
    assert load_model(last).retriever.options == options
    older = dict(checkpoint)
    older["hyper_parameters"] = {k: v for k, v in checkpoint["hyper_parameters"].items()
                                 if k not in ("sort_by_length", "token_budget", "compile", "corpus_autocast")}
    torch.save(older, tmp_path / "older.ckpt")
    loaded = load_model(tmp_path / "older.ckpt").retriever
    assert loaded.options == options.replace(sort_by_length=False)
    for name, weight in load_model(last).retriever.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], weight), name
    cfg = PipelineConfig.model_validate({"model": {"name_or_path": str(trained["model_dir"]), "max_seq_len": 64,
                                                   "token_budget": 512}})
    job = load_retriever(cfg, tmp_path / "older.ckpt")
    assert (job.options.sort_by_length, job.options.token_budget) == (True, 512)


def test_lightning_resumes_weights_only(trained, tmp_path):
    """`fit(ckpt_path=..., weights_only=True)`, as run_train calls it, restores loops and optimizer."""
    cfg = PipelineConfig.model_validate({"model": {"name_or_path": str(trained["model_dir"]), "max_seq_len": 64}})
    model = load_retriever(cfg, trained["folder"] / "last.ckpt", weights=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=3, limit_train_batches=2, limit_val_batches=0,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=tmp_path)
    trainer.fit(model, datamodule=trained["data"], ckpt_path=trained["folder"] / "last.ckpt", weights_only=True)
    assert trainer.global_step == 6  # 4 restored + 2 of the third epoch


def test_a_checkpoint_needing_arbitrary_objects_is_refused(tmp_path):
    path = tmp_path / "pickled.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"args": argparse.Namespace(lr=1.0)}}, path)
    with pytest.raises(CheckpointError, match=r"argparse\.Namespace") as info:
        read_checkpoint(path)
    assert_one_line_naming(info.value, path)


# ---- truncated and corrupt files ------------------------------------------------------------------

@pytest.mark.parametrize("fraction", [0.0005, 0.5, 0.999])
def test_truncated_checkpoint_is_named_in_one_line(trained, tmp_path, fraction):
    bad = truncated_copy(trained["folder"] / "epoch=1-step=4.ckpt", tmp_path / "epoch=2.ckpt", fraction)
    for reader in (read_checkpoint, check_checkpoint):
        with pytest.raises(CheckpointError, match="not a readable checkpoint .truncated or corrupt") as info:
            reader(bad)
        assert_one_line_naming(info.value, bad)
    # The rank programs load models through the same reader.
    cfg = PipelineConfig.model_validate({"model": {"name_or_path": str(trained["model_dir"])}})
    with pytest.raises(CheckpointError) as info:
        load_retriever(cfg, bad)
    assert_one_line_naming(info.value, bad)


def test_a_file_that_is_not_a_checkpoint_is_named(tmp_path):
    path = tmp_path / "notes.ckpt"
    path.write_text("not a checkpoint\n")
    with pytest.raises(CheckpointError, match="not a zip archive") as info:
        check_checkpoint(path)
    assert_one_line_naming(info.value, path)


def _fisher(tmp_path: Path) -> Path:
    path = tmp_path / "fisher.safetensors"
    save_fisher(path, {"encoder.a": torch.rand(64, 32), "encoder.b": torch.rand(7)}, {"estimator": "per_example"})
    return path


def test_fisher_file_checked_and_read(tmp_path):
    path = _fisher(tmp_path)
    info = check_fisher(path)
    assert (info.num_tensors, info.num_elements) == (2, 64 * 32 + 7)
    tensors, metadata = read_fisher(path)
    assert tensors["encoder.a"].shape == (64, 32) and metadata["estimator"] == "per_example"


@pytest.mark.parametrize("keep_bytes", [4, 20, -1])
def test_truncated_fisher_is_named_in_one_line(tmp_path, keep_bytes):
    path = _fisher(tmp_path)
    data = path.read_bytes()
    bad = tmp_path / "fisher-cut.safetensors"
    bad.write_bytes(data[:keep_bytes])
    for reader in (check_fisher, read_fisher):
        with pytest.raises(FisherFileError, match="not a readable Fisher file .truncated or corrupt") as info:
            reader(bad)
        assert_one_line_naming(info.value, bad)


def test_fisher_with_a_lying_header_is_named(tmp_path):
    path = _fisher(tmp_path)
    data = bytearray(path.read_bytes())
    data[8:8 + 1] = b"["  # the header is no longer a JSON object
    path.write_bytes(bytes(data))
    with pytest.raises(FisherFileError) as info:
        read_fisher(path)
    assert_one_line_naming(info.value, path)


def test_negative_fisher_entries_are_one_line_too(tmp_path):
    path = tmp_path / "neg.safetensors"
    save_fisher(path, {"w": torch.tensor([1.0, -1.0])}, {})
    with pytest.raises(FisherFileError, match="negative or not finite") as info:
        read_fisher(path)
    assert_one_line_naming(info.value, path)


# ---- a training retry falls back past a truncated last.ckpt ---------------------------------------

def test_retry_with_truncated_last_falls_back_to_the_newest_readable_epoch(trained, tmp_path):
    start = shutil.copy(trained["folder"] / "epoch=0-step=2.ckpt", tmp_path / "start.ckpt")
    job = tmp_path / "job"
    first = plan_training(job, Path(start), epochs_per_repo=2)
    assert first.resume_from == str(Path(start).resolve()) and first.unreadable == ()
    write_json_atomic(job / "job.json", {"start_checkpoint": first.start_checkpoint,
                                         "start_epochs": first.start_epochs, "target_epochs": first.target_epochs})
    folder = job / "checkpoints"
    folder.mkdir()
    epoch0 = shutil.copy(trained["folder"] / "epoch=0-step=2.ckpt", folder / "epoch=0-step=2.ckpt")
    epoch1 = shutil.copy(trained["folder"] / "epoch=1-step=4.ckpt", folder / "epoch=1-step=4.ckpt")
    last = truncated_copy(trained["folder"] / "last.ckpt", folder / "last.ckpt")

    retry = plan_training(job, Path(start), epochs_per_repo=2)
    assert retry.resume_from == str(epoch1) and retry.is_retry
    assert (retry.start_epochs, retry.target_epochs) == (first.start_epochs, first.target_epochs)
    assert len(retry.unreadable) == 1 and retry.unreadable[0].startswith(str(last))

    truncated_copy(trained["folder"] / "epoch=1-step=4.ckpt", Path(epoch1), 0.3)
    retry = plan_training(job, Path(start), epochs_per_repo=2)
    assert retry.resume_from == str(epoch0) and len(retry.unreadable) == 2

    truncated_copy(trained["folder"] / "epoch=0-step=2.ckpt", Path(epoch0), 0.3)
    retry = plan_training(job, Path(start), epochs_per_repo=2)
    assert retry.resume_from == first.start_checkpoint and not retry.is_retry  # the job's own start
    assert len(retry.unreadable) == 3


def test_truncated_start_checkpoint_is_named_before_training(trained, tmp_path):
    bad = truncated_copy(trained["folder"] / "last.ckpt", tmp_path / "start.ckpt")
    with pytest.raises(CheckpointError) as info:
        plan_training(tmp_path / "job", bad, epochs_per_repo=1)
    assert_one_line_naming(info.value, bad)


# ---- prune ----------------------------------------------------------------------------------------

def test_prune_keeps_the_next_start_the_best_and_last(tmp_path):
    folder = tmp_path / "run" / "jobs" / "00-a-train" / "checkpoints"
    folder.mkdir(parents=True)
    names = [f"epoch={e}-step={10 * (e + 1)}-Recall@10_val={v}.ckpt" for e, v in enumerate([50.0, 70.0, 60.0, 65.0])]
    for name in [*names, "last.ckpt", "notes.txt", "epoch=9.ckpt.tmp"]:
        (folder / name).write_bytes(b"x")
    outside = tmp_path / "run" / "jobs" / "00-a-train" / "epoch=0-step=1.ckpt"
    outside.write_bytes(b"x")
    result = TrainResult(program="train", checkpoint=str(folder / names[3]), best_checkpoint=str(folder / names[1]),
                         latest_checkpoint=str(folder / names[3]), last_checkpoint=str(folder / "last.ckpt"))
    assert prune_checkpoints(result, keep="all") == []
    assert len(list(folder.iterdir())) == 7

    deleted = prune_checkpoints(result, keep="best_and_last")
    assert sorted(p.name for p in deleted) == sorted([names[0], names[2]])
    assert sorted(p.name for p in folder.iterdir()) == sorted([names[1], names[3], "last.ckpt", "notes.txt",
                                                                "epoch=9.ckpt.tmp"])
    assert outside.is_file()  # never anything outside the checkpoints folder
    assert prune_checkpoints(result, keep="best_and_last") == []  # idempotent (a rerun prunes again)


def test_prune_touches_nothing_it_cannot_place(tmp_path):
    stray = tmp_path / "elsewhere"
    stray.mkdir()
    (stray / "epoch=0-step=1.ckpt").write_bytes(b"x")
    (stray / "epoch=1-step=2.ckpt").write_bytes(b"x")
    # not a checkpoints folder
    assert prune_checkpoints(TrainResult(program="train", checkpoint=str(stray / "epoch=1-step=2.ckpt"))) == []
    # no next start named
    unnamed = TrainResult(program="train", checkpoint="", last_checkpoint=str(stray / "last.ckpt"))
    assert prune_checkpoints(unnamed) == []
    assert len(list(stray.iterdir())) == 2


# ---- the command line ---------------------------------------------------------------------------

def test_cli_evaluate_with_truncated_checkpoint_prints_one_line_and_launches_nothing(trained, tmp_path):
    bad = truncated_copy(trained["folder"] / "last.ckpt", tmp_path / "epoch=2.ckpt")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"model": {"name_or_path": str(trained["model_dir"])},
                                      "trainer": {"accelerator": "cpu", "devices": 1}}))
    out = tmp_path / "evaluate"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "leanagent.cli", "evaluate", "--config", str(config), "--dataset",
                           str(trained["repo"]), "--checkpoint", str(bad), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO_ROOT)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: {bad}: not a readable checkpoint (truncated or corrupt")
    assert not out.exists()  # no torchrun, no job folder, no logs
