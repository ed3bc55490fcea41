"""The run manifest and the run_dir lock, without Prefect and without training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from leanagent.ground.config import PipelineConfig, RepoConfig
from leanagent.run.fingerprint import config_fingerprint
from leanagent.run.manifest import MANIFEST_VERSION, ManifestMismatchError, RepoEntry, stage_name
from leanagent.run.state import RunLock, RunLockedError, RunState, check_sequence
from tests.stage_results import finished


def _cfg(tmp_path: Path, **lifelong: float) -> PipelineConfig:
    repos = [RepoConfig(path=tmp_path / "a"), RepoConfig(path=tmp_path / "b")]
    cfg = PipelineConfig(run_dir=tmp_path / "run", repos=repos)
    for key, value in lifelong.items():
        setattr(cfg.lifelong, key, value)
    return cfg


def _entry(tmp_path: Path, name: str, data: str = "", folder: str | None = None) -> RepoEntry:
    """A repository with made-up digests: `data` stands for the content of its files."""
    return RepoEntry(name, tmp_path / (folder or name), {"corpus.jsonl": f"c-{name}{data}", "random/test.json": "t"})


def _started(cfg: PipelineConfig) -> RunState:
    state = RunState(cfg.run_dir, cfg)
    entries = [_entry(cfg.run_dir.parent, "a"), _entry(cfg.run_dir.parent, "b")]
    state.extend(entries, entries)
    return state


def test_record_survives_a_reopen(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    state = _started(cfg)
    name = stage_name(0, "a", "train")
    assert name == "00-a/train"
    state.start(name)
    assert state.stage_done(name) is None
    state.record(name, finished("train"))
    reopened = RunState(cfg.run_dir, cfg)
    assert reopened.stage_done(name) == finished("train")
    assert reopened.stage_done("01-b/train") is None
    with pytest.raises(KeyError, match="not a stage"):
        reopened.record("07-z/train", finished("train"))


def test_failed_stage_is_not_done(tmp_path: Path) -> None:
    state = _started(_cfg(tmp_path))
    state.start("00-a/train")
    state.fail("00-a/train", "LaunchError: boom")
    assert state.stage_done("00-a/train") is None


def test_changed_config_is_refused_naming_the_key(tmp_path: Path) -> None:
    _started(_cfg(tmp_path))
    with pytest.raises(ManifestMismatchError, match=r"lifelong\.ewc_lambda: 0\.0 -> 0\.3"):
        RunState(tmp_path / "run", _cfg(tmp_path, ewc_lambda=0.3))


def test_a_knob_added_by_a_later_version_at_its_default_is_not_a_change(tmp_path: Path) -> None:
    """A run_dir started by an older leanagent, whose config lacked a key now at its default, resumes."""
    cfg = _cfg(tmp_path)
    state = _started(cfg)
    state.record("00-a/train", finished("train", checkpoint="a.ckpt"))
    data = json.loads(state.path.read_text())
    del data["config"]["lifelong"]["keep_checkpoints"]
    data["fingerprint"] = "from-an-older-version"
    state.path.write_text(json.dumps(data))
    reopened = RunState(cfg.run_dir, cfg)  # no ManifestMismatchError
    assert reopened.stage_done("00-a/train") == finished("train", checkpoint="a.ckpt")
    # The same missing key at a non-default value is a change, and is refused.
    other = _cfg(tmp_path)
    other.lifelong.keep_checkpoints = "best_and_last"
    state.path.write_text(json.dumps(data))
    with pytest.raises(ManifestMismatchError, match=r"lifelong\.keep_checkpoints: '\(absent\)' -> 'best_and_last'"):
        RunState(cfg.run_dir, other)


def test_run_irrelevant_keys_do_not_change_the_fingerprint(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    other = cfg.model_copy(deep=True)
    other.data.num_workers = 0
    other.trainer.log_every_n_steps = 50
    other.run_dir = tmp_path / "moved"
    assert config_fingerprint(other) == config_fingerprint(cfg)
    other.trainer.devices = 2
    assert config_fingerprint(other) != config_fingerprint(cfg)


def test_the_repositories_are_the_sequence_not_the_experiment(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    more = cfg.model_copy(update={"repos": [*cfg.repos, RepoConfig(path=tmp_path / "c")], "repos_dir": tmp_path})
    assert config_fingerprint(more) == config_fingerprint(cfg)


def test_a_sequence_grows_at_its_end_and_writes_only_what_changed(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    state = _started(cfg)
    a, b, c = (_entry(tmp_path, n) for n in "abc")
    written = state.path.stat().st_mtime_ns
    state.extend([a, b], [a, b])  # the same again: nothing to write
    assert state.path.stat().st_mtime_ns == written
    reopened = RunState(cfg.run_dir, cfg)
    # c is listed first, yet appended: a new repository goes after those of the run.
    reopened.extend([a, b, c], [c, a, b])
    data = json.loads(state.path.read_text())
    assert data["order"] == ["a", "b", "c"] and data["version"] == MANIFEST_VERSION
    assert data["repos"]["02-c"]["dataset"] == c.dataset
    moved = RepoEntry("a", tmp_path / "elsewhere" / "a", a.dataset)  # the same files in another folder
    recorded = [RepoEntry(n, Path(data["repos"][f"{i:02d}-{n}"]["path"]), data["repos"][f"{i:02d}-{n}"]["dataset"])
                for i, n in enumerate(data["order"])]
    assert [e.name for e in check_sequence(state.path, recorded, data["given"], [c, moved, b])] == ["a", "b", "c"]


@pytest.mark.parametrize("change, expected", [
    ("removed", r"repository 'b' \(#2 of this run's sequence, .*\) is not in the config any more"),
    ("renamed", r"repository 'b' \(#2 .*\) is now named 'bee'; .* restore the name 'b'"),
    ("reordered", r"the config lists repository 'b' before 'a', but this run was given 'a' first"),
    ("changed", r"the dataset of repository 'b' .* changed since the run recorded it \(.*corpus.jsonl: sha256 c-b, "
                r"now c-bX\)"),
])
def test_a_sequence_that_does_not_extend_the_run_is_refused_by_name(tmp_path: Path, change: str,
                                                                     expected: str) -> None:
    cfg = _cfg(tmp_path)
    state = _started(cfg)
    before = state.path.read_text()
    a, b, c = (_entry(tmp_path, n) for n in "abc")
    given = {"removed": [a, c], "renamed": [a, _entry(tmp_path, "bee", folder="b"), c], "reordered": [b, a, c],
             "changed": [a, _entry(tmp_path, "b", "X"), c]}[change]
    with pytest.raises(ManifestMismatchError, match=expected):
        RunState(cfg.run_dir, cfg).extend([a, b, c], given)
    assert state.path.read_text() == before


def test_a_version_1_manifest_continues(tmp_path: Path) -> None:
    """A run started before the repositories left the fingerprint: its config holds them, its entries no digest."""
    cfg = _cfg(tmp_path)
    state = _started(cfg)
    state.record("00-a/train", finished("train", checkpoint="a.ckpt"))
    data = json.loads(state.path.read_text())
    data["version"] = 1
    del data["repos"]["00-a"]["stages"]["train"]["result"]["program"]  # a version 1 result names no program
    data.pop("given")
    data["config"]["repos"] = [{"path": str(tmp_path / "a"), "name": None}, {"path": str(tmp_path / "b"), "name": None}]
    for repo in data["repos"].values():
        repo.pop("dataset")
    state.path.write_text(json.dumps(data))
    a, b, c = (_entry(tmp_path, n) for n in "abc")
    reopened = RunState(cfg.run_dir, cfg)
    with pytest.raises(ManifestMismatchError, match="lists repository 'b' before 'a'"):
        reopened.extend([a, b, c], [b, a, c])  # the order of its config's list is kept as the given one
    reopened.extend([a, b, c], [a, b, c])
    upgraded = json.loads(state.path.read_text())
    assert upgraded["version"] == MANIFEST_VERSION and "repos" not in upgraded["config"]
    assert upgraded["repos"]["00-a"]["dataset"] == a.dataset and reopened.stage_done("00-a/train")


def test_waiting_lists_the_repositories_with_a_stage_to_run(tmp_path: Path) -> None:
    state = _started(_cfg(tmp_path))
    for stage in ("00-a/eval-untrained", "00-a/train", "00-a/fisher", "00-a/eval-00-a", "01-b/eval-untrained"):
        state.record(stage, finished(stage))
    assert state.waiting() == ["b"]
    state.fail("00-a/fisher", "boom")
    assert state.waiting() == ["a", "b"]


def test_a_probe_of_the_lock_writes_nothing(tmp_path: Path) -> None:
    RunLock(tmp_path / "fresh").probe()  # no lock file: free, and nothing created
    assert not (tmp_path / "fresh").exists()
    with RunLock(tmp_path):
        with pytest.raises(RunLockedError, match=rf"pid {os.getpid()}"):
            RunLock(tmp_path).probe()
    RunLock(tmp_path).probe()


def test_lock_names_the_holder_in_another_process(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from leanagent.run.state import RunLock; "
         "l = RunLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(60)", str(tmp_path)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunLockedError, match=rf"pid {holder.pid}\b"):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    with RunLock(tmp_path):  # the kernel released the dead holder's lock
        assert (tmp_path / ".lock").read_text().strip() == str(os.getpid())



def _on_cpu(cfg: PipelineConfig, precision: str) -> PipelineConfig:
    return cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"accelerator": "cpu",
                                                                           "precision": precision})})


def test_a_run_under_auto_keeps_the_precision_its_first_job_ran_on_any_machine(tmp_path: Path) -> None:
    """`trainer.precision: auto` is resolved by the ranks; the first result says what ran, and the run records it:
    reopened with `auto` (on a CPU that would resolve it otherwise) it continues in it, and its jobs are told so."""
    cfg = _on_cpu(_cfg(tmp_path), "auto")
    state = _started(cfg)
    assert state.manifest.config.trainer["precision"] == "auto"  # nothing has run yet
    assert state.config is cfg  # what its jobs get
    state.record("00-a/eval-untrained", finished("evaluate", precision="32-true"))
    state.record("00-a/train", finished("train", checkpoint="a.ckpt", precision="32-true"))
    on_disk = json.loads(state.path.read_text())
    assert on_disk["config"]["trainer"]["precision"] == "32-true"
    reopened = RunState(cfg.run_dir, cfg)  # not refused: auto agrees with what the run recorded
    assert reopened.manifest.config.trainer["precision"] == "32-true"
    assert reopened.config.trainer.precision == "32-true"
    assert reopened.config.model_dump(exclude={"trainer"}) == cfg.model_dump(exclude={"trainer"})
    assert RunState(cfg.run_dir, _on_cpu(cfg, "32-true")).stage_done("00-a/train") == finished(
        "train", checkpoint="a.ckpt", precision="32-true")
    with pytest.raises(ManifestMismatchError, match=r"trainer\.precision: '32-true' -> 'bf16-mixed'"):
        RunState(cfg.run_dir, _on_cpu(cfg, "bf16-mixed"))


def test_a_run_recorded_before_auto_continues_in_its_bf16_under_auto(tmp_path: Path) -> None:
    """A manifest written before `auto` existed holds the precision its config gave (LeanAgent's bf16-mixed) and
    results without one: a config that now says auto continues it in bf16-mixed, whatever this CPU would take."""
    old = _on_cpu(_cfg(tmp_path), "bf16-mixed")
    state = _started(old)
    state.record("00-a/train", finished("train", checkpoint="a.ckpt"))
    written = json.loads(state.path.read_text())
    auto = _on_cpu(old, "auto")
    reopened = RunState(old.run_dir, auto)
    assert reopened.config.trainer.precision == "bf16-mixed"
    assert reopened.manifest.config.fields() == written["config"]
    assert reopened.manifest.fingerprint == written["fingerprint"]
    reopened.record("00-a/fisher", finished("fisher", fisher="a.safetensors", precision="bf16-mixed"))
    assert json.loads(state.path.read_text())["config"]["trainer"]["precision"] == "bf16-mixed"
