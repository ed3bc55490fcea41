"""Embed once, embed only what can be ranked: the metrics are those of each dataset evaluated alone on its whole
corpus (LeanAgent's way), on a real Lightning Trainer, in fp32 exactly and under bf16 to rounding; mined negatives
drawn from the smaller embedding are the same table."""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from leanagent.data.datamodule import RetrievalDataModule, union_table
from leanagent.data.synthetic import write_demo_repos
from leanagent.data.synthetic_scale import ScaleSpec
from leanagent.ground.config import DataConfig
from leanagent.ground.timings import JobClock
from leanagent.index.stage import StageIndex
from leanagent.model.evaluation import CorpusEmbedding
from leanagent.model.mining import mine_table
from leanagent.model.options import RetrieverOptions
from leanagent.model.retriever import PremiseRetriever

MAX_LEN = 96


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return write_demo_repos(tmp_path_factory.mktemp("shared") / "data", 3, seed=5,
                            dependency=ScaleSpec(files=20, premises=300))


def _model(tiny_model: Path, **options) -> PremiseRetriever:
    torch.manual_seed(0)
    model = PremiseRetriever(RetrieverOptions(name_or_path=str(tiny_model), max_seq_len=MAX_LEN, eval_batch_size=16,
                                              **options)).eval()
    model.clock = JobClock()
    return model


def _modules(repos: list[Path], model: PremiseRetriever, **data) -> list[RetrievalDataModule]:
    cfg = DataConfig(eval_batch_size=16, num_workers=0, max_seq_len=MAX_LEN, **data)
    return [RetrievalDataModule(r, model.tokenizer, cfg, premise_max_len=MAX_LEN, seed=0) for r in repos]


def _test(model: PremiseRetriever, dm: RetrievalDataModule, precision: str) -> dict[str, float]:
    trainer = pl.Trainer(accelerator="cpu", devices=1, precision=precision, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.test(model, datamodule=dm, verbose=False)
    return dict(model.eval_metrics)


@pytest.mark.parametrize("precision, corpus_autocast", [("32-true", False), ("bf16-mixed", False),
                                                         ("bf16-mixed", True)])
def test_one_union_embedding_scores_each_dataset_as_its_whole_corpus_alone(repos, tiny_model, precision,
                                                                          corpus_autocast) -> None:
    alone_model = _model(tiny_model, embed_premises="all", corpus_autocast=corpus_autocast)
    alone = [_test(alone_model, dm, precision) for dm in _modules(repos, alone_model)]
    model = _model(tiny_model, corpus_autocast=corpus_autocast)
    modules = _modules(repos, model)
    table = union_table(modules, "test")
    together = []
    for k, dm in enumerate(modules):
        model.evaluation.share(table, k)
        together.append(_test(model, dm, precision))
    model.evaluation.release()

    distinct = {(p.path, p.full_name, p.code) for dm in modules for p in dm.corpus.premises}
    # Each distinct premise at most once, and only those some test context may use.
    assert model.clock.premises_embedded == len(table) < len(distinct)
    assert alone_model.clock.premises_embedded == sum(len(dm.corpus) for dm in modules)
    assert model.clock.premises_in_corpora == alone_model.clock.premises_embedded
    for one, union in zip(alone, together, strict=True):
        assert union["num_contexts"] == one["num_contexts"] > 0
        if not corpus_autocast:
            # The premises embedded in fp32 (stored in bf16 under bf16-mixed, as the product rounds them): the same
            # embeddings, ranked the same (equal scores, frequent in bf16, in corpus order either way).
            assert (union["Recall@1"], union["Recall@10"]) == (one["Recall@1"], one["Recall@10"])
            assert union["MRR"] == pytest.approx(one["MRR"], abs=1e-6)
        else:  # embedded under bf16 autocast with other batch mates: equal to bf16 rounding, a context's worth
            step = 100.0 / one["num_contexts"]
            for key in ("Recall@1", "Recall@10"):
                assert abs(union[key] - one[key]) <= step + 1e-9, key
            assert abs(union["MRR"] - one["MRR"]) <= 0.02
    assert any(m["Recall@10"] > 0 for m in alone)


def test_validation_embeds_only_what_its_contexts_may_use(repos, tiny_model) -> None:
    needed, whole = _model(tiny_model), _model(tiny_model, embed_premises="all")
    trainer = pl.Trainer(accelerator="cpu", devices=1, precision="32-true", logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    dm = _modules(repos[:1], needed)[0]
    trainer.validate(needed, datamodule=dm, verbose=False)
    first = dict(needed.eval_metrics)
    trainer.validate(whole, datamodule=dm, verbose=False)
    assert first == whole.eval_metrics
    assert needed.clock.premises_embedded == len(dm.premise_table("val", needed_only=True)) < len(dm.corpus)
    assert whole.clock.premises_embedded == len(dm.corpus)


def test_mined_negatives_from_the_needed_embedding_are_the_whole_corpus_table(repos, tiny_model) -> None:
    """Under data.negatives: mined, validation's embedding keeps the premises the training contexts may use."""
    model = _model(tiny_model)
    dm = _modules(repos[2:], model, negatives="mined", mined_pool=6)[0]
    table = dm.premise_table("val", needed_only=True)
    assert len(table) < len(dm.corpus)
    with torch.no_grad():
        part = CorpusEmbedding(model.embed_corpus(table), table)
        whole = CorpusEmbedding.of_corpus(model.embed_corpus(dm.corpus), dm.corpus)
    mined = [mine_table(model, e, dm.corpus, dm.train_examples, 6, MAX_LEN, batch_size=8) for e in (part, whole)]
    assert torch.equal(mined[0], mined[1]) and (mined[0] >= 0).sum() > 0


def test_a_kept_index_table_takes_its_rows_from_the_tests_that_embed_their_whole_corpus(repos, tiny_model) -> None:
    """LeanAgent's `all` with a stage index: each test embeds its whole corpus, and the index's rows are copied from
    those embeddings, whichever corpus the index has a shared file from; only what no test embedded is embedded
    again, and the rows are those of the index's table embedded on its own."""
    model = _model(tiny_model, embed_premises="all")
    modules = _modules(repos, model)
    stage = StageIndex(repos, [dm.corpus for dm in modules])  # the shared files come from the third corpus
    kept = stage.table()
    model.evaluation.keep(kept)
    for dm in modules[:2]:  # the third repository is not evaluated: its own files are embedded for the index
        _test(model, dm, "32-true")
    by_tests = model.clock.premises_embedded
    assert by_tests == len(modules[0].corpus) + len(modules[1].corpus)
    emb = model.evaluation.kept_embedding(model)
    own_third = sum(1 for p in modules[2].corpus.premises if not p.path.startswith(".lake/"))
    assert model.clock.premises_embedded - by_tests == own_third > 0
    with torch.no_grad():
        alone = model.embed_corpus(kept)
    torch.testing.assert_close(emb, alone, rtol=1e-4, atol=1e-5)
    assert model.evaluation.kept_embedding(model) is emb  # nothing more to embed
    model.evaluation.release()
