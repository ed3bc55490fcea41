"""The launcher's noise filter and progress text, on the exact lines the ranks print."""

from __future__ import annotations

from pathlib import Path

from leanagent.ground.config import PipelineConfig
from leanagent.ground.job import JobRequest
from leanagent.launch.progress_view import PlainProgress, describe
from leanagent.launch.quiet import NoiseFilter, quiet_environment, verbose
from leanagent.train.progress import batch_size

PYTREE = ("/x/pytorch_lightning/utilities/_pytree.py:21: `isinstance(treespec, LeafSpec)` is deprecated, use "
          "`isinstance(treespec, TreeSpec) and treespec.is_leaf()` instead.")
SET_VITAL = "/x/torchdata/stateful_dataloader.py:379: UserWarning: 'set_vital' is deprecated and will be removed"


def test_noise_dropped_with_its_source_line_and_nothing_else():
    f = NoiseFilter()
    assert not f.keep(0, SET_VITAL)
    assert not f.keep(0, '  torch.set_vital("Dataloader", "enabled", "True")')
    assert f.keep(0, "  indented line that follows a kept line")
    assert not f.keep(1, PYTREE)
    assert f.keep(1, "Epoch 0: something else")
    assert f.keep(0, "/x/model_checkpoint.py:566: The dirpath has changed")
    assert NoiseFilter(enabled=False).keep(0, PYTREE)
    # Copied from the demo's output.
    assert not f.keep(0, "Loading weights: 100%|██████████| 21/21 [00:00<00:00, 15002.62it/s]")
    assert not f.keep(0, "")
    assert not f.keep(0, "/x/pytorch_lightning/core/optimizer.py:183: `LightningModule.configure_optimizers` "
                         "returned `None`, this fit will run with no optimizer")
    assert not f.keep(0, "/x/result.py:433: It is recommended to use `self.log('loss_train', ..., sync_dist=True)` "
                         "when logging on epoch level in distributed setting to accumulate the metric across devices.")
    assert f.keep(0, "It is recommended to use `self.log('Recall@10_val', ..., sync_dist=True)`")


def test_verbose_and_omp_environment():
    assert verbose({"LEANAGENT_VERBOSE": "1"}) and not verbose({}) and not verbose({"LEANAGENT_VERBOSE": "0"})
    env: dict[str, str] = {}
    quiet_environment(env, 2)
    assert env == {"OMP_NUM_THREADS": "1"}
    env = {"OMP_NUM_THREADS": "4"}
    quiet_environment(env, 2)
    assert env["OMP_NUM_THREADS"] == "4"
    env = {}
    quiet_environment(env, 1)  # torchrun sets nothing for one process: neither do we
    assert env == {}
    env = {"LEANAGENT_VERBOSE": "1"}
    quiet_environment(env, 2)
    assert "OMP_NUM_THREADS" not in env


def test_progress_text():
    p = {"stage": "train", "epoch": 2, "epochs": 5, "step": 120, "total": 400, "done": 100, "examples": 852,
         "elapsed": 10.0}
    assert describe("train repo_1", p) == "train repo_1: epoch 2/5, step 120/400 (30%), 85.2 examples/s, ETA 28s"
    assert describe("train repo_1", {**p, "stage": "validate", "epochs": None}).startswith(
        "train repo_1 (validate): step 120/400")
    # A job's name in its progress lines is its request's: the label the flow gives, or the program and datasets.
    job = JobRequest(program="evaluate", config=PipelineConfig(), datasets=(Path("/d/repo_0"), Path("/d/repo_1")),
                     out=Path("o"))
    assert job.title == "evaluate repo_0,repo_1"
    assert job.model_copy(update={"label": "evaluate PFR"}).title == "evaluate PFR"
    assert batch_size({"index": __import__("torch").zeros(8), "name": "x"}) == 8


def test_plain_progress_waits_for_its_interval():
    lines: list[str] = []
    view = PlainProgress("train r", lines.append, interval_s=3600)
    view.update({"stage": "train", "step": 1, "total": 2})
    assert lines == []
    view = PlainProgress("train r", lines.append, interval_s=1e-9)
    view.update({"stage": "train", "step": 1, "total": 2})
    assert lines == ["[progress] train r: step 1/2 (50%)"]


def test_lightnings_per_job_lines_are_dropped_only_as_printed():
    """Copied from the demo's output: the same lines in every job, kept in the rank logs, not shown."""
    f = NoiseFilter()
    for line in ("[rank: 1] Seed set to 3407", "Using bfloat16 Automatic Mixed Precision (AMP)",
                 "GPU available: False, used: False", "TPU available: False, using: 0 TPU cores",
                 "┏━━━┳━━━━━━━━━┳━━━━━━━━━━━━━━━━┳━━━━━━━━┳━━━━━━━┳━━━━━━━┓",
                 "│ 0 │ encoder │ T5EncoderModel │  106 K │ train │     0 │", "Trainable params: 106 K      ",
                 "Total estimated model params size (MB): 0.428", "Modules in eval mode: 0", "Total FLOPs: 0",
                 "`Trainer.fit` stopped: `max_epochs=9` reached.",
                 "Restored all states from the checkpoint at /r/jobs/00-a/train/checkpoints/epoch=2-step=33.ckpt",
                 "/x/model_checkpoint.py:566: The dirpath has changed from '/a' to '/b', therefore `best_model_score`, "
                 "`kth_best_model_path`, `kth_value`, `last_model_path` and `best_k_models` won't be reloaded.",
                 "/x/slurm.py:204: The `srun` command is available on your system but is not used. HINT: ..."):
        assert not f.keep(0, line), line
    for line in ("Seed set to 3407 for the negatives", "Total params of the Fisher: 3", "epoch 2 step 30 done",
                 "Using 16bit Automatic Mixed Precision (AMP)"):
        assert f.keep(0, line), line
