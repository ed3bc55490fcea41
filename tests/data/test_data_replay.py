"""`replay`: stage i trains on repository i plus a drawn share of each earlier repository's training theorems,
under `merge_all`'s rules; at a share of 1 on exactly what `merge_all` trains on.

The repositories are conftest.py's `repos` (a theorem repeated across repositories, a corpus file whose later copy
differs), so that the merge rules have something to decide.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import get_args

import pytest
import torch
from data_helpers import load_json, run_state

from leanagent.data.example_files import write_example_files
from leanagent.data.merge import MERGE_FILE, digests, merge_datasets
from leanagent.data.replay import Draw, drawn, kept_count, replay_key
from leanagent.data.strategies import DATASET_STRATEGIES, merges
from leanagent.ground.config import DataConfig, LifelongConfig
from leanagent.ground.names import PART_FILES
from leanagent.preflight.checks import PreflightError
from leanagent.run.fingerprint import check_experiment
from leanagent.run.manifest import ManifestMismatchError, RepoEntry, read_manifest
from leanagent.run.state import RunState
from leanagent.run.strategy import MERGE, training_datasets
from tests.stage_results import finished


def _key(theorem: dict) -> tuple:
    return theorem["file_path"], theorem["full_name"], tuple(theorem["start"]), tuple(theorem["end"])


def test_the_draw_depends_on_its_key_alone_and_a_smaller_share_is_part_of_a_larger() -> None:
    assert [kept_count(n, f) for n, f in ((3, 0.5), (4, 0.1), (10, 0.25), (7, 1.0), (0, 0.5))] == [2, 0, 3, 7, 0]
    key = replay_key(3407, 2, {"corpus.jsonl": "a"}, {"corpus.jsonl": "b"})
    assert drawn(40, Draw(1.0, key)) == list(range(40))
    half, tenth = drawn(40, Draw(0.5, key)), drawn(40, Draw(0.1, key))
    assert len(half) == 20 and len(tenth) == 4 and set(tenth) <= set(half) and half == sorted(half)
    random.seed(1)  # other random streams do not enter
    torch.manual_seed(1)
    assert drawn(40, Draw(0.5, key)) == half
    # Each input of the key changes the sample: the seed, the stage, either repository's content.
    others = [replay_key(0, 2, {"corpus.jsonl": "a"}, {"corpus.jsonl": "b"}),
              replay_key(3407, 3, {"corpus.jsonl": "a"}, {"corpus.jsonl": "b"}),
              replay_key(3407, 2, {"corpus.jsonl": "c"}, {"corpus.jsonl": "b"}),
              replay_key(3407, 2, {"corpus.jsonl": "a"}, {"corpus.jsonl": "c"})]
    assert all(drawn(40, Draw(0.5, other)) != half for other in others)


def test_the_strategies_are_a_table_the_config_names() -> None:
    assert set(get_args(LifelongConfig.model_fields["dataset_strategy"].annotation)) == set(DATASET_STRATEGIES)
    assert [merges(name) for name in (None, "single", "merge_all", "replay")] == [False, False, True, True]
    replay = LifelongConfig(dataset_strategy="replay", replay_fraction=0.25)
    assert DATASET_STRATEGIES["replay"].parts(2, replay) == ((0, 0.25), (1, 0.25), (2, None))
    assert DATASET_STRATEGIES["merge_all"].parts(2, LifelongConfig()) == ((0, None), (1, None), (2, None))


def _examples(dataset: Path, out: Path) -> dict[str, str]:
    """What the retriever is fed from `dataset` (`leanagent examples`: the functions training uses), file by file."""
    write_example_files(dataset, out, DataConfig(), seed=3407)
    return {p.name: p.read_text() for p in sorted(out.iterdir())}


def test_replay_at_one_trains_on_exactly_the_examples_merge_all_trains_on(repos: list[Path], tmp_path: Path) -> None:
    names = [r.name for r in repos]
    merge_cfg, merge_state = run_state(tmp_path / "merge_all", repos, "merge_all")
    replay_cfg, replay_state = run_state(tmp_path / "replay", repos, "replay", replay_fraction=1.0)
    merged = training_datasets(merge_cfg, names, repos, merge_state, log=lambda _: None)
    replayed = training_datasets(replay_cfg, names, repos, replay_state, log=lambda _: None)
    for i, (m, r) in enumerate(zip(merged, replayed, strict=True)):
        assert digests(r, "random") == digests(m, "random")  # the dataset, byte for byte
        examples = _examples(r, tmp_path / "examples" / "replay" / str(i))
        assert examples == _examples(m, tmp_path / "examples" / "merge_all" / str(i))
        assert len(examples["train.jsonl"].splitlines()) > 0
        # The draw is recorded even when it keeps everything: each earlier repository, all of its theorems.
        record = replay_state.stage_done(f"{i:02d}-{names[i]}/{MERGE}")
        assert {Path(s).name: (d.kept, d.of) for s, d in record.replay.items()} == {
            n: (len(load_json(p / "random" / "train.json")),) * 2 for n, p in zip(names[:i], repos[:i], strict=True)}


def test_replay_trains_on_its_repository_and_a_share_of_each_earlier_one_drawn_once_per_stage(
        repos: list[Path], tmp_path: Path) -> None:
    names = [r.name for r in repos]
    cfg, state = run_state(tmp_path, repos, "replay", replay_fraction=0.5)
    lines: list[str] = []
    datasets = training_datasets(cfg, names, repos, state, log=lines.append)
    assert datasets == [cfg.run_dir / "merged" / f"{i:02d}-{n}" for i, n in enumerate(names)]
    # Stage 0 has nothing earlier: repository 0 itself, as merge_all's first stage.
    assert load_json(datasets[0] / "random" / "train.json") == load_json(repos[0] / "random" / "train.json")
    samples: dict[tuple[int, str], list[int]] = {}
    for i in (1, 2):
        info = load_json(datasets[i] / MERGE_FILE)
        record = state.stage_done(f"{i:02d}-{names[i]}/{MERGE}")
        # Expected: LeanAgent's rules over the drawn training theorems of 0..i-1, all of i, every val and test theorem.
        chosen: dict[tuple, str] = {}
        for j, repo in enumerate(repos[: i + 1]):
            for part in PART_FILES:
                theorems = load_json(repo / "random" / part)
                positions = range(len(theorems))
                if part == "train.json" and j < i:
                    draw = info["replay"][str(repo)]
                    key = replay_key(cfg.trainer.seed, i, digests(repos[i], "random"), digests(repo, "random"))
                    assert (draw["fraction"], draw["key"]) == (0.5, key)
                    positions = drawn(len(theorems), Draw(0.5, key))
                    assert draw["positions"] == positions and (draw["kept"], draw["of"]) == (
                        kept_count(len(theorems), 0.5), len(theorems))
                    # The manifest records the draw without its positions (merge.json has them).
                    recorded = record.replay[str(repo)].model_dump(exclude_none=True)
                    assert recorded == {k: v for k, v in draw.items() if k != "positions"}
                    samples[(i, repo.name)] = positions
                for k in positions:
                    chosen[_key(theorems[k])] = part
        for part in PART_FILES:
            assert sorted(_key(t) for t in load_json(datasets[i] / "random" / part)) == sorted(
                k for k, p in chosen.items() if p == part), (i, part)
        assert (datasets[i] / "corpus.jsonl").read_bytes() == _merged_corpus(repos[: i + 1], tmp_path / f"c{i}")
    # Each stage draws its own sample of repo_0 (stage 1's and stage 2's differ); the log says what was drawn.
    assert samples[(1, "repo_0")] != samples[(2, "repo_0")]
    counts = [len(load_json(r / "random" / "train.json")) for r in repos[:2]]
    said = ", ".join(f"{kept_count(n, 0.5)}/{n} of {r.name}" for n, r in zip(counts, repos, strict=False))
    assert any(f"training theorems replayed: {said}" in line for line in lines), lines


def _merged_corpus(repos: list[Path], out: Path) -> bytes:
    """merge_all's corpus of `repos`: replay's corpus is the same whatever it draws."""
    merge_datasets(repos, out)
    return (out / "corpus.jsonl").read_bytes()


def test_a_resumed_and_a_continued_run_draw_the_same_sample(repos: list[Path], tmp_path: Path) -> None:
    """A run of two repositories continued with a third draws for the third what a run of all three draws, whatever
    else drew random numbers in between; a rerun reuses every recorded sample without writing."""
    names = [r.name for r in repos]
    fresh_cfg, fresh_state = run_state(tmp_path / "fresh", repos, "replay", replay_fraction=0.3)
    fresh = training_datasets(fresh_cfg, names, repos, fresh_state, log=lambda _: None)
    cfg, state = run_state(tmp_path / "continued", repos[:2], "replay", replay_fraction=0.3)
    random.seed(99)
    torch.manual_seed(99)
    training_datasets(cfg, names[:2], repos[:2], state, log=lambda _: None)
    entries = [RepoEntry(r.name, r) for r in repos]
    rerun = RunState(cfg.run_dir, cfg)
    rerun.extend(entries, entries)
    continued = training_datasets(cfg, names, repos, rerun, log=lambda _: None)
    for a, b in zip(fresh, continued, strict=True):
        assert digests(a, "random") == digests(b, "random")
    before = {p: p.stat().st_mtime_ns for p in (cfg.run_dir / "merged").rglob("*") if p.is_file()}
    lines: list[str] = []
    assert training_datasets(cfg, names, repos, RunState(cfg.run_dir, cfg), log=lines.append) == continued
    assert {p: p.stat().st_mtime_ns for p in (cfg.run_dir / "merged").rglob("*") if p.is_file()} == before
    assert all("reused" in line for line in lines)
    # Another seed is another experiment, and draws another sample.
    other_cfg, other_state = run_state(tmp_path / "seed", repos, "replay", replay_fraction=0.3, seed=1)
    other = training_datasets(other_cfg, names, repos, other_state, log=lambda _: None)
    assert load_json(other[2] / "random" / "train.json") != load_json(fresh[2] / "random" / "train.json")


def test_a_merge_found_on_disk_with_other_draws_is_not_taken(repos: list[Path], tmp_path: Path) -> None:
    """A merge written just before a crash is taken only if it drew what this run draws."""
    names = [r.name for r in repos]
    cfg, state = run_state(tmp_path, repos, "replay", replay_fraction=0.5)
    out = cfg.run_dir / "merged" / "01-repo_1"
    merge_datasets(repos[:2], out, draws=[Draw(0.5, "another key"), None])
    with pytest.raises(PreflightError, match=r"01-repo_1: exists but is not a merge .* move it away"):
        training_datasets(cfg, names, repos, state, log=lambda _: None)
    assert json.loads((out / MERGE_FILE).read_text())["replay"][str(repos[0])]["key"] == "another key"


def test_another_fraction_is_another_experiment(repos: list[Path], tmp_path: Path) -> None:
    """A run_dir of replay at 0.5 refuses 0.25, naming the key, as any changed setting; a manifest written before
    the key existed continues under every strategy that has no fraction."""
    cfg, state = run_state(tmp_path, repos, "replay", replay_fraction=0.5)
    state.record(f"00-{repos[0].name}/train", finished("train", checkpoint="a.ckpt"))
    changed = cfg.model_copy(update={"lifelong": LifelongConfig(dataset_strategy="replay", replay_fraction=0.25)})
    with pytest.raises(ManifestMismatchError, match=r"lifelong\.replay_fraction: 0\.5 -> 0\.25"):
        RunState(changed.run_dir, changed)
    with pytest.raises(ManifestMismatchError, match=r"lifelong\.replay_fraction: 0\.5 -> None"):
        check_experiment(state.path, read_manifest(state.path), cfg.model_copy(update={"lifelong": LifelongConfig()}))
    single, single_state = run_state(tmp_path / "old", repos, "single")
    data = load_json(single_state.path)
    del data["config"]["lifelong"]["replay_fraction"]
    single_state.path.write_text(json.dumps(data))
    # continues:
    RunState(single.run_dir, single).record(f"00-{repos[0].name}/train", finished("train", checkpoint="a.ckpt"))
