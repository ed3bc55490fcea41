"""The lifelong flow end to end: three repositories, two CPU ranks under torchrun, EWC on.

One flow run is shared by the session (`lifelong_run3`, tests/conftest.py: it is the slow part); the rerun test
then checks that a second run of the same config launches nothing and touches no file of the first.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from leanagent.data.corpus import Corpus
from leanagent.flows.artifacts import PROGRESS_KEY, SUMMARY_KEY, TABLE_KEY
from leanagent.flows.lifelong import lifelong_retrieval
from leanagent.index.files import read_names
from leanagent.index.query import PremiseIndex
from leanagent.model.dtypes import resolve_precision
from leanagent.report import RunReport, run_setup
from leanagent.run.manifest import ManifestMismatchError, read_manifest, stage_indexes
from tests.conftest import FinishedRun, file_times, read_json
from tests.prefect.prefect_api import flow_run_artifacts, wait_for_logs

pytestmark = [pytest.mark.prefect, pytest.mark.ddp]


@pytest.fixture
def run3(lifelong_run3: FinishedRun) -> FinishedRun:
    return lifelong_run3


def _job_results(run_dir: Path) -> dict[str, dict]:
    return {str(p.parent.relative_to(run_dir / "jobs")): read_json(p) for p in (run_dir / "jobs").rglob("result.json")}


def test_three_repositories_train_fisher_and_evaluate(run3: FinishedRun) -> None:
    results = _job_results(run3.run_dir)
    names = run3.summary["order"]
    keys = [f"{i:02d}-{n}" for i, n in enumerate(names)]
    # One evaluation job per repository stage (every repository seen so far, model loaded once), plus one for
    # the untrained model: T + 1 evaluation launches, not T(T+1)/2 + T.
    assert set(results) == {"untrained/evaluate-00-01-02",
                            *(f"{k}/{stage}" for k in keys for stage in ("train", "fisher")),
                            f"{keys[0]}/evaluate-00", f"{keys[1]}/evaluate-00-01", f"{keys[2]}/evaluate-00-01-02"}
    baseline = results["untrained/evaluate-00-01-02"]
    assert not baseline["checkpoint"].endswith(".ckpt")  # the untrained model is scored as it is
    assert [Path(e["dataset"]).name for e in baseline["evaluations"]] == names
    for k in keys:
        assert Path(results[f"{k}/train"]["checkpoint"]).is_file()
        assert results[f"{k}/train"]["world_size"] == 2
        fisher = results[f"{k}/fisher"]["fisher"]
        assert Path(fisher).is_file() and fisher.endswith(".safetensors")
    # Repository i trains from i-1's newest checkpoint, anchored by i-1's Fisher, and that checkpoint is evaluated.
    assert [results[f"{k}/train"]["ewc"] for k in keys] == [False, True, True]
    assert results[f"{keys[1]}/train"]["resumed_from"] == results[f"{keys[0]}/train"]["checkpoint"]
    assert results[f"{keys[2]}/evaluate-00-01-02"]["checkpoint"] == results[f"{keys[2]}/train"]["checkpoint"]
    epochs = [results[f"{k}/train"]["epoch"] for k in keys]
    assert epochs == sorted(epochs) and len(set(epochs)) == 3

    summary = run3.summary
    assert [r["repository"] for r in summary["rows"]] == names
    matrix = summary["matrix"]  # lower triangular, in percent
    assert [[v is not None for v in row] for row in matrix] == [[True, False, False], [True, True, False],
                                                                [True, True, True]]
    assert all(0.0 <= v <= 100.0 for row in matrix for v in row if v is not None)
    assert max(v for row in matrix for v in row if v is not None) > 1.0  # percent, not a fraction
    assert len(summary["baseline"]) == 3 and all(v is not None for v in summary["baseline"])
    lifelong = summary["lifelong"]
    assert {"WF5", "FM", "EBWT", "WP5", "IP", "CFR", "avg"} <= set(lifelong)
    assert lifelong["WF5"] is None  # needs more than 5 repositories
    assert all(lifelong[m] is not None for m in ("FM", "EBWT", "WP5", "IP", "CFR"))
    assert lifelong["avg"] == pytest.approx([sum(row[: i + 1]) / (i + 1) for i, row in enumerate(matrix)])
    manifest = read_json(Path(summary["manifest"]))
    stages = manifest["repos"]
    assert all(s["status"] == "done" for repo in stages.values() for s in repo["stages"].values())
    # `trainer.precision: auto`: every job ran the precision the ranks chose for this CPU, and the run recorded it.
    ran = resolve_precision("auto", "cpu")
    assert {r["precision"] for r in results.values()} == {ran} == {manifest["config"]["trainer"]["precision"]}
    assert {s["result"]["precision"] for repo in stages.values() for s in repo["stages"].values()} == {ran}


def test_report_command_rebuilds_the_run_report_from_the_manifest(run3: FinishedRun) -> None:
    summary = run3.summary
    setup = run_setup(read_manifest(Path(summary["manifest"])).config)
    assert setup == f"single, curriculum, EWC 0.1, precision {resolve_precision('auto', 'cpu')}"
    expected = RunReport(summary["order"], summary["rows"], summary["matrix"], summary["baseline"],
                         setup=setup).text()
    proc = subprocess.run([sys.executable, "-m", "leanagent.cli", "report", str(run3.run_dir)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(expected.strip())
    assert "(untrained)" in proc.stdout
    # Then where the time went: a row per job in the order they ran, and one for them all.
    table = proc.stdout[proc.stdout.index("Where the time went"):].splitlines()
    assert table[1].split()[:3] == ["job", "seconds", "startup"] and "embed" in table[1].split()
    keys = [f"{i:02d}-{n}" for i, n in enumerate(summary["order"])]
    jobs = ["untrained/evaluate-00-01-02", *(f"{k}/{stage}" for i, k in enumerate(keys)
                                             for stage in ("train", "fisher", "evaluate-" + "-".join(
                                                 f"{j:02d}" for j in range(i + 1))))]
    assert [line.split()[0] for line in table[2:2 + len(jobs)]] == jobs
    assert table[2 + len(jobs)].startswith("all jobs")
    for metric in ("WF5", "FM", "EBWT", "WP5", "IP", "CFR"):
        assert metric in proc.stdout
    # The same run as a --json source of the comparison form: a 3x3 matrix and the metrics.
    out = run3.run_dir.parent / "report.json"
    two = subprocess.run([sys.executable, "-m", "leanagent.cli", "report", str(run3.run_dir), "--json", str(out)],
                         capture_output=True, text=True, timeout=60)
    assert two.returncode == 0, two.stderr
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 1 and runs[0]["FM"] == pytest.approx(summary["lifelong"]["FM"])


def test_artifacts_are_on_the_server(run3: FinishedRun) -> None:
    # The table is re-created after each repository: keep the latest version of each key.
    artifacts = {a.key: a for a in sorted(flow_run_artifacts(run3.flow_run_id), key=lambda a: a.created)}
    assert {TABLE_KEY, PROGRESS_KEY, SUMMARY_KEY} <= set(artifacts)
    table = artifacts[TABLE_KEY].data
    rows = json.loads(table) if isinstance(table, str) else table
    assert [r["repository"] for r in rows] == run3.summary["order"]
    assert {"R@1", "R@10", "MRR", "epochs", "checkpoint", "WF5", "FM", "EBWT", "WP5", "IP", "CFR"} <= set(rows[0])
    assert rows[-1]["FM"] is not None and rows[0]["FM"] is None  # the metrics after each repository
    assert float(artifacts[PROGRESS_KEY].data) == pytest.approx(100.0)
    # The description names the running stage while it runs, and says all are done at the end.
    assert (artifacts[PROGRESS_KEY].description or "").startswith("all ") and "stages done" in \
        artifacts[PROGRESS_KEY].description
    summary = str(artifacts[SUMMARY_KEY].data)
    assert "Recall@10 matrix" in summary and "EBWT" in summary and "CFR" in summary
    # The summary is published after every repository, not only at the end: one version per repository.
    versions = [a for a in flow_run_artifacts(run3.flow_run_id) if a.key == SUMMARY_KEY]
    assert len(versions) == 3


def test_rank_lines_reach_the_flow_run_logs(run3: FinishedRun) -> None:
    def both_ranks(messages: list[str]) -> bool:
        return all(any(m.startswith(f"[rank {r}] ") for m in messages) for r in (0, 1))

    messages = wait_for_logs(run3.flow_run_id, both_ranks)
    assert both_ranks(messages), f"{len(messages)} log lines, none from one of the ranks"


def test_rerun_with_nothing_new_launches_nothing(run3: FinishedRun) -> None:
    before = file_times(run3.run_dir / "jobs")
    stages_before = read_json(run3.run_dir / "manifest.json")["repos"]
    state = lifelong_retrieval(config_path=str(run3.config_path), return_state=True)
    assert state.is_completed(), state.message
    assert file_times(run3.run_dir / "jobs") == before  # no job launched, no file touched
    assert read_json(run3.run_dir / "manifest.json")["repos"] == stages_before
    assert state.result()["rows"] == run3.summary["rows"] and state.result()["nothing_new"]
    line = "nothing new: 3 repositories trained, 0 waiting"
    messages = wait_for_logs(state.state_details.flow_run_id, lambda m: line in m)
    assert line in messages
    assert not any(m.startswith("[rank ") for m in messages)


def test_changed_config_is_refused_without_touching_the_run(run3: FinishedRun, tmp_path: Path) -> None:
    raw = yaml.safe_load(run3.config_path.read_text())
    raw["lifelong"]["ewc_lambda"] = 0.5
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump(raw))
    before = file_times(run3.run_dir)
    with pytest.raises(ManifestMismatchError, match=r"lifelong\.ewc_lambda: 0\.1 -> 0\.5"):
        lifelong_retrieval(config_path=str(changed))
    after = file_times(run3.run_dir)
    after.pop(".lock", None)
    before.pop(".lock", None)
    assert after == before


def test_every_job_says_where_its_time_went(run3: FinishedRun) -> None:
    for job, result in _job_results(run3.run_dir).items():
        timings = result["timings"]
        assert timings["total"] > 0 and timings["startup"] > 0, job
        assert sum(v for k, v in timings.items() if k != "total") == pytest.approx(timings["total"], abs=0.01), job
        assert result["peak_rss_mb"] > 0, job
        expected = {"train": {"train_steps", "embed", "rank", "checkpoints"}, "fisher": {"fisher", "checkpoints"}}
        assert expected.get(job.rsplit("/", 1)[1], {"embed", "rank"}) <= set(timings), (job, timings)
        if job.endswith("/fisher"):
            assert result["premises_embedded"] == 0
    # The manifest keeps each stage's, with the wall time its launcher waited.
    manifest = read_json(run3.run_dir / "manifest.json")
    train = manifest["repos"][f"00-{run3.summary['order'][0]}"]["stages"]["train"]["result"]
    assert train["wall_seconds"] >= train["timings"]["total"]
    # LeanAgent's lifelong.checkpoint: latest, whose own validation the report shows beside the best epoch's.
    assert train["checkpoint"] == train["latest_checkpoint"]
    assert f"Recall@10_val={train['metrics']['checkpoint_Recall@10_val']:.2f}" in Path(train["checkpoint"]).name


def test_the_last_evaluation_embeds_each_shared_premise_once_and_scores_as_each_alone(
        run3: FinishedRun, tmp_path: Path) -> None:
    names = run3.summary["order"]
    last = _job_results(run3.run_dir)[f"02-{names[2]}/evaluate-00-01-02"]
    corpora = [Corpus.from_jsonl(Path(e["dataset"]) / "corpus.jsonl") for e in last["evaluations"]]
    shared = set.intersection(*({(p.path, p.code) for p in c.premises} for c in corpora))
    assert len(shared) > len(corpora[0]) // 2  # the repositories do share a dependency
    distinct = {(p.path, p.full_name, p.code) for c in corpora for p in c.premises}
    assert 0 < last["premises_embedded"] <= len(distinct) < last["premises_in_corpora"] == sum(map(len, corpora))
    # Each repository alone, in a job of its own, its whole corpus embedded as LeanAgent does.
    config = yaml.safe_load(run3.config_path.read_text())
    config["model"]["embed_premises"] = "all"
    alone_config = tmp_path / "alone.yaml"
    alone_config.write_text(yaml.safe_dump(config))
    for k, evaluation in enumerate(last["evaluations"]):
        out = tmp_path / f"alone{k}"
        proc = subprocess.run([sys.executable, "-m", "leanagent.cli", "evaluate", "--config", str(alone_config),
                               "--dataset", evaluation["dataset"], "--checkpoint", last["checkpoint"], "--out",
                               str(out)], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        alone = read_json(out / "result.json")
        assert alone["premises_embedded"] == len(corpora[k])
        got, want = evaluation["metrics"], alone["metrics"]
        assert (got["Recall@1"], got["Recall@10"], got["num_contexts"]) == \
            (want["Recall@1"], want["Recall@10"], want["num_contexts"])
        assert got["MRR"] == pytest.approx(want["MRR"], abs=1e-6)


def test_each_stage_keeps_the_index_a_server_answers_from(run3: FinishedRun) -> None:
    """Each stage's evaluation writes its model's premise index over every repository seen so far, from the
    embeddings it computed for its tests and the rest once; the lists of each extend the previous one's."""
    manifest = read_manifest(run3.run_dir / "manifest.json")
    names = run3.summary["order"]
    stages = stage_indexes(manifest)
    assert [(position, name) for position, name, _ in stages] == list(enumerate(names))
    results = _job_results(run3.run_dir)
    lists = [read_names(Path(folder)) for _, _, folder in stages]
    for earlier, later in zip(lists, lists[1:], strict=False):
        for key in ("premises", "modules"):
            assert later[key][: len(earlier[key])] == earlier[key]
    last = PremiseIndex.load(stages[-1][2])  # checked as a server loads it: digest, rows, the model's own
    assert last.meta.checkpoint == results[f"02-{names[2]}/train"]["checkpoint"]
    corpora = [Corpus.from_jsonl(Path(e["dataset"]) / "corpus.jsonl")
               for e in results[f"02-{names[2]}/evaluate-00-01-02"]["evaluations"]]
    assert set(last.files) == {path for c in corpora for path in c.paths}
    distinct = {(p.path, p.full_name, p.code) for c in corpora for p in c.premises}
    assert len(last) == len(distinct)  # the demo's repositories carry one version of each shared file
    # Nothing was embedded twice for it: the job's count is the index's premises (the tests' are among them).
    assert results[f"02-{names[2]}/evaluate-00-01-02"]["premises_embedded"] == len(last)
