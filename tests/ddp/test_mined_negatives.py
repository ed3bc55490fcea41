"""`data.negatives: mined` on 2 gloo ranks: every rank holds the same mined table, and a resumed job mines and
trains exactly as an uninterrupted one, bit for bit (the machinery of `test_resume.py`: real `leanagent train`,
torchrun, a fault injected at an exact point)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from .conftest import leanagent
from .test_resume import EPOCHS, EVERY, _epoch_files, _interrupted, _losses, _ok, _steps, _weights

pytestmark = pytest.mark.ddp

PROBE = textwrap.dedent('''
    """Under torchrun: each rank perturbs its copy of the model differently, embeds the corpus and mines."""
    import sys
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from leanagent.ground.config import DataConfig, TrainerConfig
    from leanagent.data.datamodule import RetrievalDataModule
    from leanagent.model.evaluation import CorpusEmbedding
    from leanagent.model.mining import mine_table
    from leanagent.model.options import RetrieverOptions
    from leanagent.model.retriever import PremiseRetriever
    from leanagent.train.trainer import init_process_group

    model_dir, repo, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    init_process_group(TrainerConfig(accelerator="cpu", devices=2, precision="32-true"))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = PremiseRetriever(RetrieverOptions(name_or_path=model_dir, max_seq_len=96)).eval()
    with torch.no_grad():  # ranks whose models differ (as float rounding may make them): one table regardless
        for p in model.parameters():
            p.add_(0.02 * rank * torch.randn_like(p))
    dm = RetrievalDataModule(repo, model.tokenizer, DataConfig(num_workers=0, max_seq_len=96), premise_max_len=96,
                             seed=5)
    with torch.no_grad():
        emb = model.embed_corpus(dm.corpus)
    table = mine_table(model, CorpusEmbedding.of_corpus(emb, dm.corpus), dm.corpus, dm.train_examples, 8, 96,
                       batch_size=7)
    torch.save(table, out / f"table{rank}.pt")
    dist.destroy_process_group()
''')


def test_every_rank_holds_the_same_mined_table(ddp_assets, tmp_path: Path, run_probe) -> None:
    run_probe(PROBE, tmp_path, str(ddp_assets["model"]), str(ddp_assets["repo_a"]), str(tmp_path), timeout=600)
    t0, t1 = (torch.load(tmp_path / f"table{r}.pt", weights_only=True) for r in (0, 1))
    assert t0.shape[1] == 8 and (t0 >= 0).sum() > t0.numel() // 2
    assert torch.equal(t0, t1)


@pytest.fixture(scope="module")
def mined_setup(ddp_assets, tmp_path_factory, write_cpu_config) -> dict:
    work = tmp_path_factory.mktemp("mined_resume")
    cfg = write_cpu_config(work / "cfg.yaml", encoder=ddp_assets["model"], data={"negatives": "mined", "mined_pool": 8},
                           trainer={"checkpoint_every_n_steps": EVERY},
                           lifelong={"epochs_per_repo": EPOCHS, "ewc_lambda": 0.0},
                           model={"loss": "infonce"})  # the recipe of configs/leanagent-infonce.yaml
    dataset = ddp_assets["repo_a"]
    whole = _ok(leanagent("train", "--config", str(cfg), "--dataset", str(dataset), "--out", str(work / "whole"),
                          timeout=900), work / "whole")
    return {"work": work, "cfg": cfg, "dataset": dataset, "whole": whole, "per_epoch": whole["global_step"] // EPOCHS}


def _table(path: Path) -> torch.Tensor | None:
    state = torch.load(path, map_location="cpu", weights_only=True).get("RetrievalDataModule", {})
    return state.get("mined")


def test_each_validation_mines_a_table_that_checkpoints_keep(mined_setup) -> None:
    files = _epoch_files(mined_setup["work"] / "whole")
    tables = [_table(files[name]) for name in sorted(files)]
    assert all(t is not None and t.shape[1] == 8 for t in tables)
    assert not torch.equal(tables[0], tables[-1])  # refreshed as the model trains


@pytest.mark.parametrize("fault, resume_at", [("step:E+4:SIGKILL", "E+4"), ("epoch_start:2:SIGKILL", "2*E")])
def test_a_resumed_mined_job_trains_exactly_as_an_uninterrupted_one(mined_setup, fault: str, resume_at: str) -> None:
    per_epoch, whole_dir = mined_setup["per_epoch"], mined_setup["work"] / "whole"
    where, at, how = fault.split(":")
    job = mined_setup["work"] / f"{where}-{at.replace('*', 'x')}"
    stopped = _interrupted(mined_setup["cfg"], mined_setup["dataset"], job, f"{where}:{_steps(at, per_epoch)}:{how}")
    assert stopped.returncode != 0 and not (job / "result.json").exists(), stopped.stderr[-3000:]
    resumed = _ok(leanagent("train", "--config", str(mined_setup["cfg"]), "--dataset", str(mined_setup["dataset"]),
                            "--out", str(job), timeout=900), job)
    expected_step = _steps(resume_at, per_epoch)
    assert resumed["start_global_step"] == expected_step
    whole, losses = _losses(whole_dir), _losses(job)
    assert losses == {step: loss for step, loss in whole.items() if step >= expected_step}
    for name, path in _epoch_files(whole_dir).items():
        mine, theirs = _weights(_epoch_files(job)[name]), _weights(path)
        assert all(torch.equal(mine[k], theirs[k]) for k in mine), name
        assert torch.equal(_table(_epoch_files(job)[name]), _table(path)), name
    assert resumed["history"] == mined_setup["whole"]["history"]
    assert json.dumps(resumed["metrics"]) == json.dumps(mined_setup["whole"]["metrics"])
