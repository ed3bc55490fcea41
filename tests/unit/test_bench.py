"""`leanagent bench` runs end to end on a small dataset and reports every figure it promises (not a timing test)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from leanagent.cli import main as cli_main
from leanagent.data.synthetic import write_demo_repos

EXPECTED = ("corpus_load_s", "corpus_rss_mb", "train_examples_per_s", "tokenize_premises_per_s",
            "embed_premises_per_s", "embed_unsorted_premises_per_s", "retrieval_ms_per_context",
            "embed_autocast_premises_per_s", "retrieval_leanagent_style_ms_per_context", "retrieval_speedup",
            "train_s_per_example", "fisher_s_per_example", "fisher_over_train",
            "train_step_padded_examples_per_s", "train_step_sorted_examples_per_s",
            "train_step_sorted_one_mask_examples_per_s", "train_token_efficiency_padded",
            "train_token_efficiency_sorted", "train_step_loss_rel_diff")
STATES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "minif2f-lean4-ld182" / "random" / "val.json"


def test_bench_writes_every_figure(tmp_path, capsys):
    repo = write_demo_repos(tmp_path / "data", 1, seed=2)[0]
    out = tmp_path / "bench.json"
    with pytest.raises(SystemExit) as stop:
        cli_main(["bench", "--dataset", str(repo), "--min-seconds", "0.05", "--embed-sample", "32", "--no-launch",
                  "--train-batches", "2", "--fisher-examples", "4", "--no-compile", "--json", str(out)])
    assert stop.value.code == 0
    results = json.loads(out.read_text())
    for key in EXPECTED:
        assert isinstance(results[key], float) and math.isfinite(results[key]) and results[key] >= 0, key
    assert results["num_premises"] > 0 and results["device"] == "cpu"
    assert results["retrieval_same_as_leanagent_style"] is True
    assert results["train_max_len"] == results["train_step_max_len"] == 1024  # LeanAgent's data.max_seq_len
    # Sorting processes fewer padding tokens and computes the same loss (fp32, dropout off).
    assert results["train_token_efficiency_sorted"] > results["train_token_efficiency_padded"]
    assert results["train_step_loss_rel_diff"] < 1e-5
    assert "compile_s" not in results and "train_step_compiled_examples_per_s" not in results
    out = capsys.readouterr().out
    assert "negatives + collate" in out and "retrieval scores equal LeanAgent's search" in out
    assert "sorted + one mask" in out and "token eff." in out


@pytest.mark.slow
@pytest.mark.skipif(not STATES.is_file(), reason="the real LeanDojo split files are not in ../shared/data")
def test_bench_compiles_and_takes_real_proof_states(tmp_path):
    """The compiled row (cold and warm compile times) on the tiny model, contexts from a real split file."""
    repo = write_demo_repos(tmp_path / "data", 1, seed=2)[0]
    out = tmp_path / "bench.json"
    with pytest.raises(SystemExit) as stop:
        cli_main(["bench", "--dataset", str(repo), "--min-seconds", "0.05", "--embed-sample", "16", "--no-launch",
                  "--train-batches", "2", "--fisher-examples", "4", "--states", str(STATES), "--json", str(out)])
    assert stop.value.code == 0
    results = json.loads(out.read_text())
    assert results["num_states"] == 2949 and results["states"] == [str(STATES)]
    assert results["compile_s"] > 0 and results["compile_warm_s"] > 0
    assert results["train_step_compiled_examples_per_s"] > 0
    assert results["train_token_efficiency_compiled"] == results["train_token_efficiency_sorted"]


def test_bench_refuses_missing_state_files(tmp_path, capsys):
    repo = write_demo_repos(tmp_path / "data", 1, seed=2)[0]
    with pytest.raises(SystemExit) as stop:
        cli_main(["bench", "--dataset", str(repo), "--states", str(tmp_path / "nope.json")])
    assert stop.value.code == 1
    assert "--states: no such file" in capsys.readouterr().err


def test_bench_refuses_a_folder_without_a_corpus(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        cli_main(["bench", "--dataset", str(tmp_path)])
    assert stop.value.code == 1
    assert "no corpus.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--train-max-len", "--embed-sample", "--train-layers", "--train-batches"])
def test_bench_refuses_a_length_or_sample_below_one(tmp_path, capsys, flag):
    repo = write_demo_repos(tmp_path / "data", 1, seed=2)[0]
    with pytest.raises(SystemExit) as stop:
        cli_main(["bench", "--dataset", str(repo), flag, "0"])
    assert stop.value.code == 2
    assert f"{flag} 0: must be positive" in capsys.readouterr().err
