"""Corpus embedding sorted by length into token-budget batches equals the plain, corpus-order definition."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import ByT5Tokenizer

from leanagent.data.corpus import Corpus
from leanagent.data.synthetic import write_demo_repos
from leanagent.model.evaluation import length_order, premise_token_lengths, token_budget_batches
from leanagent.model.options import RetrieverOptions
from leanagent.model.presets import write_random_encoder
from leanagent.model.retriever import PremiseRetriever


def test_token_budget_batches_cover_everything_within_budget():
    rng = np.random.default_rng(0)
    lengths = np.sort(rng.integers(1, 300, size=500))
    batches = token_budget_batches(lengths, budget=1024)
    assert batches[0][0] == 0 and batches[-1][1] == 500
    assert all(a[1] == b[0] for a, b in zip(batches, batches[1:], strict=False))
    for lo, hi in batches:
        assert (hi - lo) * lengths[lo:hi].max() <= 1024 or hi - lo == 1
    assert token_budget_batches(np.array([5000, 6000]), budget=100) == [(0, 1), (1, 2)]  # one over budget: alone
    assert token_budget_batches(np.array([], dtype=np.int64), budget=10) == []


def test_sorted_embedding_equals_corpus_order_batches(tmp_path):
    repo = write_demo_repos(tmp_path / "data", 1, seed=4, scale=2)[0]
    corpus = Corpus.from_jsonl(repo / "corpus.jsonl")
    model_dir = write_random_encoder(tmp_path / "model", "tiny", seed=1)
    torch.manual_seed(0)
    model = PremiseRetriever(RetrieverOptions(name_or_path=str(model_dir), max_seq_len=48, eval_batch_size=8)).eval()
    lengths = premise_token_lengths(corpus, 48)
    assert lengths.max() == 48 and lengths.min() < 48  # some premises are cut, some are not
    assert np.all(np.diff(lengths[length_order(corpus, 48)]) >= 0)
    fast = model.embed_corpus(corpus)
    tok = ByT5Tokenizer()
    plain = []
    with torch.no_grad():
        for i in range(0, len(corpus), 7):  # the straightforward definition: corpus order, padded per batch
            enc = tok([p.text for p in corpus.premises[i : i + 7]], padding="longest", truncation=True,
                      max_length=48, return_tensors="pt")
            plain.append(model.encode(enc["input_ids"], enc["attention_mask"]))
    plain = torch.cat(plain)
    assert fast.shape == plain.shape == (len(corpus), model.encoder.config.d_model)
    assert torch.allclose(fast, plain, atol=1e-5), (fast - plain).abs().max()
    assert torch.equal(fast.norm(dim=1).round(decimals=4), torch.ones(len(corpus)))


@pytest.mark.parametrize("budget_rows", [1, 3])
def test_a_tiny_budget_still_embeds_each_premise_alone(tmp_path, budget_rows):
    repo = write_demo_repos(tmp_path / "data", 1, seed=5)[0]
    corpus = Corpus.from_jsonl(repo / "corpus.jsonl")
    model = PremiseRetriever(RetrieverOptions(name_or_path=str(write_random_encoder(tmp_path / "model", "tiny")),
                                              max_seq_len=32, eval_batch_size=budget_rows)).eval()
    emb = model.embed_corpus(corpus)
    assert torch.isfinite(emb).all() and emb.shape[0] == len(corpus)


class _Recording(PremiseRetriever):
    """Records how evaluation embedded the corpus: under autocast or not, and the embedding's dtype."""

    seen: list[tuple[bool, torch.dtype]]

    def embed_corpus(self, corpus, batch_tokens: int | None = None, rows=None) -> torch.Tensor:
        emb = super().embed_corpus(corpus, batch_tokens, rows)
        self.seen.append((torch.is_autocast_enabled("cpu"), emb.dtype))
        return emb


@pytest.mark.parametrize("precision, corpus_autocast, expected", [
    ("bf16-mixed", False, (False, torch.bfloat16)),  # LeanAgent's: fp32 encoder, stored as the product rounds it
    ("bf16-mixed", True, (True, torch.bfloat16)),
    ("32-true", True, (False, torch.float32)),  # no autocast to opt into
])
def test_evaluation_embeds_the_corpus_in_fp32_unless_told(tmp_path, precision, corpus_autocast, expected):
    import pytorch_lightning as pl

    from leanagent.data.datamodule import RetrievalDataModule
    from leanagent.ground.config import DataConfig

    repo = write_demo_repos(tmp_path / "data", 1, seed=6)[0]
    model = _Recording(RetrieverOptions(name_or_path=str(write_random_encoder(tmp_path / "model", "tiny")),
                                        max_seq_len=32, eval_batch_size=16, corpus_autocast=corpus_autocast))
    model.seen = []
    data = RetrievalDataModule(repo, ByT5Tokenizer(), DataConfig(eval_batch_size=16, num_workers=0, max_seq_len=32),
                               premise_max_len=32, seed=0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, precision=precision, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.validate(model, datamodule=data)
    assert model.seen == [expected]
    assert 0 <= model.eval_metrics["Recall@10"] <= 100
