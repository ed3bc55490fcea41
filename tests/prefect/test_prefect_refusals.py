"""Runs the flow refuses before any job: a corrupted dataset, a run_dir in use, a bad config file.

None of these launch torchrun, so they are quick; each checks that nothing was trained.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from leanagent.flows.command import run_from_cli
from leanagent.flows.lifelong import lifelong_retrieval
from leanagent.preflight.checks import PreflightError
from leanagent.run.state import RunLock, RunLockedError

pytestmark = [pytest.mark.prefect, pytest.mark.usefixtures("prefect_harness")]


@pytest.fixture
def corrupted_repo(demo_assets, tmp_path: Path) -> Path:
    repo = shutil.copytree(demo_assets.repos[2], tmp_path / "broken_repo")
    corpus = repo / "corpus.jsonl"
    corpus.write_text(corpus.read_text() + "{not json\n")
    return repo


def test_corrupted_dataset_is_refused_before_training(demo_assets, write_cpu_config, corrupted_repo: Path,
                                                      tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    config = write_cpu_config(tmp_path / "config.yaml", run_dir, [demo_assets.repos[0], corrupted_repo])
    with pytest.raises(PreflightError) as info:
        lifelong_retrieval(config_path=str(config))
    message = str(info.value)
    assert "broken_repo" in message and "corpus.jsonl" in message
    assert str(demo_assets.repos[0]) not in message  # the good dataset is not blamed
    assert not run_dir.exists()  # nothing written: no lock, no config, no manifest


def test_cli_reports_bad_input_with_exit_code_1(demo_assets, write_cpu_config, corrupted_repo: Path,
                                                tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_cpu_config(tmp_path / "config.yaml", tmp_path / "run", [corrupted_repo])
    assert run_from_cli(str(config)) == 1
    assert "broken_repo" in capsys.readouterr().err
    assert run_from_cli(str(tmp_path / "missing.yaml")) == 1
    assert "no such config file" in capsys.readouterr().err
    assert not (tmp_path / "run" / "jobs").exists()


def test_run_dir_in_use_is_refused_naming_the_holder(demo_assets, write_cpu_config, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    config = write_cpu_config(tmp_path / "config.yaml", run_dir, demo_assets.repos[:1])
    with RunLock(run_dir), pytest.raises(RunLockedError, match=rf"pid {os.getpid()}"):
        lifelong_retrieval(config_path=str(config))
    assert not (run_dir / "leanagent-run-config.yaml").exists()


def test_exactly_one_config_source(demo_assets, write_cpu_config, tmp_path: Path) -> None:
    from leanagent.ground.config import ConfigError, load_config

    config = write_cpu_config(tmp_path / "config.yaml", tmp_path / "run", demo_assets.repos[:1])
    with pytest.raises(ConfigError, match="exactly one"):
        lifelong_retrieval()
    with pytest.raises(ConfigError, match="exactly one"):
        lifelong_retrieval(config=load_config(config), config_path=str(config))
