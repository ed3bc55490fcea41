"""One corruption per test: validate_dataset must name the file and line, or the theorem."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from data_helpers import read_jsonl, write_jsonl

from leanagent.data.validate import Problem, validate_dataset


def messages(dataset: Path) -> list[str]:
    return [str(p) for p in validate_dataset(dataset)]


def one(dataset: Path) -> str:
    found = messages(dataset)
    assert len(found) == 1, found
    return found[0]


def load_train(dataset: Path) -> list[dict[str, Any]]:
    return json.loads((dataset / "random" / "train.json").read_text())


def save_train(dataset: Path, theorems: list[Any]) -> None:
    (dataset / "random" / "train.json").write_text(json.dumps(theorems))


def test_synthetic_dataset_is_clean(demo_dir: Path) -> None:
    assert validate_dataset(demo_dir) == []


def test_problem_str() -> None:
    assert str(Problem("repo/corpus.jsonl:3", "bad")) == "repo/corpus.jsonl:3: bad"


def test_missing_dataset_dir(tmp_path: Path) -> None:
    assert "does not exist" in one(tmp_path / "nowhere")


def test_missing_corpus(demo_dir: Path) -> None:
    (demo_dir / "corpus.jsonl").unlink()
    assert one(demo_dir).startswith("repo_0/corpus.jsonl: missing")


def test_missing_split_folder(demo_dir: Path) -> None:
    shutil.rmtree(demo_dir / "random")
    assert one(demo_dir) == "repo_0/random: split folder is missing"


def test_missing_val_and_test(demo_dir: Path) -> None:
    (demo_dir / "random" / "val.json").unlink()
    (demo_dir / "random" / "test.json").unlink()
    assert messages(demo_dir) == ["repo_0/random/val.json: missing", "repo_0/random/test.json: missing"]


def test_malformed_corpus_line(demo_dir: Path) -> None:
    lines = (demo_dir / "corpus.jsonl").read_text().splitlines()
    lines[3] = lines[3][:-5]  # the last file, so no one imports it and nothing else breaks
    (demo_dir / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    found = messages(demo_dir)
    assert found[0].startswith("repo_0/corpus.jsonl:4: not valid JSON")


def test_what_an_unreadable_line_breaks_is_one_summary_after_it(tmp_path: Path) -> None:
    """A dependency file's line cut in half: its importers and the tactics that use its premises all point at it,
    and are counted in one line after the unreadable line itself, not listed one by one."""
    from leanagent.data.synthetic import write_demo_repos
    from leanagent.data.synthetic_scale import ScaleSpec

    repo = write_demo_repos(tmp_path, 1, seed=4, dependency=ScaleSpec(files=6, premises=60))[0]
    corpus = (repo / "corpus.jsonl").read_text().splitlines()
    imported = json.loads(corpus[-3])["imports"][1]  # the repository's first file imports the dependency's files
    k = next(i for i, line in enumerate(corpus) if json.loads(line)["path"] == imported)
    corpus[k] = corpus[k][: len(corpus[k]) // 2]
    (repo / "corpus.jsonl").write_text("\n".join(corpus) + "\n")
    found = messages(repo)
    assert found[0].startswith(f"repo_0/corpus.jsonl:{k + 1}: not valid JSON")
    assert len(found) == 2, found
    assert re.fullmatch(r"repo_0: [1-9]\d* import\(s\) in the corpus and [1-9]\d* premise annotation\(s\) of the "
                        r"splits refer to files not in the corpus, probably those on its unreadable line\(s\); fix "
                        r"those first", found[1]), found[1]


def test_corpus_missing_key(demo_dir: Path) -> None:
    records = read_jsonl(demo_dir / "corpus.jsonl")
    del records[3]["imports"]
    write_jsonl(demo_dir / "corpus.jsonl", records)
    assert messages(demo_dir)[0] == "repo_0/corpus.jsonl:4: missing key(s) imports"


def test_import_not_in_corpus(demo_dir: Path) -> None:
    records = read_jsonl(demo_dir / "corpus.jsonl")
    records[1]["imports"].append("Ghost/File.lean")
    write_jsonl(demo_dir / "corpus.jsonl", records)
    assert one(demo_dir) == "repo_0/corpus.jsonl:2: imports Ghost/File.lean which is not in the corpus"


def test_import_cycle(demo_dir: Path) -> None:
    records = read_jsonl(demo_dir / "corpus.jsonl")
    records[1]["imports"].append(records[2]["path"])  # Base imports Ext, which imports Base
    write_jsonl(demo_dir / "corpus.jsonl", records)
    base, ext = records[1]["path"], records[2]["path"]
    assert one(demo_dir) == f"repo_0/corpus.jsonl:2: import cycle: {base} -> {ext} -> {base}"


def test_premise_starts_after_it_ends(demo_dir: Path) -> None:
    records = read_jsonl(demo_dir / "corpus.jsonl")
    p = records[2]["premises"][1]
    p["start"], p["end"] = p["end"], p["start"]
    write_jsonl(demo_dir / "corpus.jsonl", records)
    found = messages(demo_dir)
    assert (
        f"repo_0/corpus.jsonl:3: premise {p['full_name']} starts at {p['start']} after it ends at {p['end']}" in found
    )


def test_duplicate_corpus_path(demo_dir: Path) -> None:
    records = read_jsonl(demo_dir / "corpus.jsonl")
    write_jsonl(demo_dir / "corpus.jsonl", [*records, records[1]])
    assert one(demo_dir) == f"repo_0/corpus.jsonl:5: duplicate path {records[1]['path']} (first at line 2)"


def test_malformed_split_json(demo_dir: Path) -> None:
    (demo_dir / "random" / "val.json").write_text('[\n {"full_name": "x",\n  }\n]')
    assert one(demo_dir).startswith("repo_0/random/val.json:3: not valid JSON")


def test_theorem_missing_key(demo_dir: Path) -> None:
    theorems = load_train(demo_dir)
    del theorems[2]["start"]
    save_train(demo_dir, theorems)
    assert one(demo_dir) == f"repo_0/random/train.json: theorem #2 ({theorems[2]['full_name']}): missing key(s) start"


def test_theorem_file_not_in_corpus(demo_dir: Path) -> None:
    theorems = load_train(demo_dir)
    theorems[0]["file_path"] = "Gone/Away.lean"
    save_train(demo_dir, theorems)
    name = theorems[0]["full_name"]
    assert one(demo_dir) == f"repo_0/random/train.json: theorem {name}: file Gone/Away.lean is not in the corpus"


def test_def_path_not_in_corpus(demo_dir: Path) -> None:
    theorems = load_train(demo_dir)
    thm = next(t for t in theorems if t["traced_tactics"])
    k, tactic = next((k, t) for k, t in enumerate(thm["traced_tactics"]) if t["annotated_tactic"][1])
    tactic["annotated_tactic"][1][0]["def_path"] = "Lost.lean"
    save_train(demo_dir, theorems)
    expected = (
        f"repo_0/random/train.json: theorem {thm['full_name']}, tactic {k}: def_path Lost.lean is not in the corpus"
    )
    assert one(demo_dir) == expected


def test_empty_train_split(demo_dir: Path) -> None:
    save_train(demo_dir, [])
    assert one(demo_dir) == (
        "repo_0/random/train.json: no training example: no tactic has a premise annotation found in the corpus"
    )


def test_reports_every_problem_at_once(demo_dir: Path) -> None:
    records = read_jsonl(demo_dir / "corpus.jsonl")
    records[1]["imports"].append("Ghost.lean")
    records[2]["imports"].append("Phantom.lean")
    write_jsonl(demo_dir / "corpus.jsonl", records)
    theorems = load_train(demo_dir)
    theorems[0]["file_path"] = "Gone.lean"
    del theorems[1]["end"]
    save_train(demo_dir, theorems)
    (demo_dir / "random" / "test.json").unlink()
    found = messages(demo_dir)
    assert len(found) == 5, found
    for needle in ("corpus.jsonl:2", "corpus.jsonl:3", "Gone.lean", "theorem #1", "test.json: missing"):
        assert any(needle in m for m in found), needle
