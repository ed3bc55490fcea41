"""LeanAgent's Fisher estimator (`lifelong.fisher_estimator: reference`) against a hand computation.

Single process, a tiny T5 encoder built from a T5Config (dropout 0, so a batch's gradient can be
recomputed exactly), the data module's own training loader. The reference estimator must equal
sum over the steps of (gradient of the batch-mean loss)^2 / len(train dataset), and differ from the
per-example (empirical) Fisher on the same examples.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from torch.utils.data import DataLoader
from transformers import T5Config

from leanagent.checkpoints.ours import load_fisher, save_fisher
from leanagent.data.datamodule import RetrievalDataModule
from leanagent.ground.config import DataConfig
from leanagent.model.fisher import FisherModule, ReferenceFisherModule
from leanagent.model.options import RetrieverOptions
from leanagent.model.retriever import PremiseRetriever

NUM_EXAMPLES = 22  # batch size 4 with drop_last: 5 batches, 2 examples never seen, yet N = 22
BATCH_SIZE = 4


def tiny_t5(dropout: float = 0.0) -> PremiseRetriever:
    torch.manual_seed(0)
    config = T5Config(vocab_size=384, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                      feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False,
                      tie_word_embeddings=False, dropout_rate=dropout)
    return PremiseRetriever(RetrieverOptions(name_or_path="tiny-t5", max_seq_len=96), encoder_config=config.to_dict())


@pytest.fixture(scope="module")
def repo(unit_repo) -> Path:
    return unit_repo


def datamodule(repo: Path, model: PremiseRetriever) -> RetrievalDataModule:
    cfg = DataConfig(batch_size=BATCH_SIZE, num_workers=0, max_seq_len=96)
    dm = RetrievalDataModule(repo, model.tokenizer, cfg, premise_max_len=96, seed=5)
    assert len(dm.train_examples) > NUM_EXAMPLES
    dm.train_examples = dm.train_examples[:NUM_EXAMPLES]
    return dm


class Recorder(Callback):
    """Keeps every batch the module was given, and the retriever's mode during the step."""

    def __init__(self) -> None:
        self.batches: list[dict] = []
        self.training_modes: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append({k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        modes = {m.training for m in pl_module.retriever.modules()}
        self.training_modes.append(modes == {True})


def fit(module: pl.LightningModule, loader: DataLoader, callbacks: list[Callback] | None = None) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, precision="32-true", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks or [])
    trainer.fit(module, train_dataloaders=loader)


def test_reference_is_the_sum_of_squared_batch_gradients_over_the_dataset_size(repo: Path, tmp_path: Path) -> None:
    model = tiny_t5()
    dm = datamodule(repo, model)
    module = ReferenceFisherModule(model)
    recorder = Recorder()
    fit(module, dm.train_dataloader(), [recorder])

    # The training loader: shuffled, full batches only (drop_last), the model in train mode at every step.
    assert [len(b["index"]) for b in recorder.batches] == [BATCH_SIZE] * (NUM_EXAMPLES // BATCH_SIZE)
    seen = [i for b in recorder.batches for i in b["index"].tolist()]
    assert len(set(seen)) == len(seen) == 20 and set(seen) <= set(range(NUM_EXAMPLES))
    assert seen != sorted(seen)
    assert recorder.training_modes == [True] * len(recorder.batches)
    assert module.num_examples == NUM_EXAMPLES and module.num_steps == len(recorder.batches)

    # By hand: the gradient of each batch's mean loss, squared, summed over the steps, / N (world size 1).
    params = dict(model.named_parameters())
    expected = {n: torch.zeros_like(p) for n, p in params.items()}
    for batch in recorder.batches:
        grads = torch.autograd.grad(model.batch_loss(batch), list(params.values()), allow_unused=True)
        for n, g in zip(params, grads, strict=True):
            if g is not None:
                expected[n] += g**2
    assert set(module.fisher) == set(params)  # the retriever's names: encoder.…
    assert all(n.startswith("encoder.") for n in module.fisher)
    for n in params:
        torch.testing.assert_close(module.fisher[n], expected[n] / NUM_EXAMPLES, rtol=1e-5, atol=1e-12)
    assert sum(f.sum() for f in module.fisher.values()) > 0
    # No parameter moved: the pass has no optimizer.
    for n, p in model.named_parameters():
        assert torch.equal(p, tiny_t5().state_dict()[n])

    # Written like the per-example one, and EWC accepts it.
    path = tmp_path / "fisher.safetensors"
    save_fisher(path, module.fisher, {"estimator": "reference", "num_examples": NUM_EXAMPLES, "world_size": 1})
    loaded, meta = load_fisher(path)
    assert meta["estimator"] == "reference"
    tiny_t5().set_ewc(loaded, 0.1)


def test_reference_differs_from_the_per_example_fisher(repo: Path) -> None:
    model = tiny_t5()
    ref = ReferenceFisherModule(model)
    fit(ref, datamodule(repo, model).train_dataloader())

    model = tiny_t5()
    per = FisherModule(model)
    fit(per, FisherModule.train_loader(datamodule(repo, model), world_size=1))
    assert per.num_examples == NUM_EXAMPLES
    assert ref.fisher.keys() == per.fisher.keys()

    ref_total = sum(float(f.sum()) for f in ref.fisher.values())
    per_total = sum(float(f.sum()) for f in per.fisher.values())
    # Squared batch means are far smaller than the mean of squared per-example gradients
    # (about 1/batch size for independent per-example gradients).
    assert 0 < ref_total < 0.6 * per_total
    assert not all(torch.allclose(ref.fisher[n], per.fisher[n], rtol=0.1) for n in ref.fisher)


def test_reference_keeps_dropout_on(repo: Path) -> None:
    """With dropout the same batch gives another gradient on every pass: the estimator runs in train mode."""
    model = tiny_t5(dropout=0.5)
    model.eval()  # whatever mode it comes in, the pass switches to train mode
    module = ReferenceFisherModule(model)
    recorder = Recorder()
    fit(module, datamodule(repo, model).train_dataloader(), [recorder])
    assert recorder.training_modes and all(recorder.training_modes)
    batch = recorder.batches[0]
    first = torch.autograd.grad(model.batch_loss(batch), [model.encoder.shared.weight])[0]
    second = torch.autograd.grad(model.batch_loss(batch), [model.encoder.shared.weight])[0]
    assert not torch.allclose(first, second)


def test_a_pass_without_a_full_batch_is_refused(repo: Path) -> None:
    model = tiny_t5()
    dm = datamodule(repo, model)
    dm.train_examples = dm.train_examples[: BATCH_SIZE - 1]
    with pytest.raises(RuntimeError, match="ran no batch"):
        fit(ReferenceFisherModule(model), dm.train_dataloader())
