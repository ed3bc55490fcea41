"""`leanagent bench` runs end to end on a small dataset and reports every figure it promises (not a timing test)."""

from __future__ import annotations

import json
import math

import pytest

from leanagent.cli import main as cli_main
from leanagent.data.synthetic import write_demo_repos

EXPECTED = ("corpus_load_s", "corpus_rss_mb", "train_examples_per_s", "tokenize_premises_per_s",
            "embed_premises_per_s", "embed_unsorted_premises_per_s", "retrieval_ms_per_context",
            "embed_autocast_premises_per_s", "retrieval_leanagent_style_ms_per_context", "retrieval_speedup",
            "train_s_per_example", "fisher_s_per_example", "fisher_over_train")


def test_bench_writes_every_figure(tmp_path, capsys):
    repo = write_demo_repos(tmp_path / "data", 1, seed=2)[0]
    out = tmp_path / "bench.json"
    with pytest.raises(SystemExit) as stop:
        cli_main(["bench", "--dataset", str(repo), "--min-seconds", "0.05", "--embed-sample", "32", "--no-launch",
                  "--json", str(out)])
    assert stop.value.code == 0
    results = json.loads(out.read_text())
    for key in EXPECTED:
        assert isinstance(results[key], float) and math.isfinite(results[key]) and results[key] >= 0, key
    assert results["num_premises"] > 0 and results["device"] == "cpu"
    assert results["retrieval_same_as_leanagent_style"] is True
    assert results["train_max_len"] == 256  # the CPU default: a byt5-small batch at 1024 bytes needs ~45 GB
    out = capsys.readouterr().out
    assert "negatives + collate" in out and "retrieval scores equal LeanAgent's search" in out


def test_bench_refuses_a_folder_without_a_corpus(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        cli_main(["bench", "--dataset", str(tmp_path)])
    assert stop.value.code == 1
    assert "no corpus.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--train-max-len", "--embed-sample"])
def test_bench_refuses_a_length_or_sample_below_one(tmp_path, capsys, flag):
    repo = write_demo_repos(tmp_path / "data", 1, seed=2)[0]
    with pytest.raises(SystemExit) as stop:
        cli_main(["bench", "--dataset", str(repo), flag, "0"])
    assert stop.value.code == 2
    assert f"{flag} 0: must be positive" in capsys.readouterr().err
