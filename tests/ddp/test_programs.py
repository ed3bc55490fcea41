"""The rank programs end to end: real torchrun, 2 gloo ranks on CPU, a tiny ByT5 encoder, real files."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from leanagent.checkpoints.ours import epochs_completed, load_fisher, read_checkpoint
from leanagent.data.corpus import Corpus
from leanagent.data.examples import build_train_examples
from leanagent.data.theorems import load_split
from leanagent.model.dtypes import resolve_precision
from tests.conftest import TORCHRUN

from .conftest import REPO_ROOT, leanagent, shown_cli

pytestmark = pytest.mark.ddp


def _ok(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, (f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}"
                                  f"\nstderr:\n{proc.stderr[-4000:]}")
    return json.loads((Path(_out_of(proc)) / "result.json").read_text())


def _out_of(proc: subprocess.CompletedProcess) -> str:
    return proc.args[proc.args.index("--out") + 1]


@pytest.fixture
def lifelong(ddp_jobs) -> dict:
    """Repo A from the base model, its Fisher, then repo B from A's checkpoint with EWC, then evaluate (conftest)."""
    return ddp_jobs


def test_training_continues_epochs_across_repositories(lifelong):
    a, b = lifelong["a"], lifelong["b"]
    # `trainer.precision: auto`, resolved by the ranks for this CPU, recorded by every job.
    assert {lifelong[k]["precision"] for k in ("a", "fa", "b", "ev")} == {resolve_precision("auto", "cpu")}
    assert (a["epoch"], b["epoch"]) == (1, 2)
    assert a["world_size"] == b["world_size"] == 2
    assert b["global_step"] > a["global_step"]
    assert b["ewc"] is True and a["ewc"] is False
    for result in (a, b):
        assert Path(result["checkpoint"]).is_file() and Path(result["last_checkpoint"]).is_file()
        assert set(result["metrics"]) == {"Recall@1_val", "Recall@10_val", "MRR", "train_token_efficiency",
                                          "checkpoint_Recall@10_val"}
        # lifelong.checkpoint: latest (LeanAgent continues from, and evaluates, the newest checkpoint)
        assert result["checkpoint"] == result["latest_checkpoint"]
        assert Path(result["checkpoint"]).name.startswith(f"epoch={result['epoch'] - 1}-")
        assert re.search(r"Recall@10_val=\d+\.\d\d\.ckpt$", result["checkpoint"])  # percent, 2 decimals
        # The validation of the checkpoint the next repository starts from (the report shows it beside the best's).
        assert f"Recall@10_val={result['metrics']['checkpoint_Recall@10_val']:.2f}.ckpt" in result["checkpoint"]
        assert 0.0 <= result["metrics"]["Recall@1_val"] <= result["metrics"]["Recall@10_val"] <= 100.0
        assert 0.0 < result["metrics"]["train_token_efficiency"] <= 1.0
        assert result["compiled"] is False  # model.compile: auto, and these ranks are CPU ones
    # Every rank reported progress for the launcher's watchdog.
    beats = [json.loads((lifelong["work"] / "b" / "heartbeat" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [b["rank"] for b in beats] == [0, 1] and all(b["stage"] and b["time"] > 0 for b in beats)
    # The epoch count lives in the checkpoint, not in a Python variable.
    assert epochs_completed(read_checkpoint(Path(b["last_checkpoint"]))) == 2


def test_ewc_penalty_was_applied_in_the_second_repository(lifelong):
    metrics = (lifelong["work"] / "b" / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    header, *rows = metrics.splitlines()
    col = header.split(",").index("ewc_penalty")
    penalties = [float(r.split(",")[col]) for r in rows if r.split(",")[col]]
    assert penalties and penalties[0] == 0.0 and max(penalties) > 0.0


def test_fisher_file_is_a_valid_diagonal(lifelong, ddp_assets):
    fisher, meta = load_fisher(Path(lifelong["fa"]["fisher"]))
    values = torch.cat([t.flatten() for t in fisher.values()])
    assert torch.isfinite(values).all() and (values >= 0).all() and values.sum() > 0
    corpus = Corpus.from_jsonl(ddp_assets["repo_a"] / "corpus.jsonl")
    expected = len(build_train_examples(corpus, load_split(ddp_assets["repo_a"] / "random" / "train.json")))
    # Padding added so that both ranks get equal shards is not counted.
    assert meta["num_examples"] == lifelong["fa"]["num_examples"] == expected
    assert meta["world_size"] == 2 and meta["checkpoint"] == lifelong["a"]["checkpoint"]


def test_fisher_is_the_same_on_one_and_two_ranks(lifelong, ddp_assets, tmp_path, write_cpu_config, monkeypatch):
    cfg1 = write_cpu_config(tmp_path / "one.yaml", encoder=ddp_assets["model"], trainer={"devices": 1})
    # One intra-op thread, as each of the two ranks has (torchrun's rule): a lone rank's default two threads spin
    # against each other on a busy 2-core machine (its Fisher pass measured 124-195 s there, 9 s with one).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    one = _ok(leanagent("fisher", "--config", str(cfg1), "--dataset", str(ddp_assets["repo_a"]), "--checkpoint",
                        lifelong["a"]["checkpoint"], "--out", str(tmp_path / "f1")))
    f1, m1 = load_fisher(Path(one["fisher"]))
    f2, m2 = load_fisher(Path(lifelong["fa"]["fisher"]))
    assert m1["world_size"] == 1 and m2["world_size"] == 2 and m1["num_examples"] == m2["num_examples"]
    assert f1.keys() == f2.keys()
    for name in f1:
        # Equal up to fp32 summation order and thread count; a double count or a square of averaged
        # gradients would be off by a factor, not by 1e-5 of the tensor's scale.
        scale = f1[name].abs().max()
        assert (f1[name] - f2[name]).abs().max() <= 1e-3 * scale, name


def test_evaluate_reports_recall_and_mrr(lifelong):
    metrics = lifelong["ev"]["metrics"]
    assert set(metrics) >= {"Recall@1", "Recall@10", "MRR", "num_contexts"}
    assert metrics["num_contexts"] > 0
    assert 0.0 <= metrics["Recall@1"] <= metrics["Recall@10"] <= 100.0 and 0.0 < metrics["MRR"] <= 1.0
    assert lifelong["ev"]["world_size"] == 2


def test_finished_job_is_never_overwritten(lifelong):
    job = lifelong["work"] / "a"

    def files() -> dict[str, int]:
        return {str(p.relative_to(job)): p.stat().st_mtime_ns for p in job.rglob("*")}

    before = files()
    proc = leanagent("train", "--config", str(lifelong["cfg"]), "--dataset", lifelong["a"]["dataset"], "--out",
                     str(job), "--node-rank", "0")
    assert proc.returncode == 1 and "result.json exists" in proc.stderr
    assert files() == before  # nothing written, not even the job's config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_node_launch_on_localhost(ddp_assets, tmp_path, write_cpu_config):
    cfg = write_cpu_config(tmp_path / "cfg.yaml", encoder=ddp_assets["model"], launcher=TORCHRUN,
                           trainer={"devices": 1, "num_nodes": 2, "rdzv_endpoint": f"127.0.0.1:{_free_port()}"})
    nodes = [
        subprocess.Popen([sys.executable, "-m", "leanagent.cli", "train", "--config", str(cfg), "--dataset",
                          str(ddp_assets["repo_a"]), "--out", str(tmp_path / f"node{rank}"), "--node-rank", str(rank),
                          "--verbose"],  # every rank line shown, Lightning's per-job ones included
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT)
        for rank in (0, 1)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    result = json.loads((tmp_path / "node0" / "result.json").read_text())
    assert result["world_size"] == 2 and result["epoch"] == 1
    assert "[rank 1]" in outputs[1] and "[rank 0]" in outputs[0]


def test_interrupted_training_resumes_from_its_last_checkpoint(lifelong, tmp_path):
    """Repo B's job as if its attempt finished epoch 2 of 3 and died: rerunning it resumes from last.ckpt,
    runs only the missing epoch, and keeps EWC anchored to A's weights (not to the resumed ones)."""
    job = tmp_path / "job"
    shutil.copytree(lifelong["work"] / "b", job)
    (job / "result.json").unlink()
    plan = json.loads((job / "job.json").read_text())
    assert (plan["start_epochs"], plan["target_epochs"]) == (1, 2)
    (job / "job.json").write_text(json.dumps({**plan, "target_epochs": 3}))
    resumed = _ok(leanagent("train", "--config", str(lifelong["cfg"]), "--dataset", lifelong["b"]["dataset"],
                            "--checkpoint", lifelong["a"]["checkpoint"], "--fisher", lifelong["fa"]["fisher"],
                            "--out", str(job)))
    assert resumed["resumed_from"] == str(job / "checkpoints" / "last.ckpt")
    assert resumed["epoch"] == 3 and resumed["ewc"] is True
    assert [h["epoch"] for h in resumed["history"]] == [1, 2]  # epoch 1 from the first attempt, via last.ckpt
    assert resumed["metrics"]["Recall@10_val"] is not None
    header, *rows = (job / "lightning_logs" / "version_1" / "metrics.csv").read_text().splitlines()
    col = header.split(",").index("ewc_penalty")
    penalties = [float(r.split(",")[col]) for r in rows if r.split(",")[col]]
    # theta* is A's weights: the resumed weights already differ from them at the first step.
    assert penalties[0] > 0.0


def test_auto_trains_in_fp32_on_a_cpu_without_bf16_matmuls_and_says_so(ddp_assets, tmp_path, write_cpu_config):
    """The demo's shape (2 ranks, `precision: auto`) on a CPU without bf16 matmuls: ONEDNN_MAX_CPU_ISA=AVX2, oneDNN's
    own variable, makes this one such a CPU, its detection included. The job trains in 32-true, and its progress
    lines and result.json say so."""
    cfg = write_cpu_config(tmp_path / "cfg.yaml", encoder=ddp_assets["model"])
    shown = shown_cli("train", "--config", str(cfg), "--dataset", str(ddp_assets["repo_a"]), "--out",
                      str(tmp_path / "job"), ONEDNN_MAX_CPU_ISA="AVX2", LEANAGENT_PROGRESS_INTERVAL="0.2")
    assert json.loads((tmp_path / "job" / "result.json").read_text())["precision"] == "32-true"
    progress = [line for line in shown.stdout.splitlines() if line.startswith("[progress] train")]
    assert progress and all(", 32-true, " in line or line.endswith(", 32-true") for line in progress), progress


RANKS_OF_TWO_KINDS = """
import os, sys
from pathlib import Path
if os.environ["RANK"] == "1":
    os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"  # read when torch loads oneDNN: this rank's CPU has no bf16 matmuls
from leanagent.ground.config import TrainerConfig
from leanagent.train.trainer import init_process_group, job_precision
cfg = TrainerConfig(accelerator="cpu", devices=2, precision="auto")
init_process_group(cfg)
Path(sys.argv[1], f"rank{os.environ['RANK']}").write_text(job_precision(cfg))
"""


def test_ranks_whose_cpus_differ_agree_on_fp32(tmp_path, run_probe):
    """Nodes of two kinds in one job: `auto` must not run bf16 on one rank and fp32 on another; it takes 32-true,
    which neither runs slowly. (On a CPU without bf16 matmuls both ranks say so anyway.)"""
    # torchrun: rank 1 sets oneDNN's variable before its interpreter imports torch
    run_probe(RANKS_OF_TWO_KINDS, tmp_path, str(tmp_path), launcher=TORCHRUN)
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["32-true", "32-true"]
