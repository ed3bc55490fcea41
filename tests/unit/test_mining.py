"""`data.negatives: mined`: the table is the model's own top accessible non-positives, the draw keeps to it (and
to the in-file count rule), and the data module keeps it in checkpoints for its own dataset only."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from leanagent.data.datamodule import RetrievalDataModule
from leanagent.data.negatives import negative_pools, pool_members, sample_negatives
from leanagent.data.tokenize import tokenize
from leanagent.ground.config import DataConfig
from leanagent.model.evaluation import CorpusEmbedding
from leanagent.model.mining import mine_table
from leanagent.model.options import RetrieverOptions
from leanagent.model.retriever import PremiseRetriever

POOL = 6


@pytest.fixture(scope="module")
def mined(unit_repo: Path, tiny_model: Path) -> dict:
    torch.manual_seed(0)
    model = PremiseRetriever(RetrieverOptions(name_or_path=str(tiny_model), max_seq_len=128)).eval()
    dm = RetrievalDataModule(unit_repo, model.tokenizer, DataConfig(num_workers=0, max_seq_len=128,
                                                                     negatives="mined", mined_pool=POOL),
                             premise_max_len=128, seed=1)
    with torch.no_grad():
        corpus_emb = model.embed_corpus(dm.corpus)
    table = mine_table(model, CorpusEmbedding.of_corpus(corpus_emb, dm.corpus), dm.corpus, dm.train_examples, POOL,
                       128, batch_size=5)
    return {"model": model, "dm": dm, "corpus_emb": corpus_emb, "table": table}


def test_the_table_is_the_models_top_accessible_non_positives(mined: dict) -> None:
    model, dm, corpus_emb, table = mined["model"], mined["dm"], mined["corpus_emb"], mined["table"]
    assert table.shape == (len(dm.train_examples), POOL) and table.dtype == torch.int32
    for e, ex in enumerate(dm.train_examples):
        # By brute force: this context alone, every premise scored, the inaccessible and the positives dropped.
        ids, mask = tokenize(model.tokenizer, [ex.context], 128)
        with torch.no_grad():
            scores = (model.encode(ids, mask) @ corpus_emb.t())[0]
        allowed = dm.corpus.accessible_mask(ex.file_path, ex.theorem_start)
        allowed[ex.all_pos_premises] = False
        candidates = allowed.nonzero().flatten()
        best = candidates[scores[candidates].argsort(descending=True, stable=True)][:POOL].tolist()
        row = [i for i in table[e].tolist() if i >= 0]
        assert len(row) == min(POOL, len(candidates))
        assert set(row).isdisjoint(ex.all_pos_premises) and all(bool(allowed[i]) for i in row)
        # The same premises, best first (scores may tie to float rounding between the batched and single pass).
        torch.testing.assert_close(scores[row], scores[best], rtol=0, atol=1e-5)
    assert (table >= 0).sum() > 0


def test_the_draw_keeps_to_the_mined_candidates_and_the_in_file_rule(mined: dict) -> None:
    dm, table = mined["dm"], mined["table"]
    checked = 0
    for e, ex in enumerate(dm.train_examples):
        row = table[e].numpy()
        candidates = {int(i) for i in row if i >= 0}
        in_file = set(pool_members(negative_pools(dm.corpus, ex)[0])) - set(ex.all_pos_premises) - {ex.pos_premise}
        if len(candidates) < 3:
            continue
        got = sample_negatives(dm.corpus, ex, 3, 1, random.Random(e), row)
        assert len(set(got)) == 3 and set(got) <= candidates
        assert sum(g in in_file for g in got) >= min(1, len(candidates & in_file))
        assert got == sample_negatives(dm.corpus, ex, 3, 1, random.Random(e), row)  # a pure function
        checked += 1
    assert checked > 5
    # Without a table (before the first validation): exactly LeanAgent's random draw.
    ex = dm.train_examples[0]
    assert sample_negatives(dm.corpus, ex, 3, 1, random.Random(9), None) == \
        sample_negatives(dm.corpus, ex, 3, 1, random.Random(9))


def test_the_data_module_keeps_the_table_for_its_own_dataset_only(mined: dict, unit_repo: Path) -> None:
    dm, table = mined["dm"], mined["table"].numpy()
    assert dm.state_dict() == {}  # random negatives: nothing to keep
    ds = dm.train_dataset()
    dm._train_ds = ds
    dm.set_mined(table)
    assert ds.mined is table and dm.train_dataset().mined is table and dm.fisher_dataset().mined is None
    state = dm.state_dict()
    fresh = RetrievalDataModule(unit_repo, dm.tokenizer, dm.cfg, premise_max_len=128, seed=1)
    fresh.load_state_dict(state)
    assert np.array_equal(fresh.mined, table)
    other = RetrievalDataModule(unit_repo, dm.tokenizer, dm.cfg, premise_max_len=128, seed=1)
    other.load_state_dict({**state, "mined_for": "another-repository:random:3:10"})
    assert other.mined is None  # a new repository starts random
    with pytest.raises(ValueError, match="rows"):
        dm.set_mined(table[:-1])
