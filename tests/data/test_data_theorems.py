"""Split files: the real LeanDojo samples in shared/data and the parser's error messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from data_helpers import shared_data_dir

from leanagent.data.corpus import Corpus, keep_premise
from leanagent.data.dataset import build_eval_examples
from leanagent.data.errors import DatasetError
from leanagent.data.theorems import Tactic, has_sorry, load_split, strip_goal_count

SHARED = shared_data_dir()
needs_shared = pytest.mark.skipif(SHARED is None, reason="shared/data with the real samples is not beside the repo")


def _split_files() -> list[Path]:
    return sorted(p for p in SHARED.glob("*/*/*.json")) if SHARED else []


@needs_shared
@pytest.mark.parametrize("path", _split_files(), ids=lambda p: f"{p.parent.parent.name}/{p.parent.name}/{p.name}")
def test_every_real_split_loads(path: Path) -> None:
    theorems = load_split(path)
    assert theorems and all(t.source == f"{path.parent.name}/{path.name}" for t in theorems)


@needs_shared
@pytest.mark.parametrize(
    ("name", "theorems", "with_tactics", "tactics"),
    [("val", 2000, 950, 2949), ("test", 2000, 923, 2946)],
)
def test_minif2f_counts(name: str, theorems: int, with_tactics: int, tactics: int) -> None:
    loaded = load_split(SHARED / "minif2f-lean4-ld182" / "random" / f"{name}.json")
    assert len(loaded) == theorems
    assert sum(bool(t.tactics) for t in loaded) == with_tactics
    assert sum(len(t.tactics) for t in loaded) == tactics
    assert all(t.theorem_statement is None for t in loaded)


@needs_shared
def test_minif2f_annotations_join_a_traced_root_corpus() -> None:
    """Theorem paths are repo-relative, def_paths are traced-root-relative: the join must map them."""
    loaded = load_split(SHARED / "minif2f-lean4-ld182" / "random" / "val.json")
    assert sum(len(t.annotations or []) for th in loaded for t in th.tactics) == 4345
    packages = {"mathlib4": ".lake/packages/mathlib/", "std4": ".lake/packages/std/", "miniF2F-lean4": ""}
    files: dict[str, dict[str, tuple[int, int]]] = {}
    for th in loaded:
        files.setdefault(packages[th.url.rsplit("/", 1)[1]] + th.file_path, {})
        for t in th.tactics:
            for a in t.annotations or []:
                files.setdefault(a.def_path, {})[a.full_name] = a.def_pos
    records = [
        {
            "path": path,
            "imports": [],
            "premises": [{"full_name": n, "code": n, "start": list(p), "end": list(p)} for n, p in names.items()],
        }
        for path, names in files.items()
    ]
    corpus = Corpus.from_records(records)
    expected = sum(
        any(keep_premise(a.full_name, "x") for a in t.annotations or []) for th in loaded for t in th.tactics
    )
    assert len(build_eval_examples(corpus, loaded)) == expected > 0


@needs_shared
def test_no_annotation_variant() -> None:
    loaded = load_split(SHARED / "lb4-mathlib-noannot-sample" / "random" / "test.json")
    assert len(loaded) == 100
    tactics = [t for th in loaded for t in th.tactics]
    assert len(tactics) == 469
    assert all(t.annotations is None for t in tactics)


@needs_shared
@pytest.mark.parametrize(("split", "counts"), [("random", (12, 4, 4)), ("novel_premises", (8, 4, 8))])
def test_ldv2_variant(split: str, counts: tuple[int, int, int]) -> None:
    folder = SHARED / "lean4-example-ldv2" / split
    loaded = [load_split(folder / f"{n}.json") for n in ("train", "val", "test")]
    assert tuple(len(x) for x in loaded) == counts
    thm = loaded[0][0]
    assert thm.theorem_statement and thm.theorem_statement.startswith("theorem ")
    assert thm.url.startswith("/root/.cache/lean_dojo/")
    if split == "random":
        annotations = [sum(len(t.annotations or []) for th in part for t in th.tactics) for part in loaded]
        assert annotations == [15, 3, 8]


def test_strip_goal_count() -> None:
    # As LeanDojo's format_state: a leading "N goals" is dropped and the rest stripped; anything else is kept.
    assert strip_goal_count("2 goals\nx : Nat\n⊢ p\n\n⊢ q") == "x : Nat\n⊢ p\n\n⊢ q"
    assert strip_goal_count("12 goals \n ⊢ p \n") == "⊢ p"
    assert strip_goal_count("1 goal\n⊢ p") == "1 goal\n⊢ p"  # LeanDojo never writes it; the reference keeps it
    assert strip_goal_count("x : Nat\n⊢ 2 goals\n") == "x : Nat\n⊢ 2 goals\n"
    assert strip_goal_count(" ⊢ p\n") == " ⊢ p\n"  # no header: not stripped either


def test_has_sorry() -> None:
    from leanagent.data.theorems import Theorem

    def thm(tactics: list[str]) -> Theorem:
        return Theorem("t", "F.lean", (1, 1), (2, 1), "", "", [Tactic(t, "⊢ p", "", None) for t in tactics], None, "s")

    assert has_sorry(thm(["intro x", "sorry"]))
    assert not has_sorry(thm(["simp"]))


def test_split_errors_name_file_line_and_theorem(tmp_path: Path) -> None:
    folder = tmp_path / "random"
    folder.mkdir()
    bad = folder / "train.json"
    bad.write_text('[\n  {"full_name": "x",\n  oops\n]')
    with pytest.raises(DatasetError, match=r"random/train\.json:3"):
        load_split(bad)
    bad.write_text(json.dumps([{"full_name": "Foo.bar", "file_path": "F.lean", "start": [1, 1], "traced_tactics": []}]))
    with pytest.raises(DatasetError, match=r"random/train\.json: theorem #0 \(Foo\.bar\): missing key\(s\) end"):
        load_split(bad)
    with pytest.raises(DatasetError, match="no such file"):
        load_split(folder / "val.json")
