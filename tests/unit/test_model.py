"""Retriever loss, EWC penalty, per-example Fisher and metrics against values computed by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from leanagent.checkpoints.ours import epochs_completed, load_fisher, save_fisher
from leanagent.data.corpus import Corpus
from leanagent.data.dataset import TrainDataset
from leanagent.data.examples import build_train_examples
from leanagent.data.theorems import load_split
from leanagent.ground.atomic import write_json_atomic
from leanagent.model.fisher import FisherModule
from leanagent.model.fisher.batches import PaddedForRanks
from leanagent.model.losses import contrastive_mse
from leanagent.model.metrics import aggregate, score_context
from leanagent.model.options import RetrieverOptions
from leanagent.model.retriever import PremiseRetriever
from leanagent.train.plan import plan_training


def test_recall_and_mrr_by_hand():
    s = score_context(0, [5, 3, 9, 1] + list(range(10, 20)), positives=[3, 1, 42])
    assert s.recall_at_1 == 0.0
    assert s.recall_at_10 == pytest.approx(2 / 3)  # 3 and 1 are in the top 10, 42 is not
    assert s.reciprocal_rank == pytest.approx(1 / 2)
    t = score_context(1, [7], positives=[7])
    m = aggregate([s, t, s])  # a padded duplicate of context 0 counts once
    assert m["num_contexts"] == 2
    assert m["Recall@1"] == pytest.approx(50.0)  # recall in percent, as LeanAgent reports it
    assert m["Recall@10"] == pytest.approx(100 * (2 / 3 + 1) / 2)
    assert m["MRR"] == pytest.approx(0.75)  # MRR stays a fraction, as in the reference
    assert score_context(2, [], positives=[1]).reciprocal_rank == 0.0  # nothing accessible: no crash


def test_contrastive_mse_by_hand():
    ctx = torch.tensor([[1.0, 0.0]])
    prem = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    # similarities (1, 0) against labels (1, 1): squared errors (0, 1), mean 0.5
    assert contrastive_mse(ctx, prem, torch.tensor([[1.0, 1.0]])).item() == pytest.approx(0.5)


@pytest.fixture(scope="module")
def tiny(unit_repo, tiny_model) -> dict:
    model_dir, repo = tiny_model, unit_repo
    corpus = Corpus.from_jsonl(repo / "corpus.jsonl")
    examples = build_train_examples(corpus, load_split(repo / "random" / "train.json"))
    return {"model_dir": model_dir, "corpus": corpus, "examples": examples}


def _retriever(tiny) -> PremiseRetriever:
    torch.manual_seed(0)
    return PremiseRetriever(RetrieverOptions(name_or_path=str(tiny["model_dir"]), max_seq_len=128))


def test_retriever_keeps_its_architecture_for_offline_resume(tiny):
    model = _retriever(tiny)
    assert model.encoder.training, "dropout must be on for training (from_pretrained returns eval mode)"
    clone = PremiseRetriever(RetrieverOptions(name_or_path="unreachable/hub-id"),
                             encoder_config=model.encoder.config.to_dict())
    assert {n: p.shape for n, p in clone.named_parameters()} == {n: p.shape for n, p in model.named_parameters()}


def test_ewc_penalty_by_hand(tiny):
    model = _retriever(tiny)
    fisher = {n: torch.full_like(p, 2.0) for n, p in model.named_parameters()}
    model.set_ewc(fisher, ewc_lambda=0.5)
    model.on_fit_start()
    assert model.ewc_penalty().item() == 0.0  # theta == theta* at the start of the fit
    name, param = next(iter(model.named_parameters()))
    with torch.no_grad():
        param.view(-1)[0] += 3.0
    # 0.5 * 2.0 * 3.0^2
    assert model.ewc_penalty().item() == pytest.approx(9.0, rel=1e-5)


def test_ewc_anchor_given_explicitly_survives_fit_start(tiny):
    """A retry resumes from last.ckpt; theta* must stay the weights at the start of the repository."""
    model = _retriever(tiny)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the half-trained weights a retry resumes from
    model.set_ewc({n: torch.ones_like(p) for n, p in model.named_parameters()}, ewc_lambda=1.0, anchor=start)
    model.on_fit_start()
    numel = sum(p.numel() for p in model.parameters())
    assert model.ewc_penalty().item() == pytest.approx(numel, rel=1e-4)  # sum of 1 * (1.0)^2


def test_ewc_refuses_a_fisher_of_another_model(tiny):
    model = _retriever(tiny)
    with pytest.raises(ValueError, match="missing"):
        model.set_ewc({"encoder.shared.weight": torch.zeros(3)}, 0.1)


def test_fisher_is_the_mean_of_squared_per_example_gradients(tiny, tmp_path):
    model = _retriever(tiny)
    model.eval()
    dataset = TrainDataset(tiny["corpus"], tiny["examples"][:5], model.tokenizer, num_negatives=3,
                           num_in_file_negatives=1, context_max_len=128, premise_max_len=128, seed=1,
                           deterministic=True)
    padded = PaddedForRanks(dataset, world_size=2)  # 5 examples -> 6 items, the last one padding
    batch = padded.collate([padded[i] for i in range(len(padded))])
    assert batch["is_padding"].tolist() == [False] * 5 + [True]

    module = FisherModule(model)
    module.on_train_epoch_start()
    module.training_step(batch, 0)
    module.on_train_epoch_end()
    assert module.num_examples == 5

    # Reference: backward of each example alone through the usual .grad path.
    params = dict(model.named_parameters())
    expected = {n: torch.zeros_like(p) for n, p in params.items()}
    mean_grad = {n: torch.zeros_like(p) for n, p in params.items()}
    for i in range(5):
        single = dataset.collate([dataset[i]])
        model.zero_grad()
        model.batch_loss(single).backward()
        for n, p in params.items():
            if p.grad is not None:
                expected[n] += p.grad ** 2 / 5
                mean_grad[n] += p.grad / 5
    for n in params:
        torch.testing.assert_close(module.fisher[n], expected[n], rtol=1e-4, atol=1e-9)
    # The square of the mean gradient is a different (smaller) quantity: the test can tell them apart.
    total = sum(module.fisher[n].sum() for n in params)
    squared_mean = sum((mean_grad[n] ** 2).sum() for n in params)
    assert squared_mean < 0.9 * total

    path = tmp_path / "f.safetensors"
    save_fisher(path, module.fisher, {"num_examples": 5, "world_size": 1})
    loaded, meta = load_fisher(path)
    assert meta == {"num_examples": 5, "world_size": 1} and loaded.keys() == module.fisher.keys()


def test_fisher_loader_refuses_negative_or_nan(tmp_path):
    path = tmp_path / "bad.safetensors"
    save_fisher(path, {"w": torch.tensor([1.0, -1.0])}, {})
    with pytest.raises(ValueError, match="negative or not finite"):
        load_fisher(path)


def _fake_checkpoint(path: Path, processed: int) -> Path:
    progress = {"ready": processed, "started": processed, "processed": processed, "completed": processed - 1}
    torch.save({"epoch": processed - 1, "loops": {"fit_loop": {"epoch_progress": {"current": progress}}},
                "state_dict": {}, "hyper_parameters": {"encoder_config": {}}}, path)  # one of ours
    return path


def test_epochs_and_plan_come_from_checkpoints(tmp_path):
    start = _fake_checkpoint(tmp_path / "start.ckpt", processed=3)
    assert epochs_completed(torch.load(start, weights_only=False)) == 3
    job = tmp_path / "job"
    plan = plan_training(job, start, epochs_per_repo=2)
    assert (plan.target_epochs, plan.resume_from) == (5, str(start.resolve()))
    # An interrupted attempt left last.ckpt: the retry resumes from it towards the same target.
    assert not plan.is_retry and plan.start_epochs == 3
    write_json_atomic(job / "job.json", {"start_checkpoint": plan.start_checkpoint, "start_epochs": 3,
                                         "target_epochs": 5})
    _fake_checkpoint((job / "checkpoints").mkdir(parents=True) or job / "checkpoints" / "last.ckpt", processed=4)
    retry = plan_training(job, start, epochs_per_repo=2)
    assert (retry.target_epochs, retry.resume_from) == (5, str(job / "checkpoints" / "last.ckpt"))
    assert retry.is_retry and retry.start_epochs == 3
    with pytest.raises(ValueError, match="new --out"):
        plan_training(job, _fake_checkpoint(tmp_path / "other.ckpt", 1), epochs_per_repo=2)
    assert plan_training(tmp_path / "fresh", None, epochs_per_repo=2).target_epochs == 2
