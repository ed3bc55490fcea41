"""Interrupts at exact points of a training job, for the resume tests; on PYTHONPATH, Python loads it everywhere.

It acts only in a rank (RANK is set) whose environment has LEANAGENT_TEST_FAULT=WHERE:N:SIGNAL[:JOB]:
- WHERE:N is where rank 0 stops: `step:N` after optimizer step N (the step checkpoint of that step, if
  one is due, is written), `batch:N` after training batch N of an epoch (also for the Fisher pass, which
  takes no optimizer step), `epoch_start:N` when epoch N starts (the previous epoch's checkpoints are
  written), `validation:N` at the first validation batch of epoch N, `test:N` after test batch N (an
  evaluation job), `save:N` in the middle of writing the first checkpoint at the end of epoch N (the
  epoch's own file: its temporary file is left half-written);
- JOB, when given, limits it to the job whose folder path contains it (`00-repo_0/fisher`), so that a
  whole `leanagent run` can be stopped in one chosen stage;
- SIGNAL is what it does there to the launcher (the `leanagent train|run` process, LEANAGENT_SUPERVISOR_PID):
  `SIGINT` (Ctrl-C, to that process), `SIGINT-group` (a terminal's Ctrl-C: to its whole process group) or
  `SIGKILL` (a crash). Rank 0 then waits where it is. With LEANAGENT_TEST_FAULT_MARK=FILE it first writes
  the time into FILE;
- or SIGNAL is `HOLD`: no signal; rank 0 waits there (the other ranks at their next collective), spending no
  CPU, until the file LEANAGENT_TEST_FAULT_RELEASE names exists, or, without one, the job's stop file (what
  SLURM's signal before a time limit creates), then trains on. A job that must still be running when the test
  acts is held, not made long: it is there however slow the machine.

Every rank takes SIGTERM's default action (death at once, wherever it is, like a crash), so an interrupted
job ends as soon as the launcher signals it, not after the grace period; nothing else of the job is changed:
the CLI, the launcher, torchrun, the rank program and its Trainer are the real ones, plus this one callback.
"""

import os

_SPEC = os.environ.get("LEANAGENT_TEST_FAULT", "") if "RANK" in os.environ else ""

if _SPEC:
    import signal
    import time

    import pytorch_lightning as pl

    _WHERE, _N, _SIGNAL, *_JOB = _SPEC.split(":")
    _N = int(_N)
    if _JOB and _JOB[0] not in os.environ.get("LEANAGENT_JOB_DIR", ""):
        _WHERE = "nowhere"

    def _interrupt() -> None:
        mark = os.environ.get("LEANAGENT_TEST_FAULT_MARK")
        if mark:  # when the signal went out (or the hold began), for the test to time the ending from
            with open(mark, "w") as f:
                f.write(repr(time.time()))
        if _SIGNAL == "HOLD":
            release = os.environ.get("LEANAGENT_TEST_FAULT_RELEASE") or os.environ["LEANAGENT_STOP_FILE"]
            while not os.path.exists(release):
                time.sleep(0.1)
            return
        launcher = int(os.environ["LEANAGENT_SUPERVISOR_PID"])
        if _SIGNAL == "SIGKILL":
            os.kill(launcher, signal.SIGKILL)
        elif _SIGNAL == "SIGINT-group":
            os.killpg(os.getpgid(launcher), signal.SIGINT)
        else:
            os.kill(launcher, getattr(signal, _SIGNAL))
        while True:  # until the launcher (or, after a SIGKILL, the rank's own watcher) ends this process
            time.sleep(1)

    class _Pickled:
        """Pickling it is the fault: inside torch.save, with the checkpoint's temporary file open."""

        def __reduce__(self):
            _interrupt()

    class Fault(pl.Callback):
        def __init__(self) -> None:
            self.fired = False

        def _fire(self, trainer: pl.Trainer) -> None:
            if trainer.global_rank == 0 and not self.fired:
                self.fired = True
                _interrupt()

        def on_train_start(self, trainer, pl_module) -> None:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

        def on_test_start(self, trainer, pl_module) -> None:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if (_WHERE == "step" and trainer.global_step == _N) or (_WHERE == "batch" and batch_idx == _N):
                self._fire(trainer)

        def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
            if _WHERE == "test" and batch_idx == _N:
                self._fire(trainer)

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            if _WHERE == "epoch_start" and trainer.current_epoch == _N:
                self._fire(trainer)

        def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
            if _WHERE == "validation" and trainer.current_epoch == _N and not trainer.sanity_checking:
                self._fire(trainer)

        def state_dict(self) -> dict:
            trainer = self.trainer
            if (_WHERE == "save" and trainer.global_rank == 0 and trainer.current_epoch == _N
                    and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch and not self.fired):
                self.fired = True
                return {"fault": _Pickled()}
            return {}

        def setup(self, trainer, pl_module, stage) -> None:
            self.trainer = trainer

    _init = pl.Trainer.__init__

    def _with_fault(self, *args, callbacks=None, **kwargs):
        _init(self, *args, callbacks=[*(callbacks or []), Fault()], **kwargs)

    pl.Trainer.__init__ = _with_fault
