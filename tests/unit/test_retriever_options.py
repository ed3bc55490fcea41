"""`RetrieverOptions`: one typed object of the retriever's settings, one default each, read by every code path.

`model.sort_by_length` is the case that motivated it: the training step fell back to padded pools and the
vectorised Fisher to sorted ones. Here a retriever built with the default options is run through the training
step, both per-example Fisher paths and evaluation (a real Lightning Trainer), and each path must do exactly
what it does under an explicit `sort_by_length: true`, and not what it does under `false`. A run manifest
written before the key existed (its pools padded) must not be continued under the new default.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pydantic import ValidationError

from leanagent.data.datamodule import RetrievalDataModule
from leanagent.data.dataset import with_lengths
from leanagent.ground.config import ABSENT_MEANS, DataConfig, ModelConfig, PipelineConfig, RepoConfig
from leanagent.model.fisher import FisherModule
from leanagent.model.fisher.vectorised import fisher_groups
from leanagent.model.loading import load_retriever
from leanagent.model.options import RetrieverOptions
from leanagent.model.retriever import PremiseRetriever
from leanagent.run.fingerprint import check_experiment
from leanagent.run.manifest import MANIFEST_NAME, ManifestMismatchError, RepoEntry, read_manifest
from leanagent.run.state import RunState
from tests.stage_results import finished

MAX_LEN = 256
BUDGET = 600  # small enough that length-sorted groups of a batch's examples are cut


class _Pools(PremiseRetriever):
    """Records the real and processed tokens of every pool encoded, whichever code path asked for it."""

    pools: list[tuple[int, int]]

    def encode_pool(self, input_ids, attention_mask, lengths=None):
        emb, tokens = super().encode_pool(input_ids, attention_mask, lengths)
        self.pools.append((tokens.real, tokens.processed))
        return emb, tokens


def _observed(tiny_model: Path, unit_repo: Path, sort_by_length: bool | None) -> dict[str, Any]:
    """What each code path encoded, for a retriever whose options set `sort_by_length` (None: the default)."""
    settings = {} if sort_by_length is None else {"sort_by_length": sort_by_length}
    torch.manual_seed(0)
    model = _Pools(RetrieverOptions(name_or_path=str(tiny_model), max_seq_len=MAX_LEN, eval_batch_size=16,
                                    token_budget=BUDGET, **settings)).eval()
    model.pools = []
    dm = RetrievalDataModule(unit_repo, model.tokenizer, DataConfig(batch_size=4, eval_batch_size=16, num_workers=0,
                                                                    max_seq_len=MAX_LEN),
                             premise_max_len=MAX_LEN, seed=1)
    seen: dict[str, Any] = {}
    with torch.no_grad():  # training's step and LeanAgent's Fisher (`reference`) both take `batch_loss`
        for batch in itertools.islice(iter(dm.train_dataloader()), 2):
            model.batch_loss(with_lengths(batch))
    seen["training"], model.pools = model.pools, []
    fisher_batch = with_lengths(next(iter(FisherModule.train_loader(dm, world_size=1))))
    loop = FisherModule(model, method="loop")
    loop.on_train_epoch_start()
    loop.training_step(fisher_batch, 0)
    seen["fisher_loop"], model.pools = model.pools, []
    seen["fisher_vectorised"] = fisher_groups(model, fisher_batch)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_test_batches=2)
    trainer.test(model, datamodule=dm, verbose=False)
    seen["evaluation"] = model.pools
    return seen


def test_training_both_fisher_paths_and_evaluation_follow_the_one_default(tiny_model, unit_repo) -> None:
    default, on, off = (_observed(tiny_model, unit_repo, s) for s in (None, True, False))
    assert set(default) == {"training", "fisher_loop", "fisher_vectorised", "evaluation"}
    for path in default:
        assert default[path] == on[path], path  # the default is sorting, in every path ...
        assert default[path] != off[path], path  # ... and the setting makes a difference there
    # Padded: one group of the Fisher batch's examples, each pool at its own padded size.
    assert len(off["fisher_vectorised"]) == 1 and len(on["fisher_vectorised"]) > 1
    assert sum(p for _, p in on["training"]) < sum(p for _, p in off["training"])


def test_the_defaults_are_the_configs(tiny_model) -> None:
    assert RetrieverOptions().sort_by_length is PipelineConfig().model.sort_by_length is True
    for name, field in ModelConfig.model_fields.items():  # a new `model:` key is a retriever option, same default
        assert RetrieverOptions.model_fields[name].default == field.default, name
    assert RetrieverOptions().eval_batch_size == DataConfig().eval_batch_size
    cfg = PipelineConfig(model=ModelConfig(name_or_path=str(tiny_model), sort_by_length=False, token_budget=999),
                         data=DataConfig(eval_batch_size=7))
    options = load_retriever(cfg, None).options
    assert options == RetrieverOptions.from_config(cfg)
    assert (options.sort_by_length, options.token_budget, options.eval_batch_size) == (False, 999, 7)


def test_options_are_frozen_and_a_change_is_validated(tiny_model) -> None:
    model = PremiseRetriever(RetrieverOptions(name_or_path=str(tiny_model)))
    with pytest.raises(ValidationError, match="frozen"):
        model.options.sort_by_length = False
    with pytest.raises(ValidationError, match="token_budgett"):
        model.reconfigure(token_budgett=1)
    with pytest.raises(ValidationError, match="token_budget"):
        model.reconfigure(token_budget=0)
    model.reconfigure(sort_by_length=False)
    assert model.options.sort_by_length is False
    assert RetrieverOptions.from_hparams(model.hparams) == model.options  # what a checkpoint stores follows


def test_a_checkpoint_from_before_the_key_reads_back_padded() -> None:
    """Our checkpoints' hparams before `sort_by_length` existed: those pools were padded."""
    old = {"name_or_path": "m", "lr": 1e-3, "warmup_steps": 5, "max_seq_len": 64, "num_retrieved": 100,
           "eval_batch_size": 16, "encoder_config": {"d_model": 8}}
    assert ABSENT_MEANS == {"model.sort_by_length": False}
    stored = RetrieverOptions.from_hparams(old)
    assert (stored.sort_by_length, stored.max_seq_len, stored.eval_batch_size) == (False, 64, 16)
    assert RetrieverOptions.from_hparams({**old, "sort_by_length": True}).sort_by_length is True


# ---- the run manifest ---------------------------------------------------------------------------------------

def _manifest_without(tmp_path: Path, sort_by_length: bool | None) -> PipelineConfig:
    """A run_dir whose manifest was written under `sort_by_length` (None: by a version without the key)."""
    cfg = PipelineConfig(run_dir=tmp_path / "run", repos=[RepoConfig(path=tmp_path / "a")])
    state = RunState(cfg.run_dir, cfg)
    entry = RepoEntry("a", tmp_path / "a")
    state.extend([entry], [entry])
    state.record("00-a/train", finished("train", checkpoint="a.ckpt"))
    data = json.loads(state.path.read_text())
    if sort_by_length is None:
        del data["config"]["model"]["sort_by_length"]
    else:
        data["config"]["model"]["sort_by_length"] = sort_by_length
    state.path.write_text(json.dumps(data))
    return cfg


@pytest.mark.parametrize("stored", [None, False])
def test_a_padded_run_is_not_continued_under_the_new_default(tmp_path: Path, stored: bool | None) -> None:
    cfg = _manifest_without(tmp_path, stored)
    assert cfg.model.sort_by_length is True
    was = "(absent: False)" if stored is None else "False"
    with pytest.raises(ManifestMismatchError, match=rf"model\.sort_by_length: {re.escape(was)} -> True"):
        RunState(cfg.run_dir, cfg)
    with pytest.raises(ManifestMismatchError):  # the read-only check the run's plan makes first
        check_experiment(cfg.run_dir / MANIFEST_NAME, read_manifest(cfg.run_dir / MANIFEST_NAME), cfg)
    padded = cfg.model_copy(update={"model": cfg.model.model_copy(update={"sort_by_length": False})})
    reopened = RunState(padded.run_dir, padded)  # the run's own setting: it continues
    assert reopened.stage_done("00-a/train") == finished("train", checkpoint="a.ckpt")
    reopened.record("00-a/fisher", finished("fisher"))
    assert json.loads(reopened.path.read_text())["config"]["model"]["sort_by_length"] is False


def test_a_sorted_run_continues_under_the_default(tmp_path: Path) -> None:
    cfg = _manifest_without(tmp_path, True)
    assert RunState(cfg.run_dir, cfg).stage_done("00-a/train") == finished("train", checkpoint="a.ckpt")


def test_a_run_from_before_the_recipe_keys_continues_under_their_defaults(tmp_path: Path) -> None:
    """`model.loss`, `model.temperature`, `data.negatives`, `data.mined_pool`: absent means LeanAgent's recipe,
    today's default (so not in ABSENT_MEANS); a manifest without them continues, and refuses another recipe."""
    cfg = _manifest_without(tmp_path, True)
    data = json.loads((cfg.run_dir / MANIFEST_NAME).read_text())
    for section, key in (("model", "loss"), ("model", "temperature"), ("data", "negatives"), ("data", "mined_pool")):
        del data["config"][section][key]
    (cfg.run_dir / MANIFEST_NAME).write_text(json.dumps(data))
    assert RunState(cfg.run_dir, cfg).stage_done("00-a/train") == finished("train", checkpoint="a.ckpt")
    infonce = cfg.model_copy(update={"model": cfg.model.model_copy(update={"loss": "infonce"})})
    with pytest.raises(ManifestMismatchError, match=r"model\.loss: '\(absent\)' -> 'infonce'"):
        RunState(infonce.run_dir, infonce)
    assert RetrieverOptions.from_hparams({"name_or_path": "m"}).loss == "mse"  # an old checkpoint trained mse
