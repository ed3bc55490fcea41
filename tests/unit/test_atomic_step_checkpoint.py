"""The atomic checkpoint writer and the step-checkpoint callback, in one process on CPU (no DDP)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from leanagent.train.trainer import AtomicCheckpointIO, DatasetEpoch, RandomState, StepCheckpoint

REPO_ROOT = Path(__file__).resolve().parents[2]


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def _temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_atomic_save_replaces_the_whole_file(tmp_path: Path) -> None:
    io, path = AtomicCheckpointIO(), tmp_path / "ckpts" / "last.ckpt"
    io.save_checkpoint({"step": 1, "w": torch.ones(3)}, path)
    io.save_checkpoint({"step": 2, "w": torch.zeros(3)}, path)
    assert _load(path)["step"] == 2 and _temporaries(path.parent) == []
    umask = os.umask(0o022)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # as a plain open() would create it, not mkstemp's 0600


def test_a_failure_mid_write_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1}, path)
    before = path.read_bytes()

    def broken(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint({"step": 2}, path)
    assert path.read_bytes() == before and _temporaries(tmp_path) == []


def test_a_crash_mid_write_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    """SIGKILL while the new checkpoint is half written: last.ckpt is still the previous one, whole; the
    writer's temporary file is left behind, matches no checkpoint name, and the next save removes it."""
    path = tmp_path / "last.ckpt"
    script = textwrap.dedent(f"""
        import os, signal, torch
        from leanagent.train.trainer import AtomicCheckpointIO
        io = AtomicCheckpointIO()
        io.save_checkpoint({{"step": 1, "w": torch.arange(1000.0)}}, {str(path)!r})
        def dying(obj, f, *args, **kwargs):
            f.write(b"PK\\x03\\x04" + bytes(100_000))
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        torch.save = dying
        io.save_checkpoint({{"step": 2, "w": torch.zeros(1000)}}, {str(path)!r})
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    ckpt = _load(path)
    assert ckpt["step"] == 1 and torch.equal(ckpt["w"], torch.arange(1000.0))
    stale = _temporaries(tmp_path)
    assert len(stale) == 1 and stale[0].startswith(".last.ckpt.") and os.path.getsize(tmp_path / stale[0]) > 100_000
    AtomicCheckpointIO().save_checkpoint({"step": 3}, path)
    assert _load(path)["step"] == 3 and _temporaries(tmp_path) == []


# ---- the callback in a real (single-process) Lightning fit ----------------------------------------

class Numbers(Dataset):
    """Item i of epoch e is (i, a value that depends on the epoch): the epoch must reach the dataset."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), float(self.epoch)])


class Toy(pl.LightningModule):
    def __init__(self, n: int = 24) -> None:
        super().__init__()
        self.n = n
        self.net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
        self.seen: list[tuple[int, list[list[float]]]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append((self.global_step, batch.tolist()))
        return self.net(batch / self.n).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        """As RetrievalDataModule.train_dataloader: the sampler's and dataset's epoch from the restored trainer."""
        ds, epoch = Numbers(self.n), self.trainer.current_epoch
        ds.set_epoch(epoch)
        sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=7)
        sampler.set_epoch(epoch)
        return StatefulDataLoader(ds, batch_size=4, sampler=sampler, drop_last=True)


class Crashed(RuntimeError):
    pass


class Crash(Callback):
    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at_step:
            raise Crashed  # after the step checkpoint of this batch, which StepCheckpoint wrote first


def _fit(folder: Path, ckpt_path: Path | None = None, crash_at: int | None = None, every_minutes=None,
         every_n_steps: int | None = 2, accumulate: int = 1) -> tuple[Toy, StepCheckpoint, list]:
    pl.seed_everything(0)
    model = Toy()
    step_ckpt = StepCheckpoint(folder, every_n_steps, every_minutes)
    saves: list = []

    class Spy(Callback):
        def setup(self, trainer, pl_module, stage) -> None:
            original = trainer.save_checkpoint

            def save(path, *args, **kwargs):
                saves.append((Path(path).name, trainer.current_epoch, trainer.global_step))
                return original(path, *args, **kwargs)

            trainer.save_checkpoint = save

    callbacks = [Spy(), ModelCheckpoint(dirpath=folder, filename="{epoch}-{step}", every_n_epochs=1, save_top_k=-1,
                                        save_last=True), step_ckpt, RandomState(), DatasetEpoch()]
    if crash_at is not None:
        callbacks.append(Crash(crash_at))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, plugins=[AtomicCheckpointIO()], callbacks=callbacks,
                         accumulate_grad_batches=accumulate)
    try:
        trainer.fit(model, ckpt_path=ckpt_path, weights_only=True)
    except Crashed:
        pass
    return model, step_ckpt, saves


def test_step_checkpoints_are_written_mid_epoch_to_the_jobs_last_ckpt(tmp_path: Path) -> None:
    model, step_ckpt, saves = _fit(tmp_path)
    # 6 batches an epoch: every 2 steps, but not on an epoch's last batch (ModelCheckpoint writes last.ckpt then).
    assert [s for s in saves if s[0] == "last.ckpt"] == [
        ("last.ckpt", 0, 2), ("last.ckpt", 0, 4), ("last.ckpt", 0, 6),
        ("last.ckpt", 1, 8), ("last.ckpt", 1, 10), ("last.ckpt", 1, 12)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0-step=6.ckpt", "epoch=1-step=12.ckpt", "last.ckpt"]
    assert step_ckpt.start_global_step == 0 and len(step_ckpt.save_seconds) == 4
    # Epoch 1's batches carry epoch 1: DatasetEpoch reached the dataset.
    assert {b[0][1] for step, b in model.seen if step >= 6} == {1.0}


def test_checkpoint_every_minutes(tmp_path: Path) -> None:
    _, step_ckpt, saves = _fit(tmp_path, every_minutes=1e-9, every_n_steps=None)
    assert [s[2] for s in saves if s[0] == "last.ckpt"] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert len(step_ckpt.save_seconds) == 10  # all but the epochs' last batches


@pytest.mark.parametrize("accumulate", [1, 2])
def test_fit_resumes_mid_epoch_with_the_same_batches_and_dropout(tmp_path: Path, accumulate: int) -> None:
    # 6 batches an epoch: with accumulate=2 that is 3 optimizer steps, and step 4 is after batch 2 of epoch 1.
    crash_at = 8 if accumulate == 1 else 4
    whole, _, _ = _fit(tmp_path / "whole", every_n_steps=1, accumulate=accumulate)
    crashed, _, _ = _fit(tmp_path / "job", crash_at=crash_at, every_n_steps=1, accumulate=accumulate)
    ckpt = _load(tmp_path / "job" / "last.ckpt")
    assert ckpt["global_step"] == crash_at and ckpt["epoch"] == 1
    [state] = [v for k, v in ckpt["callbacks"].items() if k.startswith("RandomState")]
    assert state["global_step"] == crash_at and len(state["rng_states"]) == 1
    resumed, step_ckpt, _ = _fit(tmp_path / "job", ckpt_path=tmp_path / "job" / "last.ckpt", every_n_steps=1,
                                 accumulate=accumulate)
    assert step_ckpt.start_global_step == crash_at
    done = crash_at * accumulate  # batches trained when the checkpoint was written
    assert crashed.seen == whole.seen[:done]  # the crash came right after that checkpoint
    assert resumed.seen == whole.seen[done:]  # the rest of epoch 1 only, the same examples of the same epoch
    for a, b in zip(resumed.state_dict().values(), whole.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # same dropout masks too: every RNG state was restored
