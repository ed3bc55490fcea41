"""`merge_all`: LeanAgent's merge rules, the LeanDojo files they write, and their record in the run manifest.

Three synthetic repositories are written per test (the `repos` fixture of conftest.py) and edited so that the rules
have something to decide: a theorem repeated by a later repository (in another split, with other tactics) and a
shared corpus path whose later copy differs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from data_helpers import CORE, load_json, run_state

from leanagent.data.example_files import write_example_files
from leanagent.data.merge import MERGE_FILE, digests, merge_datasets
from leanagent.data.validate import validate_dataset
from leanagent.ground.config import DataConfig
from leanagent.preflight.checks import PreflightError
from leanagent.run.manifest import ManifestMismatchError, RepoEntry, stage_name
from leanagent.run.state import RunState
from leanagent.run.strategy import MERGE, training_datasets


def test_merge_keeps_the_first_file_and_the_latest_theorem(repos: list[Path], tmp_path: Path) -> None:
    assert all(validate_dataset(r) == [] for r in repos)
    out = tmp_path / "merged"
    info = merge_datasets(repos, out)
    corpus = [json.loads(line) for line in (out / "corpus.jsonl").read_text().splitlines()]
    paths = [r["path"] for r in corpus]
    assert paths == [CORE] + [p for r in repos for p in
                              [json.loads(x)["path"] for x in (r / "corpus.jsonl").read_text().splitlines()][1:]]
    # The first copy of the shared file, byte for byte; the differing later copy is dropped and named.
    assert (out / "corpus.jsonl").read_text().splitlines()[0] == (repos[0] / "corpus.jsonl").read_text().splitlines()[0]
    assert info["corpus_conflicts"] == 1 and info["conflicting_paths"] == [CORE]
    # The repeated theorem: one copy, repo_1's (the most recently processed), in repo_1's split (train).
    theorem = load_json(repos[0] / "random" / "val.json")[0]
    key = (theorem["file_path"], theorem["full_name"], theorem["start"], theorem["end"])
    merged = {s: load_json(out / "random" / f"{s}.json") for s in ("train", "val", "test")}
    copies = [(s, t) for s, ts in merged.items() for t in ts
              if (t["file_path"], t["full_name"], t["start"], t["end"]) == key]
    assert len(copies) == 1 and copies[0][0] == "train" and len(copies[0][1]["traced_tactics"]) == 1
    assert info["duplicate_theorems"] == 1
    for s in ("train", "val", "test"):
        total = sum(len(load_json(r / "random" / f"{s}.json")) for r in repos)
        assert len(merged[s]) == total + {"train": 0, "val": -1, "test": 0}[s] == info["theorems"][s]
    # A LeanDojo dataset: it validates and `leanagent examples` reads it; merge.json has every file's digest.
    assert validate_dataset(out) == []
    assert write_example_files(out, tmp_path / "examples", DataConfig(), seed=0)["train"] > 0
    assert json.loads((out / MERGE_FILE).read_text())["outputs"] == digests(out, "random") == info["outputs"]
    assert info["inputs"] == {str(r): digests(r, "random") for r in repos}
    with pytest.raises(FileExistsError):
        merge_datasets(repos, out)


def _mtimes(folder: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in sorted(folder.rglob("*")) if p.is_file()}


def test_single_trains_each_repository_on_itself(repos: list[Path], tmp_path: Path) -> None:
    cfg, state = run_state(tmp_path, repos, "single")
    assert training_datasets(cfg, [r.name for r in repos], repos, state, log=lambda _: None) == repos
    assert not (cfg.run_dir / "merged").exists()


def test_merge_all_is_written_once_recorded_and_reused(repos: list[Path], tmp_path: Path) -> None:
    cfg, state = run_state(tmp_path, repos, "merge_all")
    names = [r.name for r in repos]
    lines: list[str] = []
    datasets = training_datasets(cfg, names, repos, state, log=lines.append)
    assert datasets == [cfg.run_dir / "merged" / f"{i:02d}-{n}" for i, n in enumerate(names)]
    assert load_json(datasets[0] / "random" / "test.json") == load_json(repos[0] / "random" / "test.json")
    assert json.loads((datasets[2] / MERGE_FILE).read_text())["sources"] == [str(r) for r in repos]
    manifest = json.loads(state.path.read_text())
    recorded = manifest["repos"]["01-repo_1"]["stages"][MERGE]
    assert recorded["status"] == "done" and recorded["result"]["dataset"] == str(datasets[1])
    assert recorded["result"]["sources"] == [str(r) for r in repos[:2]]
    assert sum("merged" in line for line in lines) == 3
    # A rerun (a new RunState on the same manifest) reuses every merge without writing anything.
    before = _mtimes(cfg.run_dir / "merged")
    again: list[str] = []
    rerun = RunState(cfg.run_dir, cfg)
    assert training_datasets(cfg, names, repos, rerun, log=again.append) == datasets
    assert _mtimes(cfg.run_dir / "merged") == before and all("reused" in line for line in again)


def test_a_continued_run_merges_its_new_repository_with_every_earlier_one(repos: list[Path], tmp_path: Path) -> None:
    """A run of two repositories continued with a third: the two merges are reused, the third merges all three."""
    cfg, state = run_state(tmp_path, repos[:2], "merge_all")
    names = [r.name for r in repos]
    first = training_datasets(cfg, names[:2], repos[:2], state, log=lambda _: None)
    before = _mtimes(cfg.run_dir / "merged")
    entries = [RepoEntry(r.name, r) for r in repos]
    rerun = RunState(cfg.run_dir, cfg)
    rerun.extend(entries, entries)
    lines: list[str] = []
    datasets = training_datasets(cfg, names, repos, rerun, log=lines.append)
    assert datasets[:2] == first and {k: v for k, v in _mtimes(cfg.run_dir / "merged").items() if k in before} == before
    assert json.loads((datasets[2] / MERGE_FILE).read_text())["sources"] == [str(r) for r in repos]
    assert [("reused" in line, "merged 3 repositories" in line) for line in lines] == [(True, False), (True, False),
                                                                                       (False, True)]


def test_a_changed_input_refuses_the_rerun(repos: list[Path], tmp_path: Path) -> None:
    cfg, state = run_state(tmp_path, repos, "merge_all")
    names = [r.name for r in repos]
    training_datasets(cfg, names, repos, state, log=lambda _: None)
    manifest = state.path.read_text()
    edited = repos[1] / "random" / "val.json"
    edited.write_text(json.dumps(load_json(edited)[1:]))
    with pytest.raises(ManifestMismatchError, match=rf"01-repo_1/merge merged {edited} \(sha256 [0-9a-f]{{12}}\), "
                                                    r"which is now sha256 [0-9a-f]{12}"):
        training_datasets(cfg, names, repos, RunState(cfg.run_dir, cfg), log=lambda _: None)
    assert state.path.read_text() == manifest  # nothing recorded or rewritten


def test_an_edited_merged_dataset_refuses_the_rerun(repos: list[Path], tmp_path: Path) -> None:
    cfg, state = run_state(tmp_path, repos, "merge_all")
    names = [r.name for r in repos]
    datasets = training_datasets(cfg, names, repos, state, log=lambda _: None)
    (datasets[2] / "random" / "train.json").write_text("[]")
    with pytest.raises(ManifestMismatchError, match=r"02-repo_2/merge's merged dataset .*train.json changed"):
        training_datasets(cfg, names, repos, RunState(cfg.run_dir, cfg), log=lambda _: None)


def test_a_merge_written_before_a_crash_is_taken_a_foreign_folder_refused(repos: list[Path], tmp_path: Path) -> None:
    cfg, state = run_state(tmp_path, repos, "merge_all")
    names = [r.name for r in repos]
    out = cfg.run_dir / "merged" / "01-repo_1"
    merge_datasets(repos[:2], out)  # finished, but the manifest never heard of it
    lines: list[str] = []
    assert training_datasets(cfg, names, repos, state, log=lines.append)[1] == out
    assert any("found complete, not yet recorded; taken" in line for line in lines)
    assert state.stage_done(stage_name(1, "repo_1", MERGE)).dataset == str(out)
    # Someone else's folder under that name is never overwritten.
    cfg2, state2 = run_state(tmp_path / "other", repos, "merge_all")
    foreign = cfg2.run_dir / "merged" / "00-repo_0"
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(PreflightError, match=r"00-repo_0: exists but is not a merge .* move it away"):
        training_datasets(cfg2, names, repos, state2, log=lambda _: None)
    assert (foreign / "notes.txt").read_text() == "mine"


def _rewrite_splits(repo: Path, edit) -> None:
    for name in ("train", "val", "test"):
        path = repo / "random" / f"{name}.json"
        path.write_text(json.dumps([edit(t) for t in load_json(path)]))


def test_a_merge_that_does_not_validate_is_refused_before_training(repos: list[Path], tmp_path: Path) -> None:
    """Two packages both provide Core/Basic.lean: each repository alone resolves its annotations' short def_path,
    the merge cannot tell which file they mean."""
    renamed = ".lake/packages/core0/Core/Basic.lean"
    (repos[0] / "corpus.jsonl").write_text((repos[0] / "corpus.jsonl").read_text().replace(CORE, renamed))
    _rewrite_splits(repos[0], lambda t: json.loads(json.dumps(t).replace(CORE, renamed)))

    def shorten(theorem: dict) -> dict:
        for tactic in theorem["traced_tactics"]:
            for a in (tactic.get("annotated_tactic") or ["", []])[1]:
                if a["def_path"] == CORE:
                    a["def_path"] = "Core/Basic.lean"
        return theorem

    _rewrite_splits(repos[1], shorten)
    assert validate_dataset(repos[0]) == [] and validate_dataset(repos[1]) == []
    cfg, state = run_state(tmp_path, repos, "merge_all")
    with pytest.raises(PreflightError, match=r"01-repo_1/merge: the merged dataset .* problem\(s\)") as refused:
        training_datasets(cfg, [r.name for r in repos], repos, state, log=lambda _: None)
    assert "def_path Core/Basic.lean is not in the corpus" in str(refused.value)
    assert state.stage_done(stage_name(0, "repo_0", MERGE)) is not None  # the first merge is fine and recorded
    assert json.loads(state.path.read_text())["repos"]["01-repo_1"]["stages"][MERGE]["status"] == "failed"
