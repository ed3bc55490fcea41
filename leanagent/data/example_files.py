"""`leanagent examples`: exactly what the retriever is fed, written as JSON lines a person can read.

The files are built by the same functions training and evaluation use (examples, contexts,
positives, negatives, premise texts), so what a user inspects, or a test compares with the
reference, is what the model sees. Negatives are drawn with the per-example seeds of the
deterministic training dataset, so the same seed writes the same files.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from leanagent.data.corpus import Corpus
from leanagent.data.dataset import example_seed
from leanagent.data.examples import build_eval_examples, build_train_examples
from leanagent.data.negatives import sample_negatives
from leanagent.data.theorems import load_split
from leanagent.ground.config import DataConfig
from leanagent.ground.names import CORPUS_FILE, PARTS, TRAIN_PART, part_file


def premise_record(corpus: Corpus, index: int) -> dict[str, Any]:
    p = corpus.premises[index]
    return {"full_name": p.full_name, "path": p.path, "start": list(p.start), "text": p.text}


def _train_lines(corpus: Corpus, theorems: list, cfg: DataConfig, seed: int) -> Iterator[dict[str, Any]]:
    for ex in build_train_examples(corpus, theorems):
        rng = random.Random(example_seed(seed, ex.index))
        negatives = sample_negatives(corpus, ex, cfg.num_negatives, cfg.num_in_file_negatives, rng)
        yield {
            "theorem": ex.theorem, "file_path": ex.theorem_file, "theorem_start": list(ex.theorem_start),
            "tactic_index": ex.tactic_index, "context": ex.context,
            "positives": [premise_record(corpus, i) for i in ex.all_pos_premises],
            "positive": premise_record(corpus, ex.pos_premise),
            "negatives": [premise_record(corpus, i) for i in negatives],
        }


def _eval_lines(corpus: Corpus, theorems: list) -> Iterator[dict[str, Any]]:
    for ex in build_eval_examples(corpus, theorems, unlabelled=True):
        yield {
            "theorem": ex.theorem, "file_path": ex.theorem_file, "theorem_start": list(ex.theorem_start),
            "tactic_index": ex.tactic_index, "context": ex.context,
            "positives": [premise_record(corpus, i) for i in ex.all_pos_premises],
        }


def write_example_files(dataset: Path, out: Path, cfg: DataConfig, seed: int) -> dict[str, int]:
    """Write OUT/{train,val,test}.jsonl for `dataset`'s `cfg.split`; returns the line count per file."""
    dataset, out = Path(dataset), Path(out)
    corpus = Corpus.from_jsonl(dataset / CORPUS_FILE)
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split in PARTS:
        source = dataset / cfg.split / part_file(split)
        theorems = load_split(source) if source.is_file() else []
        lines = _train_lines(corpus, theorems, cfg, seed) if split == TRAIN_PART else _eval_lines(corpus, theorems)
        target = out / f"{split}.jsonl"
        tmp = target.with_name(target.name + ".tmp")
        n = 0
        with open(tmp, "w", encoding="utf-8") as f:
            for line in lines:
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
                n += 1
        tmp.replace(target)
        counts[split] = n
    return counts
