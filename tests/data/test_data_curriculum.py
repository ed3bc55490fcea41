"""LeanAgent's curriculum on sets small enough to compute by hand, on real LeanDojo files, and via the CLI.

numpy's default ("linear") percentile of sorted values v_0..v_{n-1} at q is taken at rank
r = q/100 * (n - 1): v_i + t * (v_{i+1} - v_i) with i = floor(r), t = r - i (for t >= 0.5 numpy
computes it as v_{i+1} - (1 - t) * (v_{i+1} - v_i), which is nan when v_{i+1} is inf).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from data_helpers import shared_data_dir

from leanagent.cli import main
from leanagent.data.curriculum import (
    Curriculum,
    RepoDifficulty,
    build_curriculum,
    curriculum_of_datasets,
    difficulty,
    load_repo_theorems,
)
from leanagent.data.theorems import Tactic, Theorem

E = math.e


def thm(n: int, sorry: bool = False) -> Theorem:
    tactics = [Tactic("simp", "⊢ p", "no goals", None) for _ in range(n)]
    if sorry:
        tactics.append(Tactic("exact sorry", "⊢ p", "no goals", None))  # "sorry" anywhere in the tactic counts
    return Theorem("t", "F.lean", (1, 1), (2, 1), "", "", tactics, None, "random/train.json")


def repo(*tactic_counts: int, sorry: int = 0) -> list[Theorem]:
    return [thm(n) for n in tactic_counts] + [thm(1, sorry=True) for _ in range(sorry)]


def test_difficulty() -> None:
    assert difficulty(thm(2)) == math.exp(2)
    assert difficulty(thm(0)) is None
    assert difficulty(thm(1, sorry=True)) == math.inf
    assert difficulty(thm(0, sorry=True)) == math.inf  # a lone `sorry` is one tactic, and it is a sorry
    # e^710 overflows a float (the reference crashes there): rated, finite, larger than any other rating.
    assert difficulty(thm(709)) == math.exp(709)
    assert difficulty(thm(800)) == sys.float_info.max


def test_a_tie_at_the_33rd_percentile_is_easy() -> None:
    # Four of six theorems have one-step proofs. Sorted: e, e, e, e, e^2, e^3.
    #   p33: rank 1.65, between e and e  -> exactly e, so the four one-step proofs are Easy (<=, not <).
    #   p67: rank 3.35, between e and e^2 -> e + 0.35 * (e^2 - e) = 4.353; e^2 and e^3 are Hard.
    result = build_curriculum({"r": repo(1, 1, 2, 1, 3, 1)})
    assert result.percentiles == (E, pytest.approx(E + 0.35 * (E**2 - E)))
    assert result.percentiles[0] == math.exp(1)
    assert result.counts["r"] == RepoDifficulty("r", easy=4, medium=0, hard=2, hard_no_proof=0)


def test_sorry_and_tactic_less_theorems_and_the_remainder() -> None:
    # Rated, all repositories together, inf included: e, e, e^2, e^2, e^3, e^4, inf (n = 7).
    #   p33: rank 1.98 -> e^2 - 0.02 * (e^2 - e)   = 7.2955
    #   p67: rank 4.02 -> e^3 + 0.02 * (e^4 - e^3) = 20.7758
    # So e is Easy, e^2 and e^3 Medium, e^4 Hard, the sorry theorem "hard, no proof". (Without inf
    # in the list p67 would be 11.83 and e^3 Hard: the reference includes it, so do we.)
    # r2's five tactic-less theorems: 5 // 3 = 1 to Easy, 1 to Medium, the remaining 3 to Hard.
    repos = {
        "r2": repo(3, 0, 0, 0, 0, 0, sorry=1),
        "r1": repo(1, 1, 2),
        "r3": repo(2, 4),
    }
    result = build_curriculum(repos)
    p33, p67 = result.percentiles
    assert p33 == pytest.approx(E**2 - 0.02 * (E**2 - E))
    assert p67 == pytest.approx(E**3 + 0.02 * (E**4 - E**3))
    assert result.counts == {
        "r2": RepoDifficulty("r2", easy=1, medium=2, hard=3, hard_no_proof=1),
        "r1": RepoDifficulty("r1", easy=2, medium=1, hard=0, hard_no_proof=0),
        "r3": RepoDifficulty("r3", easy=0, medium=1, hard=1, hard_no_proof=0),
    }
    assert result.order == ["r1", "r2", "r3"]
    assert result.to_json() == {
        "order": ["r1", "r2", "r3"],
        "counts": {"r1": {"easy": 2, "medium": 1, "hard": 0, "hard_no_proof": 0},
                   "r2": {"easy": 1, "medium": 2, "hard": 3, "hard_no_proof": 1},
                   "r3": {"easy": 0, "medium": 1, "hard": 1, "hard_no_proof": 0}},
        "percentiles": [p33, p67],
    }
    # The thin wrappers are the same code path.


def test_ties_keep_the_given_order() -> None:
    # Sorted: e, e, e^2, e^2, e^5, e^5: p33 (rank 1.65) = e^2 - 0.35 * (e^2 - e) = 5.75, so each repository
    # has exactly one Easy theorem (its one-step proof).
    a, b, c = repo(1, 2, 5), repo(1, 2, 5), repo(5, 1, 2)
    assert build_curriculum({"a": a, "b": b}).order == ["a", "b"]
    assert build_curriculum({"b": b, "a": a}).order == ["b", "a"]
    # 1 Easy each; tactic-less theorems: 3 // 3 = 1 more Easy for c, which moves ahead.
    assert build_curriculum({"a": a, "b": b, "c": c + repo(0, 0, 0)}).order == ["c", "a", "b"]
    assert build_curriculum({"a": a, "b": b, "c": c}).counts["c"].easy == 1


def test_kept_repositories_keep_their_places_and_the_percentiles_count_every_repository() -> None:
    """A continued run: `a` and `b` are in it; `c` (1 Easy) and `d` (3 Easy) are new, ordered among themselves."""
    a, b, c, d = repo(5, 5, 5), repo(1, 5, 5), repo(1, 5, 5), repo(1, 1, 1)
    fresh = build_curriculum({"a": a, "b": b, "c": c, "d": d})
    assert fresh.order == ["d", "b", "c", "a"] and fresh.kept == 0
    kept = build_curriculum({"a": a, "b": b, "c": c, "d": d}, kept=["a", "b"])
    assert kept.order == ["a", "b", "d", "c"] and kept.kept == 2
    # One meaning of "easy" within the run: the percentiles of all four, kept and new.
    assert kept.percentiles == fresh.percentiles and kept.counts == fresh.counts
    assert build_curriculum({"a": a, "b": b}).percentiles != fresh.percentiles


def test_percentile_between_two_infinities_is_nan_as_in_the_reference() -> None:
    # Sorted: e, inf, inf. numpy interpolates inf - inf = nan: nothing compares <= nan, so e is Hard.
    result = build_curriculum({"r": repo(1, sorry=2)})
    assert all(math.isnan(p) for p in result.percentiles)
    assert result.counts["r"] == RepoDifficulty("r", easy=0, medium=0, hard=1, hard_no_proof=2)


def test_only_tactic_less_and_empty_repositories_do_not_crash() -> None:
    # numpy.percentile([]) raises in the reference; with nothing rated there are no percentiles.
    result = build_curriculum({"empty": [], "r": repo(0, 0, 0, 0)})
    assert result.percentiles is None
    assert result.counts["r"] == RepoDifficulty("r", easy=1, medium=1, hard=2, hard_no_proof=0)
    # A repository without theorems stays in the order (the reference would drop it), with 0 everywhere.
    assert result.counts["empty"] == RepoDifficulty("empty", 0, 0, 0, 0)
    assert result.order == ["r", "empty"]


def test_more_than_709_tactics_is_hard_not_unproved() -> None:
    # Sorted: e, e, e, MAX. p33 (rank 0.99) = e; p67 (rank 2.01) = e + 0.01 * (MAX - e), finite, below MAX.
    result = build_curriculum({"r": repo(1, 1, 800, 1)})
    assert math.isfinite(result.percentiles[1]) and result.percentiles[1] < sys.float_info.max
    assert result.counts["r"] == RepoDifficulty("r", easy=3, medium=0, hard=1, hard_no_proof=0)


# ---- real LeanDojo split files -------------------------------------------------------------

def _real_datasets() -> dict[str, Path]:
    root = shared_data_dir()
    if root is None:
        pytest.skip("no shared/data folder beside the repository")
    found = {d.name: d for d in sorted(root.iterdir()) if (d / "random").is_dir()}
    if not found:
        pytest.skip(f"{root}: no dataset with a random/ split")
    return found


def _reference_by_hand(datasets: dict[str, Path]) -> Curriculum:
    """An independent re-statement of LeanAgent's rules, straight from the raw JSON files."""
    ratings: dict[str, list[float | None]] = {}
    for name, path in datasets.items():
        ratings[name] = []
        for split in ("train", "val", "test"):
            f = path / "random" / f"{split}.json"
            for raw in json.loads(f.read_text()) if f.is_file() else []:
                tactics = [t["tactic"] for t in raw["traced_tactics"]]
                ratings[name].append(math.inf if any("sorry" in t for t in tactics)
                                     else None if not tactics else math.exp(len(tactics)))
    rated = [r for rs in ratings.values() for r in rs if r is not None]
    p33, p67 = np.percentile(rated, [33, 67])
    counts = {}
    for name, rs in ratings.items():
        c = {"easy": 0, "medium": 0, "hard": 0, "hard_no_proof": 0}
        todo = 0
        for r in rs:
            if r is None:
                todo += 1
            elif r == math.inf:
                c["hard_no_proof"] += 1
            elif r <= p33:
                c["easy"] += 1
            elif r <= p67:
                c["medium"] += 1
            else:
                c["hard"] += 1
        c["easy"] += todo // 3
        c["medium"] += todo // 3
        c["hard"] += todo - 2 * (todo // 3)
        counts[name] = RepoDifficulty(name, **c)
    order = sorted(counts, key=lambda n: -counts[n].easy)
    return Curriculum(order, counts, (float(p33), float(p67)))


def test_real_leandojo_split_files() -> None:
    datasets = _real_datasets()
    result = curriculum_of_datasets(datasets)
    assert result == _reference_by_hand(datasets)
    for name, path in datasets.items():
        c = result.counts[name]
        assert c.easy + c.medium + c.hard + c.hard_no_proof == len(load_repo_theorems(path)) > 0
    p33, p67 = result.percentiles
    assert 0 < p33 <= p67


# ---- leanagent curriculum --------------------------------------------------------------------

def _cli(*argv: str) -> int:
    """`leanagent curriculum ...` in this process: its exit code (what it printed is captured by capsys)."""
    with pytest.raises(SystemExit) as stop:
        main(["curriculum", *argv])
    return stop.value.code


def test_cli_json_is_the_flows_curriculum(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from leanagent.data.synthetic import write_demo_repos

    dirs = write_demo_repos(tmp_path / "data", 3, seed=0)
    out = tmp_path / "curriculum.json"
    assert _cli(*map(str, dirs), "--json", str(out)) == 0
    written = json.loads(out.read_text())
    expected = curriculum_of_datasets({d.name: d for d in dirs})
    assert written == expected.to_json()
    assert sorted(written["order"]) == sorted(d.name for d in dirs)
    printed = capsys.readouterr().out
    assert f"order: {', '.join(expected.order)}" in printed
    p33, p67 = expected.percentiles
    assert f"p33 = {p33:.6g} (3 tactics), p67 = {p67:.6g} (4 tactics)" in printed
    for name in expected.order:
        c = expected.counts[name]
        assert (f"{name}: easy {c.easy}, medium {c.medium}, hard {c.hard}, hard (no proof) {c.hard_no_proof}"
                in printed)


def test_cli_on_real_files(tmp_path: Path) -> None:
    datasets = _real_datasets()
    out = tmp_path / "c.json"
    assert _cli(*map(str, datasets.values()), "--split", "random", "--json", str(out)) == 0
    assert json.loads(out.read_text()) == curriculum_of_datasets(datasets).to_json()


def test_cli_refuses_a_missing_split_and_twin_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a" / "x" / "random").mkdir(parents=True)
    (tmp_path / "b" / "x" / "random").mkdir(parents=True)
    assert _cli(str(tmp_path / "a" / "x"), "--split", "novel_premises") == 1
    assert "no split folder 'novel_premises'" in capsys.readouterr().err
    assert _cli(str(tmp_path / "a" / "x"), str(tmp_path / "b" / "x")) == 1
    assert "both named 'x'" in capsys.readouterr().err
