"""LeanAgent/ReProver retriever checkpoints as starting points: the file layout and the zero_to_fp32 folder load
the same weights, a mismatch is refused in one line naming the file, the epochs count on from the reference's,
and the real train program trains one repository from one. The checkpoints are built here in the reference's
layout (ReProver's `retrieval/model.py`: the T5 encoder under `encoder`, an AttributeDict of hyper-parameters)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import ByT5Tokenizer, T5EncoderModel

from leanagent.checkpoints.files import CheckpointError
from leanagent.checkpoints.foreign import read_any_checkpoint
from leanagent.checkpoints.ours import epochs_completed, read_checkpoint
from leanagent.ground.config import PipelineConfig
from leanagent.ground.job import JobRequest
from leanagent.model.loading import load_retriever, reference_encoder_config
from leanagent.model.presets import encoder_config
from leanagent.preflight.checks import PreflightError, preflight_job
from leanagent.train.plan import TrainPlan, ewc_anchor, plan_training
from leanagent.train.programs import run_train
from tests.reference_layout import reference_hparams, save_reference

REFERENCE_EPOCH = 2
STRINGS = ["theorem foo : 1 + 1 = 2 := by simp", "⊢ ∀ n : ℕ, n + 0 = n", "lemma bar (a b : ℕ) : a + b = b + a"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory, unit_repo, tiny_model) -> dict:
    root = tmp_path_factory.mktemp("reference")
    model_dir = tiny_model
    torch.manual_seed(1)  # other weights than model_dir's: loading must really take the checkpoint's
    encoder = T5EncoderModel(encoder_config("tiny")).eval()
    ckpt = save_reference(root / "leanagent_epoch=2.ckpt", encoder, REFERENCE_EPOCH)
    # DeepSpeed's folder after `python zero_to_fp32.py . pytorch_model.bin`: a bare state dict behind
    # Lightning's wrapper prefix, Lightning's own state left in DeepSpeed's model-states file.
    folder = root / "deepspeed.ckpt"
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "zero_to_fp32.py").write_text("# DeepSpeed's script\n")
    torch.save({"_forward_module.encoder." + k: v.to(torch.bfloat16).float()
                for k, v in encoder.state_dict().items()}, folder / "pytorch_model.bin")
    torch.save({"module": None, "epoch": REFERENCE_EPOCH, "global_step": 1234,
                "hyper_parameters": reference_hparams(), "dp_world_size": 4}, folder / "checkpoint" /
               "mp_rank_00_model_states.pt")
    repo = unit_repo
    return {"root": root, "model_dir": model_dir, "encoder": encoder, "ckpt": ckpt, "folder": folder, "repo": repo}


def config(assets: dict, **lifelong) -> PipelineConfig:
    return PipelineConfig.model_validate({
        "model": {"name_or_path": str(assets["model_dir"]), "max_seq_len": 128, "warmup_steps": 2},
        "data": {"batch_size": 4, "eval_batch_size": 16, "num_workers": 0, "max_seq_len": 128},
        "trainer": {"accelerator": "cpu", "devices": 1, "precision": "32-true", "accumulate_grad_batches": 1},
        "lifelong": {"epochs_per_repo": 1, **lifelong},
    })


@torch.no_grad()
def embed(encoder: T5EncoderModel, strings: list[str]) -> torch.Tensor:
    """ReProver's `_encode`: masked mean of the last hidden states, L2-normalised."""
    batch = ByT5Tokenizer()(strings, padding="longest", return_tensors="pt")
    hidden = encoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    mask = batch.attention_mask.unsqueeze(-1).float()
    return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1)


def assert_one_line_naming(exc: BaseException, path: Path) -> None:
    message = str(exc)
    assert "\n" not in message and message.startswith(str(path)), message


def test_the_reference_file_needs_its_attribute_dict_allowlisted_and_nothing_more(assets):
    with pytest.raises(CheckpointError, match="AttributeDict"):
        read_checkpoint(assets["ckpt"])  # our reader, as is: refused, not unpickled with code
    checkpoint = read_any_checkpoint(assets["ckpt"])
    assert type(checkpoint["hyper_parameters"]) is dict  # read back as a plain dict
    assert checkpoint["hyper_parameters"]["model_name"] == "kaiyuy/leandojo-lean4-retriever-byt5-small"


@pytest.mark.parametrize("which", ["ckpt", "folder"])
def test_reference_weights_load_identically(assets, which):
    model = load_retriever(config(assets), assets[which]).eval()
    expected = embed(assets["encoder"], STRINGS)
    got = embed(model.encoder, STRINGS)
    # The folder's weights went through bf16, as DeepSpeed's bf16 training stores them.
    torch.testing.assert_close(got, expected, atol=0 if which == "ckpt" else 2e-2, rtol=0 if which == "ckpt" else 0)
    if which == "ckpt":
        for key, value in assets["encoder"].state_dict().items():
            assert torch.equal(model.encoder.state_dict()[key], value), key
    # Our settings are the ones trained with; the architecture is now stored, so what we write is ours.
    assert model.options.max_seq_len == 128 and model.encoder.config.d_model == 64


@pytest.mark.parametrize("which", ["ckpt", "folder"])
def test_a_retry_anchors_ewc_at_the_reference_weights(assets, which):
    """theta* of a retry that started from a reference checkpoint: its weights under our keys, every parameter."""
    plan = TrainPlan(str(assets[which]), REFERENCE_EPOCH + 1, REFERENCE_EPOCH + 2, "job/checkpoints/last.ckpt")
    assert plan.is_retry
    anchor = ewc_anchor(config(assets), plan)
    expected = load_retriever(config(assets), assets[which]).state_dict()
    assert set(anchor) == set(expected)
    for key, value in expected.items():
        assert torch.equal(anchor[key].float(), value), key


def test_architecture_falls_back_to_byt5_small_without_a_local_config(assets, tmp_path):
    # model.name_or_path not local and not cached, model_name neither: byt5-small's shape, which the tiny
    # weights do not fit -- refused, naming the file and what to set, never downloading anything.
    cfg = config(assets)
    cfg.model.name_or_path = "no-such-org/no-such-model"
    with pytest.raises(CheckpointError, match="byt5-small shape.*model.name_or_path") as info:
        load_retriever(cfg, assets["ckpt"])
    assert_one_line_naming(info.value, assets["ckpt"])


def test_mismatched_keys_are_refused_in_one_line_naming_the_file(assets, tmp_path):
    bad = tmp_path / "other.ckpt"
    state = {"encoder." + k: v for k, v in assets["encoder"].state_dict().items()}
    state.pop("encoder.encoder.block.1.layer.1.DenseReluDense.wo.weight")
    state["generator.lm_head.weight"] = torch.zeros(3, 3)
    torch.save({"state_dict": state, "hyper_parameters": reference_hparams(), "epoch": 0}, bad)
    for load in (lambda: load_retriever(config(assets), bad),
                 lambda: reference_encoder_config(bad, read_any_checkpoint(bad), str(assets["model_dir"]))):
        with pytest.raises(CheckpointError, match="missing encoder.encoder.block.1.layer.1.DenseReluDense.wo.weight"
                                                  ", unexpected generator.lm_head.weight") as info:
            load()
        assert_one_line_naming(info.value, bad)


def test_a_deepspeed_folder_without_consolidated_weights_says_how_to_convert(tmp_path):
    folder = tmp_path / "raw.ckpt"
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "zero_to_fp32.py").write_text("")
    with pytest.raises(CheckpointError, match="zero_to_fp32.py") as info:
        read_any_checkpoint(folder)
    assert_one_line_naming(info.value, folder)


@pytest.mark.parametrize("which", ["ckpt", "folder"])
def test_epochs_count_on_from_the_reference(assets, tmp_path, which):
    assert epochs_completed(read_any_checkpoint(assets[which])) == REFERENCE_EPOCH + 1
    plan = plan_training(tmp_path / "job", assets[which], epochs_per_repo=2)
    assert (plan.start_epochs, plan.target_epochs) == (REFERENCE_EPOCH + 1, REFERENCE_EPOCH + 3)
    # Its weights go into a fresh trainer: Lightning resumes nothing from it.
    assert plan.from_reference and plan.ckpt_path is None and not plan.is_retry


def test_preflight_accepts_a_reference_file_and_folder_that_fit_the_model_and_refuses_one_that_does_not(
        assets, tmp_path):
    for which in ("ckpt", "folder"):
        preflight_job(JobRequest(program="evaluate", config=config(assets), datasets=(assets["repo"],),
                                 out=tmp_path / "job", checkpoint=assets[which], datasets_checked=True))
    narrower = tmp_path / "narrower"  # an architecture the reference weights do not fit: config.json is enough
    narrower.mkdir()
    encoder_config("tiny").__class__(**{**encoder_config("tiny").to_dict(), "d_model": 32}).to_json_file(
        narrower / "config.json")
    cfg = config(assets).model_copy(update={"model": config(assets).model.model_copy(
        update={"name_or_path": str(narrower)})})
    for which in ("ckpt", "folder"):
        with pytest.raises(PreflightError, match="has shape") as info:
            preflight_job(JobRequest(program="evaluate", config=cfg, datasets=(assets["repo"],), out=tmp_path / "job",
                                     checkpoint=assets[which], datasets_checked=True))
        assert str(assets[which]) in str(info.value) and "\n" not in str(info.value)


def test_the_train_program_trains_one_repository_from_a_reference(assets, tmp_path):
    cfg = config(assets)
    job = tmp_path / "job"
    result = run_train(JobRequest(program="train", config=cfg, datasets=(assets["repo"],), out=job,
                                  checkpoint=assets["ckpt"]))
    assert result.start_epochs == REFERENCE_EPOCH + 1
    assert result.target_epochs == REFERENCE_EPOCH + 1 + cfg.lifelong.epochs_per_repo
    assert result.start_global_step == 0  # our optimizer and schedule, from their start
    final = read_checkpoint(Path(result.checkpoint))  # ours now: the standard weights-only reader takes it
    assert final["epoch"] == REFERENCE_EPOCH + cfg.lifelong.epochs_per_repo
    assert epochs_completed(final) == result.target_epochs
    assert Path(result.checkpoint).name.startswith(f"epoch={REFERENCE_EPOCH + 1}-")
    assert "encoder_config" in final["hyper_parameters"]
    # Trained: the weights moved away from the reference's.
    moved = final["state_dict"]["encoder.shared.weight"] - assets["encoder"].state_dict()["shared.weight"]
    assert moved.abs().max() > 0
    # The next repository counts on from there, through the ordinary path.
    plan = plan_training(tmp_path / "next", Path(result.checkpoint), epochs_per_repo=1)
    assert not plan.from_reference and plan.start_epochs == result.target_epochs


def test_lifelong_start_checkpoint_is_validated_and_resolved_against_the_config_file(assets, tmp_path):
    from leanagent.ground.config import ConfigError, load_config

    path = tmp_path / "cfg" / "run.yaml"
    path.parent.mkdir()
    path.write_text("lifelong:\n  start_checkpoint: ../ref/leanagent.ckpt\n")
    assert load_config(path).lifelong.start_checkpoint == (tmp_path / "ref" / "leanagent.ckpt").resolve()
    assert load_config(tmp_path / "cfg" / "run.yaml").lifelong.start_checkpoint.is_absolute()
    path.write_text("lifelong:\n  start_checkpoint: [1, 2]\n")
    with pytest.raises(ConfigError, match="lifelong.start_checkpoint"):
        load_config(path)
    assert PipelineConfig().lifelong.start_checkpoint is None


def test_export_takes_a_reference_checkpoint_with_its_base_model(assets, tmp_path):
    """`leanagent export` of a LeanAgent-layout file: the exported HF folder embeds as the reference weights do."""
    import subprocess
    import sys

    out = tmp_path / "exported"
    proc = subprocess.run([sys.executable, "-m", "leanagent.cli", "export", str(assets["ckpt"]), str(out),
                           "--base-model", str(assets["model_dir"])], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reloaded = T5EncoderModel.from_pretrained(out).eval()
    assert torch.allclose(embed(reloaded, STRINGS), embed(assets["encoder"], STRINGS), atol=1e-5)
    # Without --base-model the kaiyuy id is not cached here: byt5-small's shape does not fit tiny weights.
    proc = subprocess.run([sys.executable, "-m", "leanagent.cli", "export", str(assets["ckpt"]), str(tmp_path / "x")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert str(assets["ckpt"]) in proc.stderr
