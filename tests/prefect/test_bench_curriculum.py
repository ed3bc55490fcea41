"""`leanagent bench curriculum`: two real lifelong flows (`leanagent run`), each job's ranks from the warm launcher."""

from __future__ import annotations

import json

import pytest
from prefect.settings import PREFECT_API_URL

from leanagent.cli import main as cli_main
from tests.conftest import WARM

pytestmark = [pytest.mark.prefect, pytest.mark.ddp]


def test_the_curriculum_section_runs_both_ways_and_finds_the_same_results(prefect_harness, fork_server, tmp_path,
                                                                          capsys, monkeypatch):
    """Two real flows (`leanagent run`) on 2 repositories sharing a small dependency: LeanAgent's re-embedding
    embeds more, embedding once fewer, and the recall matrices agree. Both runs report to the session's Prefect
    server, as a user's runs do with PREFECT_API_URL set, instead of starting a temporary server each (~14 s)."""
    monkeypatch.setenv("PREFECT_API_URL", PREFECT_API_URL.value())
    fork_server.ensure()
    out = tmp_path / "curriculum.json"
    with pytest.raises(SystemExit) as stop:
        cli_main(["bench", "curriculum", "--repos", "2", "--dependency-files", "20", "--dependency-premises", "400",
                  "--theorems", "24", "--launcher", WARM, "--work", str(tmp_path / "work"), "--json", str(out)])
    assert stop.value.code == 0, capsys.readouterr().err
    figures = json.loads(out.read_text())
    assert figures["curriculum_same_results"] is True
    # 2 repositories: 2 validations, 2 untrained evaluations and 1 + 2 stage evaluations, each a whole corpus.
    assert figures["curriculum_all_corpus_passes"] == pytest.approx(7.0, rel=0.02)  # corpora differ a little
    assert figures["curriculum_needed_premises_embedded"] < figures["curriculum_all_premises_embedded"]
    assert figures["curriculum_all_jobs"] == figures["curriculum_needed_jobs"] == 2 * 3 + 1
    assert figures["curriculum_all_embed_s"] > 0 and figures["curriculum_needed_train_steps_s"] > 0
    assert "embedding once:" in capsys.readouterr().out
    assert (tmp_path / "work" / "runs" / "needed" / "manifest.json").is_file()
