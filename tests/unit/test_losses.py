"""`model.loss`: InfoNCE against a hand-written formula, mse unchanged by default, EWC on top of either, and every
Fisher estimator squaring the gradients of the configured loss."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from torch.utils.data import DataLoader

from leanagent.data.datamodule import RetrievalDataModule
from leanagent.ground.config import DataConfig, ModelConfig, PipelineConfig, load_config
from leanagent.model.fisher import ESTIMATORS, FisherModule, ReferenceFisherModule
from leanagent.model.losses import contrastive_mse, info_nce, retrieval_loss
from leanagent.model.options import RetrieverOptions
from leanagent.model.retriever import PremiseRetriever
from tests.unit.test_fisher_vectorised import COLUMNS, LENGTHS, hand_batch, tiny_t5

T = 0.05


def hand_infonce(similarity: list[list[float]], label: list[list[float]], temperature: float) -> float:
    """The documented formula, written out: mean over rows of -log(sum_pos exp(s/T) / sum_all exp(s/T))."""
    terms = []
    for s_row, l_row in zip(similarity, label, strict=True):
        positives = sum(math.exp(s / temperature) for s, y in zip(s_row, l_row, strict=True) if y == 1)
        everything = sum(math.exp(s / temperature) for s in s_row)
        terms.append(-math.log(positives / everything))
    return sum(terms) / len(terms)


def fixed_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """3 contexts, 6 premise columns (slot-major: positives 0-2, then one negative each). Contexts 0 and 1 share a
    positive: column 1 (context 1's positive) is also one of context 0's, and column 5 (context 2's negative) is
    context 1's other positive."""
    g = torch.Generator().manual_seed(7)
    ctx = torch.nn.functional.normalize(torch.randn(3, 5, generator=g, dtype=torch.float64), dim=1)
    prem = torch.nn.functional.normalize(torch.randn(6, 5, generator=g, dtype=torch.float64), dim=1)
    prem[1] = torch.nn.functional.normalize(ctx[0] + ctx[1], dim=0)  # the shared positive: near both contexts
    label = torch.tensor([[1, 1, 0, 0, 0, 0],
                          [0, 1, 0, 0, 0, 1],
                          [0, 0, 1, 0, 0, 0]], dtype=torch.float64)
    return ctx, prem, label


def test_infonce_is_the_hand_written_formula_in_float64() -> None:
    ctx, prem, label = fixed_batch()
    similarity = (ctx @ prem.t()).tolist()
    expected = hand_infonce(similarity, label.tolist(), T)
    got = info_nce(ctx, prem, label, T)
    assert got.dtype == torch.float64
    assert got.item() == pytest.approx(expected, rel=1e-12)
    options = RetrieverOptions(loss="infonce")
    assert options.temperature == T  # the documented default
    assert retrieval_loss(ctx, prem, label, options).item() == pytest.approx(expected, rel=1e-12)
    # The shared positive counts as a positive of context 0: with it read as a negative the loss is another one.
    single = label.clone()
    single[0, 1] = 0.0
    assert info_nce(ctx, prem, single, T).item() == pytest.approx(hand_infonce(similarity, single.tolist(), T))
    assert abs(info_nce(ctx, prem, single, T).item() - expected) > 1e-3
    # The temperature divides the similarities.
    assert info_nce(ctx, prem, label, 0.5).item() == pytest.approx(hand_infonce(similarity, label.tolist(), 0.5))


def test_mse_is_the_default_and_unchanged() -> None:
    assert ModelConfig().loss == "mse" and RetrieverOptions().loss == "mse"
    assert DataConfig().negatives == "random"
    ctx, prem, label = (t.float() for t in fixed_batch())
    mse = retrieval_loss(ctx, prem, label, RetrieverOptions())
    assert torch.equal(mse, contrastive_mse(ctx, prem, label))
    assert torch.equal(mse, ((ctx @ prem.t() - label) ** 2).mean())
    assert PipelineConfig.model_validate({"model": {"loss": "infonce", "temperature": 0.1}}).model.temperature == 0.1


class _Outputs(Callback):
    """What each training step returned (the loss the optimizer steps on), before that step."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


@pytest.mark.parametrize("loss", ["mse", "infonce"])
def test_ewc_adds_to_either_loss(loss: str) -> None:
    model = tiny_t5()  # dropout 0: the step's forward is the one computed here
    model.reconfigure(loss=loss)
    batch = hand_batch(*LENGTHS, padding=[False] * 4)
    plain = model.batch_loss(batch).item()
    name, first = next(iter(model.named_parameters()))
    anchor = {n: p.detach().clone() for n, p in model.named_parameters()}
    anchor[name].view(-1)[0] -= 2.0  # theta* 2 away from theta in one entry: penalty 0.5 * 3 * 2^2 = 6
    model.set_ewc({n: torch.full_like(p, 3.0) for n, p in model.named_parameters()}, ewc_lambda=0.5, anchor=anchor)
    outputs = _Outputs()
    pl.Trainer(accelerator="cpu", devices=1, max_steps=1, precision="32-true", logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               callbacks=[outputs]).fit(model, train_dataloaders=DataLoader([batch], batch_size=None))
    assert outputs.losses == [pytest.approx(plain + 6.0, rel=1e-6)]
    assert model.options.loss == loss


# ---- the Fisher of the configured loss ----------------------------------------------------------------------

def hand_loss(context: torch.Tensor, premises: torch.Tensor, label: torch.Tensor, loss: str) -> torch.Tensor:
    """Each loss as its docstring defines it, written again here (not through `losses.py`)."""
    s = context @ premises.t()
    if loss == "mse":
        return ((s - label) ** 2).mean()
    e = torch.exp(s / T)
    return (-torch.log((e * label).sum(dim=1) / e.sum(dim=1))).mean()


def per_example_by_hand(model: PremiseRetriever, batch: dict, loss: str) -> dict[str, torch.Tensor]:
    """sum over the batch's non-padding examples of (d loss_e / d theta)^2, each example over its own columns."""
    params = dict(model.named_parameters())
    sums = {n: torch.zeros_like(p) for n, p in params.items()}
    b = len(batch["index"])
    for i in range(b):
        if batch["is_padding"][i]:
            continue
        cols = list(range(i, b * COLUMNS, b))
        n_ctx = int(batch["context_mask"][i].sum())
        context = model.encode(batch["context_ids"][i : i + 1, :n_ctx], batch["context_mask"][i : i + 1, :n_ctx])
        premises = torch.cat([model.encode(batch["premise_ids"][c : c + 1, : int(batch["premise_mask"][c].sum())],
                                           batch["premise_mask"][c : c + 1, : int(batch["premise_mask"][c].sum())])
                              for c in cols])
        grads = torch.autograd.grad(hand_loss(context, premises, batch["label"][i : i + 1, cols], loss),
                                    list(params.values()), allow_unused=True)
        for n, g in zip(params, grads, strict=True):
            if g is not None:
                sums[n] += g**2
    return sums


@pytest.mark.parametrize("method", ["loop", "vectorised"])
def test_the_per_example_fisher_squares_gradients_of_the_configured_loss(method: str) -> None:
    batch = hand_batch(*LENGTHS, padding=[False, False, True, False])
    fishers = {}
    for loss in ("mse", "infonce"):
        model = tiny_t5()
        model.reconfigure(loss=loss)
        model.eval()
        module = FisherModule(model, method=method)
        module.on_train_epoch_start()
        module.training_step(batch, 0)
        expected = per_example_by_hand(model, batch, loss)
        for n, total in module.sums.items():
            torch.testing.assert_close(total, expected[n], rtol=2e-4, atol=1e-9 * float(expected[n].abs().max()))
        fishers[loss] = module.sums
    assert any(not torch.allclose(fishers["mse"][n], fishers["infonce"][n], rtol=1e-2) for n in fishers["mse"])


class _Batches(Callback):
    def __init__(self) -> None:
        self.batches: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append({k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()})


def test_the_reference_fisher_squares_batch_gradients_of_the_configured_loss(unit_repo: Path) -> None:
    model = tiny_t5()
    model.reconfigure(loss="infonce")
    dm = RetrievalDataModule(unit_repo, model.tokenizer, DataConfig(batch_size=4, num_workers=0, max_seq_len=96),
                             premise_max_len=96, seed=5)
    dm.train_examples = dm.train_examples[:12]
    module, seen = ReferenceFisherModule(model), _Batches()
    pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, precision="32-true", logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               callbacks=[seen]).fit(module, train_dataloaders=dm.train_dataloader())
    params = dict(model.named_parameters())
    expected = {n: torch.zeros_like(p) for n, p in params.items()}
    for batch in seen.batches:
        context = model.encode(batch["context_ids"], batch["context_mask"])
        premises = model.encode(batch["premise_ids"], batch["premise_mask"])
        grads = torch.autograd.grad(hand_loss(context, premises, batch["label"], "infonce"), list(params.values()),
                                    allow_unused=True)
        for n, g in zip(params, grads, strict=True):
            if g is not None:
                expected[n] += g**2
    for n in params:
        torch.testing.assert_close(module.fisher[n], expected[n] / 12, rtol=2e-4, atol=1e-12)


def test_every_estimator_is_covered_here() -> None:
    """A new estimator in the registry must get its configured-loss test above."""
    assert set(ESTIMATORS) == {FisherModule.name, ReferenceFisherModule.name}


def test_the_infonce_config_changes_the_recipe_only() -> None:
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "leanagent-infonce.yaml")
    assert (cfg.model.loss, cfg.model.temperature, cfg.data.negatives, cfg.data.mined_pool) == (
        "infonce", 0.05, "mined", 50)
    default = PipelineConfig()
    recipe = {"model": {"loss", "temperature"}, "data": {"negatives", "mined_pool"}}
    assert cfg.model_dump(exclude={**recipe, "run_dir": True, "repos": True}) == default.model_dump(
        exclude={**recipe, "run_dir": True, "repos": True})


def test_a_new_loss_is_one_table_entry(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Registered once, a loss is accepted by the options and is what the step minimises (the Fisher estimators
    read the same table's per-context form); a name of no entry is refused before any launch, naming the known."""
    from leanagent.model import losses
    from leanagent.preflight.checks import check_options

    def l1_rows(similarity: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return (similarity - label).abs().mean(dim=1)

    entry = losses.Loss("l1", lambda c, p, label, o: l1_rows(c @ p.t(), label.to(c.dtype)).mean(),
                        lambda s, label, o: l1_rows(s, label), "mean absolute error")
    monkeypatch.setitem(losses.LOSSES, "l1", entry)
    options = RetrieverOptions(loss="l1")
    ctx, prem, label = (t.float() for t in fixed_batch())
    torch.testing.assert_close(retrieval_loss(ctx, prem, label, options), (ctx @ prem.t() - label).abs().mean())
    assert check_options(PipelineConfig.model_validate({"model": {"loss": "l1"}})) == []
    assert check_options(PipelineConfig.model_validate({"model": {"loss": "l2"}})) == [
        "model.loss: 'l2' is not a valid value (did you mean 'l1'?); one of: mse, infonce, l1"]
