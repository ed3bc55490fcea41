"""Batches: label matrix, premise order, and byte-identical ByT5 tokens."""

from __future__ import annotations

import torch

from leanagent.data.corpus import Corpus
from leanagent.data.dataset import (
    EvalDataset,
    EvalExample,
    TrainDataset,
    TrainExample,
    build_eval_examples,
    build_train_examples,
    tokenize_premises,
)
from leanagent.data.theorems import Annotation, Tactic, Theorem


def train_dataset(corpus: Corpus, tokenizer, num_negatives: int = 1, max_len: int = 2048) -> TrainDataset:
    return TrainDataset(corpus, [], tokenizer, num_negatives, 0, max_len, max_len, seed=0)


def test_labels_count_shared_positives(hand_corpus: Corpus, tokenizer) -> None:
    ex0 = TrainExample(0, "2 + 2 = 4", "C.lean", (21, 1), 0, [0, 1])
    ex1 = TrainExample(1, "⊢ x = x", "C.lean", (21, 1), 1, [1])
    batch = [{"example": ex0, "negatives": [2]}, {"example": ex1, "negatives": [0]}]
    out = train_dataset(hand_corpus, tokenizer).collate(batch)
    # Order: positives of ex0, ex1, then negative slot 0 of ex0, ex1 -> premises [0, 1, 2, 0].
    assert out["premise_index"].tolist() == [0, 1, 2, 0]
    # ex0's positives are {0, 1}: its own positive, ex1's positive and ex1's negative (premise 0) all count.
    assert out["label"].tolist() == [[1.0, 1.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]]
    assert out["label"].dtype == torch.float32
    assert out["index"].tolist() == [0, 1]
    assert out["premise_ids"].shape[0] == 4 and out["premise_mask"].shape == out["premise_ids"].shape


def test_tokens_match_byt5(hand_corpus: Corpus, tokenizer) -> None:
    contexts = ["x y : Nat\n⊢ glim (frob x) = frob (glim x)", "⊢ ∀ (a : ℕ), a = a"]
    batch = [
        {"example": TrainExample(k, c, "C.lean", (21, 1), k, [k]), "negatives": [5 + k]} for k, c in enumerate(contexts)
    ]
    ds = TrainDataset(hand_corpus, [], tokenizer, 1, 0, context_max_len=20, premise_max_len=12, seed=0)
    out = ds.collate(batch)
    ref = tokenizer(contexts, padding="longest", truncation=True, max_length=20, return_tensors="pt")
    assert torch.equal(out["context_ids"], ref["input_ids"])
    assert torch.equal(out["context_mask"], ref["attention_mask"])
    assert out["context_ids"].shape == (2, 20)
    texts = [hand_corpus.premises[i].text for i in [0, 1, 5, 6]]
    ref = tokenizer(texts, padding="longest", truncation=True, max_length=12, return_tensors="pt")
    assert torch.equal(out["premise_ids"], ref["input_ids"])
    assert torch.equal(out["premise_mask"], ref["attention_mask"])
    ids, mask = tokenize_premises(tokenizer, hand_corpus, [0, 1, 5, 6], 12)
    assert torch.equal(ids, ref["input_ids"]) and torch.equal(mask, ref["attention_mask"])


def test_eval_collate(hand_corpus: Corpus, tokenizer) -> None:
    examples = [
        EvalExample(0, "⊢ a", "C.lean", (6, 2), [4], "T.a"),
        EvalExample(1, "⊢ b", "X.lean", (1, 1), [8], "T.b"),
    ]
    ds = EvalDataset(hand_corpus, examples, tokenizer, 32)
    out = ds.collate([ds[0], ds[1]])
    assert out["accessible_mask"].shape == (2, 9)
    assert out["accessible_mask"][0].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5]
    assert out["accessible_mask"][1].nonzero().flatten().tolist() == [8]
    assert out["pos_premises"] == [[4], [8]]
    assert out["index"].tolist() == [0, 1]


def _theorem(file_path: str, tactics: list[Tactic]) -> Theorem:
    return Theorem("T.t", file_path, (30, 1), (31, 1), "u", "c", tactics, None, "random/train.json")


def test_examples_from_theorems(hand_corpus: Corpus) -> None:
    ann = [
        Annotation("a1", "A.lean", (1, 9), (1, 11)),
        Annotation("a1", "A.lean", (1, 9), (1, 11)),  # repeated mention: one positive
        Annotation("c2", "C.lean", (5, 9), (5, 11)),
        Annotation("Unknown", "Nowhere.lean", (1, 1), (1, 2)),
    ]
    tactics = [
        Tactic("rw [a1, c2]", "2 goals\n⊢ p\n\n⊢ q", "⊢ q", ann),
        Tactic("intro x", "⊢ r", "no goals", []),
        Tactic("simp", "⊢ s", "no goals", None),
    ]
    theorems = [_theorem("C.lean", tactics), _theorem("Missing.lean", tactics)]
    train = build_train_examples(hand_corpus, theorems)
    assert [(e.index, e.pos_premise, e.all_pos_premises) for e in train] == [(0, 0, [0, 5]), (1, 5, [0, 5])]
    assert train[0].context == "⊢ p\n\n⊢ q" and train[0].file_path == "C.lean" and train[0].theorem == "T.t"
    evals = build_eval_examples(hand_corpus, theorems)
    assert [(e.index, e.all_pos_premises, e.theorem) for e in evals] == [(0, [0, 5], "T.t")]
