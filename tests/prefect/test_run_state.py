"""The run manifest and the run_dir lock, without Prefect and without training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from leanagent.config import PipelineConfig, RepoConfig
from leanagent.run_state import (
    ManifestMismatchError,
    RunLock,
    RunLockedError,
    RunState,
    config_fingerprint,
    stage_name,
)


def _cfg(tmp_path: Path, **lifelong: float) -> PipelineConfig:
    repos = [RepoConfig(path=tmp_path / "a"), RepoConfig(path=tmp_path / "b")]
    cfg = PipelineConfig(run_dir=tmp_path / "run", repos=repos)
    for key, value in lifelong.items():
        setattr(cfg.lifelong, key, value)
    return cfg


def _started(cfg: PipelineConfig) -> RunState:
    state = RunState(cfg.run_dir, cfg)
    state.set_order(["a", "b"], [r.path for r in cfg.repos])
    return state


def test_record_survives_a_reopen(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    state = _started(cfg)
    name = stage_name(0, "a", "train")
    assert name == "00-a/train"
    state.start(name)
    assert state.stage_done(name) is None
    state.record(name, {"checkpoint": "x.ckpt"})
    reopened = RunState(cfg.run_dir, cfg)
    assert reopened.stage_done(name) == {"checkpoint": "x.ckpt"}
    assert reopened.stage_done("01-b/train") is None
    with pytest.raises(KeyError, match="not a stage"):
        reopened.record("07-z/train", {})


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
    state.record("00-a/train", {"checkpoint": "a.ckpt"})
    data = json.loads(state.path.read_text())
    del data["config"]["lifelong"]["keep_checkpoints"]
    data["fingerprint"] = "from-an-older-version"
    state.path.write_text(json.dumps(data))
    reopened = RunState(cfg.run_dir, cfg)  # no ManifestMismatchError
    assert reopened.stage_done("00-a/train") == {"checkpoint": "a.ckpt"}
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


def test_changed_order_is_refused(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    _started(cfg)
    with pytest.raises(ManifestMismatchError, match="order"):
        RunState(cfg.run_dir, cfg).set_order(["b", "a"], [r.path for r in reversed(cfg.repos)])


def test_lock_names_the_holder_in_another_process(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from leanagent.run_state import RunLock; "
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

