"""`leanagent bench` runs end to end on a small dataset and reports every figure it promises (not a timing test)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from leanagent.bench.abuse import AbuseFigures, AttackRow
from leanagent.bench.results import (
    BenchResult,
    FisherFigures,
    FixedLengthRow,
    LaunchFigures,
    PassFigures,
    RunInfo,
    TrainStepFigures,
    TrainStepRow,
)
from leanagent.bench.table import format_table
from leanagent.cli import main as cli_main
from leanagent.data.synthetic import write_demo_repos
from leanagent.model.dtypes import cpu_has_bf16, resolve_precision

EXPECTED = ("corpus_load_s", "corpus_rss_mb", "train_examples_per_s", "tokenize_premises_per_s",
            "embed_premises_per_s", "embed_unsorted_premises_per_s", "retrieval_ms_per_context",
            "embed_autocast_premises_per_s", "retrieval_leanagent_style_ms_per_context", "retrieval_speedup",
            "train_s_per_example", "fisher_s_per_example", "fisher_over_train",
            "train_step_padded_examples_per_s", "train_step_sorted_examples_per_s",
            "train_step_sorted_one_mask_examples_per_s", "train_token_efficiency_padded",
            "train_token_efficiency_sorted", "train_step_loss_rel_diff")
# Every key `--json` writes on a CPU with --no-launch --no-compile, as the bench wrote them before it was split
# into typed sections (readers of bench.json, scripts/gpu_run.sh's among them, know these names).
JSON_KEYS = {"corpus_load_s", "corpus_order_padding_fraction", "corpus_rss_mb", "dataset", "device",
             "embed_autocast_premises_per_s", "embed_autocast_speedup", "embed_premises_per_s", "embed_sample",
             "embed_speedup", "embed_unsorted_premises_per_s", "fisher_auto", "fisher_over_train",
             "fisher_s_per_example", "model", "num_files", "num_premises", "num_train_examples", "params",
             "retrieval_leanagent_style_ms_per_context", "retrieval_ms_per_context",
             "retrieval_same_as_leanagent_style", "retrieval_speedup", "retrieval_width", "threads",
             "retrieval_scoring_path", "retrieval_mask_ms_per_context", "retrieval_product_ms_per_context",
             "retrieval_selection_ms_per_context", "retrieval_rows", "retrieval_rows_candidates",
             "retrieval_rows_ties", "cpu", "cpu_flags",
             "tokenize_premises_per_s", "torch", "train_examples_per_s", "train_max_len", "train_model",
             "train_s_per_example", "train_step_batches", "train_step_examples", "train_step_layers",
             "train_step_loss_rel_diff", "train_step_max_len", "train_step_padded_examples_per_s",
             "train_step_padded_tokens_per_s", "train_step_real_tokens_per_example", "train_step_rounds_best_of",
             "train_step_sorted_examples_per_s", "train_step_sorted_one_mask_examples_per_s",
             "train_step_sorted_one_mask_speedup", "train_step_sorted_one_mask_tokens_per_s",
             "train_step_sorted_speedup", "train_step_sorted_tokens_per_s", "train_token_efficiency_padded",
             "train_token_efficiency_sorted", "train_token_efficiency_sorted_one_mask"}
COMPILED_KEYS = {"compile_s", "compile_warm_s", "train_step_compiled_examples_per_s", "train_step_compiled_speedup",
                 "train_step_compiled_tokens_per_s", "train_token_efficiency_compiled"}
STATES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "minif2f-lean4-ld182" / "random" / "val.json"


def test_bench_writes_every_figure(tmp_path, capsys):
    repo = write_demo_repos(tmp_path / "data", 1, seed=2)[0]
    out = tmp_path / "bench.json"
    with pytest.raises(SystemExit) as stop:
        cli_main(["bench", "path", "--dataset", str(repo), "--min-seconds", "0.05", "--embed-sample", "32",
                  "--no-launch", "--train-batches", "2", "--fisher-examples", "4", "--no-compile", "--json", str(out)])
    assert stop.value.code == 0
    results = json.loads(out.read_text())
    assert set(results) == JSON_KEYS
    for key in EXPECTED:
        assert isinstance(results[key], float) and math.isfinite(results[key]) and results[key] >= 0, key
    assert results["num_premises"] > 0 and results["device"] == "cpu"
    assert results["retrieval_same_as_leanagent_style"] is True
    assert results["retrieval_rows_candidates"] + results["retrieval_rows_ties"] == results["retrieval_rows"] > 0
    for part in ("mask", "product", "selection"):
        assert results[f"retrieval_{part}_ms_per_context"] > 0, part
    assert results["cpu"] and results["cpu_flags"]
    assert results["train_max_len"] == results["train_step_max_len"] == 1024  # LeanAgent's data.max_seq_len
    # Sorting processes fewer padding tokens and computes the same loss (fp32, dropout off).
    assert results["train_token_efficiency_sorted"] > results["train_token_efficiency_padded"]
    assert results["train_step_loss_rel_diff"] < 1e-5
    assert "compile_s" not in results and "train_step_compiled_examples_per_s" not in results
    out = capsys.readouterr().out
    assert "negatives + collate" in out and "retrieval scores equal LeanAgent's search" in out
    assert "its selection alone" in out and "rows with a tie past the candidates" in out
    assert "sorted + one mask" in out and "token eff." in out


@pytest.mark.skipif(not STATES.is_file(), reason="the real LeanDojo split files are not in ../shared/data")
def test_bench_compiles_and_takes_real_proof_states(tmp_path):
    """The compiled row (cold and warm compile times) on the tiny model, contexts from a real split file."""
    repo = write_demo_repos(tmp_path / "data", 1, seed=2)[0]
    out = tmp_path / "bench.json"
    with pytest.raises(SystemExit) as stop:
        cli_main(["bench", "path", "--dataset", str(repo), "--min-seconds", "0.05", "--embed-sample", "16",
                  "--no-launch", "--train-batches", "2", "--fisher-examples", "4", "--states", str(STATES), "--json",
                  str(out)])
    assert stop.value.code == 0
    results = json.loads(out.read_text())
    assert set(results) == JSON_KEYS | COMPILED_KEYS | {"num_states", "states"}
    assert results["num_states"] == 2949 and results["states"] == [str(STATES)]
    assert results["compile_s"] > 0 and results["compile_warm_s"] > 0
    assert results["train_step_compiled_examples_per_s"] > 0
    assert results["train_token_efficiency_compiled"] == results["train_token_efficiency_sorted"]


def test_bench_refuses_missing_state_files(tmp_path, capsys):
    repo = write_demo_repos(tmp_path / "data", 1, seed=2)[0]
    with pytest.raises(SystemExit) as stop:
        cli_main(["bench", "path", "--dataset", str(repo), "--states", str(tmp_path / "nope.json")])
    assert stop.value.code == 1
    assert "--states: no such file" in capsys.readouterr().err


def test_bench_refuses_a_folder_without_a_corpus(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        cli_main(["bench", "path", "--dataset", str(tmp_path)])
    assert stop.value.code == 1
    assert "no corpus.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--train-max-len", "--embed-sample", "--train-layers", "--train-batches",
                                  "--fisher-examples"])
def test_bench_refuses_a_length_or_sample_below_one(tmp_path, capsys, flag):
    repo = write_demo_repos(tmp_path / "data", 1, seed=2)[0]
    with pytest.raises(SystemExit) as stop:
        cli_main(["bench", "path", "--dataset", str(repo), flag, "0"])
    assert stop.value.code == 1
    assert capsys.readouterr().err.strip() == f"error: {flag}: Input should be greater than 0"


def test_bench_refuses_an_unknown_fisher_method(tmp_path, capsys):
    repo = write_demo_repos(tmp_path / "data", 1, seed=2)[0]
    with pytest.raises(SystemExit) as stop:
        cli_main(["bench", "path", "--dataset", str(repo), "--fisher-methods", "loop,vmap"])
    assert stop.value.code == 1
    assert capsys.readouterr().err.strip() == "error: --fisher-methods.1: Input should be 'loop' or 'vectorised'"


def test_cuda_and_failed_rows_flatten_to_the_keys_readers_know():
    """The sections only a GPU fills (checked here without one): the CUDA device and its peak (null when the peak
    table does not know the GPU), the fixed-length rows (an out-of-memory row keeps only its error), a pass or a
    training row that ran out of memory, and the launch figures."""
    run = RunInfo(dataset="d", device="cuda", torch="2", threads=1, model="m", params=1, train_model="m, 2 layers",
                  train_step_max_len=1024, cuda_device="NVIDIA H200", peak_bf16_tflops=None)
    step = TrainStepFigures(train_step_batches=1, train_step_examples=4, train_step_layers=2,
                            train_step_real_tokens_per_example=9.0, train_step_loss_rel_diff=0.0,
                            train_step_rounds_best_of=2, compile_error="no triton",
                            rows={"padded": TrainStepRow(1.0, 2.0, 0.5, mfu=0.1), "sorted": TrainStepRow(error="oom")})
    fisher = FisherFigures(train_max_len=1024, fisher_auto="loop",
                           passes={"train": PassFigures(1.0, peak_memory_gb=3.0), "fisher": PassFigures(2.0, 2.0),
                                   "fisher_vectorised": PassFigures(error="out of memory: x")})
    rows = [FixedLengthRow(512, 4, False, 1.0, 2.0, 3.0, None, 4.0), FixedLengthRow(1024, 16, True, error="oom")]
    result = BenchResult(run, train_step=step, fisher=fisher, cuda_training=rows,
                         launch=LaunchFigures(launch_overhead_s=1.0, launch_total_s=2.0))
    flat = json.loads(json.dumps(result.flat()))
    assert flat["cuda_device"] == "NVIDIA H200" and "peak_bf16_tflops" in flat and flat["peak_bf16_tflops"] is None
    assert flat["cuda_training"] == [
        {"length": 512, "batch_size": 4, "compiled": False, "examples_per_s": 1.0, "tokens_per_s": 2.0, "tflops": 3.0,
         "mfu": None, "peak_memory_gb": 4.0},
        {"length": 1024, "batch_size": 16, "compiled": True, "error": "oom"}]
    assert flat["train_step_padded_mfu"] == 0.1 and flat["train_step_sorted_error"] == "oom"
    assert "train_step_sorted_examples_per_s" not in flat and "train_step_padded_speedup" not in flat
    assert flat["compile_error"] == "no triton" and "compile_s" not in flat
    assert (flat["train_peak_memory_gb"], flat["fisher_over_train"], flat["fisher_vectorised_error"]) == (
        3.0, 2.0, "out of memory: x")
    assert (flat["launch_overhead_s"], flat["launch_total_s"]) == (1.0, 2.0)
    assert "fisher vectorised error: out of memory: x" in format_table(result)
    assert "sorted                         oom" in format_table(result)


def test_the_projection_counts_leanagents_passes_over_the_dependency(tmp_path, capsys):
    """LeanAgent's 14 repositories: 14 validations + 14 untrained evaluations + 105 stage evaluations re-embed the
    dependency 133 times; embedding once, 14 + 1 + 14 = 29 (the arithmetic of `leanagent bench projection`)."""
    out = tmp_path / "projection.json"
    with pytest.raises(SystemExit) as stop:
        cli_main(["bench", "projection", "--own-premises", "0", "--json", str(out)])
    assert stop.value.code == 0
    figures = json.loads(out.read_text())
    assert (figures["projection_passes_before"], figures["projection_passes_after"]) == (133.0, 29.0)
    assert figures["projection_premises_before"] == 133 * 100_000
    assert figures["projection_embed_hours_before"] == pytest.approx(133 * 100_000 / (4 * 1252.0) / 3600)
    assert figures["projection_train_hours"] == pytest.approx(14 * 3000 * 0.058 / 4 / 3600)
    assert "LeanAgent (re-embed all)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        cli_main(["bench", "projection", "--needed-share", "0.5", "--repos", "3", "--json", str(out)])
    figures = json.loads(out.read_text())
    assert figures["projection_passes_before"] == 3 + 3 + 6 and figures["projection_passes_after"] == 0.5 * 7
    with pytest.raises(SystemExit) as refused:
        cli_main(["bench", "projection", "--needed-share", "1.5"])
    assert refused.value.code == 1
    assert capsys.readouterr().err.strip() == "error: --needed-share: Input should be less than or equal to 1"


def test_the_path_section_runs_only_the_parts_asked_for(tmp_path):
    repo = write_demo_repos(tmp_path / "data", 1, seed=2)[0]
    out = tmp_path / "bench.json"
    with pytest.raises(SystemExit) as stop:
        cli_main(["bench", "path", "--dataset", str(repo), "--min-seconds", "0.01", "--embed-sample", "16",
                  "--parts", "embedding", "--json", str(out)])
    assert stop.value.code == 0
    results = json.loads(out.read_text())
    assert results["embed_premises_per_s"] > 0 and results["embed_autocast_premises_per_s"] > 0
    assert not {"retrieval_ms_per_context", "train_s_per_example", "launch_overhead_s"} & set(results)


def _bench(argv: list[str], out: Path) -> dict:
    with pytest.raises(SystemExit) as stop:
        cli_main(["bench", *argv, "--json", str(out)])
    assert stop.value.code == 0
    return json.loads(out.read_text())


def test_the_dtypes_section_times_each_dtype(tmp_path):
    figures = _bench(["dtypes", "--preset", "tiny", "--repeats", "1", "--premises", "4", "--dtypes", "fp32", "bf16"],
                     tmp_path / "dtypes.json")
    for dtype in ("fp32", "bf16"):
        assert figures[f"{dtype}_premises_per_s"] > 0
        states = [k for k in figures if k.startswith(f"{dtype}_state_")]
        assert len(states) == 2 and all(figures[k] > 0 for k in states), figures


def test_the_grad_cache_section_runs_each_variant_in_its_own_process(tmp_path):
    figures = _bench(["grad-cache", "--batch", "4", "--layers", "1", "--negatives", "1"], tmp_path / "gc.json")
    assert figures["uncached_peak_added_mb"] > 0 and figures["cached_step_s"] > 0
    assert figures["memory_ratio"] == pytest.approx(figures["cached_peak_added_mb"] / figures["uncached_peak_added_mb"])


@pytest.fixture(scope="module")
def small_index(tmp_path_factory, tiny_model) -> tuple[Path, Path]:
    from leanagent.index.build import build_index

    root = tmp_path_factory.mktemp("bench-index")
    repo = write_demo_repos(root / "data", 1, seed=3)[0]
    build_index(tiny_model, repo, root / "index")
    return root / "index", repo


def test_the_batching_section_compares_both_servers_and_the_parts(tmp_path, small_index):
    index, repo = small_index
    figures = _bench(["batching", str(index), str(repo), "--threads", "4", "--rounds", "1"], tmp_path / "b.json")
    for key in ("batched_threads_ms", "unbatched_threads_ms", "encoder_alone_ms", "encoder_together_ms",
                "ranking_1472_together_ms"):
        assert figures[key] > 0, key


def test_the_batching_section_refuses_a_folder_without_an_index(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        cli_main(["bench", "batching", str(tmp_path), str(tmp_path)])
    assert stop.value.code == 1
    assert "no index.json" in capsys.readouterr().err


def test_the_engines_section_measures_each_engine_against_torch_fp32(tmp_path, tiny_model):
    repo = write_demo_repos(tmp_path / "data", 1, seed=3)[0]
    figures = _bench(["engines", "--dataset", str(repo), "--model", str(tiny_model), "--repeats", "1",
                      "--max-states", "3", "--premises", "8", "--engines", "ct2:fp32", "ct2:int8_float32"],
                     tmp_path / "engines.json")
    assert figures["timed_states"] == 3 and figures["test_states"] >= 10 and figures["flags"]
    for key in ("torch_fp32", "ct2_fp32", "ct2_int8_float32"):  # the reference is always measured, first
        assert figures[f"{key}_state_s"] > 0 and figures[f"{key}_premises_per_s"] > 0, key
    assert figures["torch_fp32_overlap"] == 1.0 and figures["torch_fp32_recall10_change"] == 0.0
    assert figures["ct2_fp32_overlap"] == 1.0 and figures["ct2_fp32_recall10_change"] == 0.0  # exact: the same top 10
    assert figures["ct2_fp32_cosine_min"] >= 0.9999 and 0.9 < figures["ct2_int8_float32_cosine_min"] < 1.0


def test_the_engines_section_takes_an_index_or_a_dataset(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        cli_main(["bench", "engines"])
    assert stop.value.code == 1 and "give --index" in capsys.readouterr().err


def test_the_serve_section_measures_real_servers(tmp_path):
    figures = _bench(["serve", str(tmp_path / "work"), "--no-mathlib", "--modes", "batched", "--bodies", "new client",
                      "--serve-args", "--dtype fp32"], tmp_path / "serve.json")
    assert [row["clients"] for row in figures["rows"]] == [1, 8, 32]
    assert all(row["requests_per_s"] > 0 and row["p99_ms"] >= row["p50_ms"] for row in figures["rows"])
    assert figures["cold_start_s_demo_batched"] > 0


def test_every_section_names_functions_that_exist():
    """A section is one table entry: its measure and table functions are found where it names them."""
    from leanagent.cli.bench import SECTIONS, _named

    for section in SECTIONS:
        assert callable(_named(section.measure)) and callable(_named(section.table)), section.name


def test_the_abuse_section_replays_attacks_on_real_servers(tmp_path):
    """`bench abuse --size small`, on three attacks of each kind (a request, a followed run, a refused start): every
    row judged, none failing, the table printed with each attack."""
    figures = _bench(["abuse", "--size", "small", "--attacks", "huge-integer", "manifest-shapes", "no-token",
                      "big-token", "--work", str(tmp_path / "work")], tmp_path / "abuse.json")
    rows = {row["attack"]: row for row in figures["rows"]}
    assert set(rows) == {"huge-integer", "manifest-shapes", "no-token", "big-token"} and figures["failed"] == []
    assert rows["huge-integer"]["statuses"] == {"422": 2} and rows["huge-integer"]["cpu_s"] is not None
    assert rows["no-token"]["statuses"] == {"exit 1": 1}
    assert rows["big-token"]["statuses"] == {"exit 1": 1} and "more than a token file ever holds" in \
        rows["big-token"]["note"] and rows["big-token"]["problems"] == []
    assert "the stage written after: served" in rows["manifest-shapes"]["note"]
    assert rows["manifest-shapes"]["health_worst_s"] is not None and rows["manifest-shapes"]["peak_rss_mb"] > 0


def test_a_failed_row_fails_the_abuse_section_and_one_not_run_does_not():
    """`bench abuse` exited 0 when rows of its table said FAIL: each row's own bar and the common ones make its
    verdict, and `failures` (what makes the command exit 1) lists every failed row but those not run."""
    def row(name: str, **kw) -> AttackRow:
        base = {"statuses": {"200": 1}, "requests": 1, "cpu_s": 0.1, "cpu_s_per_request": 0.1, "idle_rss_mb": 400,
                "peak_rss_mb": 410, "health_worst_s": 0.1, "health_failures": 0}
        r = AttackRow(name, "bar", "what", **{**base, **kw})
        r.verdict = r.judge()
        return r
    figures = AbuseFigures("small", [row("fine"), row("slow", cpu_s_per_request=2.5), row("own", problems=["x"]),
                                     row("five", statuses={"500": 1}), row("stuck", health_worst_s=3.0)])
    figures.rows.append(AttackRow("root", "bar", "what", {"not run": 1}, 0, verdict="not run: needs root"))
    assert [r.verdict for r in figures.rows[:5]] == ["ok", "FAIL: CPU", "FAIL: x", "FAIL: a 5xx", "FAIL: /health"]
    assert figures.failures() == ["slow", "own", "five", "stuck"]


def test_the_precision_section_times_each_precision_and_names_the_cpu(tmp_path, capsys):
    figures = _bench(["precision", "--presets", "tiny", "--batches", "1", "--rounds", "1"], tmp_path / "p.json")
    for precision in ("32-true", "bf16-mixed"):
        assert figures[f"tiny_{precision}_train_s_per_example"] > 0
        assert figures[f"tiny_{precision}_fisher_s_per_example"] > 0
    assert figures["auto"] == resolve_precision("auto", "cpu") and figures["cpu_has_bf16"] == cpu_has_bf16()
    assert figures["cpu"] and figures["torch_capability"] and figures["examples"] == 4
    table = capsys.readouterr().out
    assert f"trainer.precision auto -> {figures['auto']}" in table and "tiny         bf16-mixed" in table


def test_the_sweep_sections_table_compares_the_sweep_with_its_setups_alone():
    """`bench sweep`'s table from its figures (the measurement itself runs five commands: docs/performance.md)."""
    from leanagent.bench.sweep import SETUPS, SweepFigures, sweep_table

    figures = SweepFigures("a CPU", ["avx2"], 3, len(SETUPS), 2, sweep_jobs=28, alone_jobs=40, sweep_job_seconds=300.0,
                           alone_job_seconds=450.0, sweep_wall_seconds=400.0, alone_wall_seconds=600.0,
                           same_results=True, per_setup_alone=dict.fromkeys(SETUPS, 150.0))
    lines = sweep_table(figures).splitlines()
    assert "the same in the sweep as alone: yes" in lines[0] and "bf16 flags: avx2" in lines[0]
    assert lines[2].split()[-3:] == ["40", "450.0", "600.0"] and lines[3].split()[-3:] == ["28", "300.0", "400.0"]
    assert lines[4] == "  the sweep: 12 fewer jobs, 1.50x fewer job seconds, 1.50x less wall time"
    assert figures.flat()["sweep_jobs"] == 28 and figures.flat()["sweep_alone_jobs"] == 40
