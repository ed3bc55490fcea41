"""The programs that run inside each DDP rank: train, fisher, evaluate (`python -m leanagent.train.programs`).

Started by torchrun (a launcher in `leanagent/launch/`), never imported by a launcher. The entry point reads its
`JobRequest` back from the command line and runs its program's function (`RUNNERS`). Each creates
the process group first so that the seed's barriers (before loading data, before and after fit)
really synchronize, and rank 0 writes `JOB_DIR/result.json` atomically at the end, with where the job's
time went (`timings`, `leanagent.ground.timings`), the premises it embedded and its peak memory.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.distributed as dist

from leanagent.checkpoints.files import BadFileError, epoch_step
from leanagent.checkpoints.ours import read_fisher, save_fisher
from leanagent.data.datamodule import RetrievalDataModule, union_table
from leanagent.data.errors import DatasetError
from leanagent.ground import model_identity, supervision
from leanagent.ground.atomic import write_json_atomic
from leanagent.ground.config import PipelineConfig
from leanagent.ground.exit_fast import freeze_for_exit
from leanagent.ground.job import NEEDS_RESUME_FILE, JobRequest, beat, result_filename
from leanagent.ground.ranks import global_rank, local_rank, node_rank
from leanagent.ground.results import EvaluateResult, Evaluation, FisherResult, JobResult, Metrics, TrainResult
from leanagent.ground.timings import JobClock, peak_rss_mb
from leanagent.index.files import read_names
from leanagent.index.stage import StageIndex
from leanagent.model.fisher import fisher_estimator
from leanagent.model.loading import load_retriever
from leanagent.model.retriever import PremiseRetriever
from leanagent.train.callbacks import Heartbeat, JobTimings, MinedNegatives, StopRequested
from leanagent.train.plan import JOB_PLAN, ewc_anchor, plan_training, start_at_epoch
from leanagent.train.trainer import (
    build_eval_trainer,
    build_fisher_trainer,
    build_training_trainer,
    init_process_group,
    job_precision,
    set_nccl_environment,
)

FISHER_FILE = "fisher.safetensors"


def make_datamodule(cfg: PipelineConfig, dataset: Path, model: PremiseRetriever) -> RetrievalDataModule:
    # Training premises are cut at data.max_seq_len (1024 in LeanAgent), like contexts; the corpus is
    # embedded for retrieval at model.max_seq_len (the model's 512).
    return RetrievalDataModule(Path(dataset), model.tokenizer, cfg.data, premise_max_len=cfg.data.max_seq_len,
                               seed=cfg.trainer.seed)


# ---- train ----------------------------------------------------------------------------------

def run_train(job: JobRequest, clock: JobClock | None = None) -> TrainResult:
    """Train on the job's dataset from its checkpoint (the base model without one), EWC-anchored by its Fisher when
    `lifelong.ewc_lambda > 0`; a retry of the job resumes from its newest readable checkpoint."""
    cfg, dataset, job_dir, checkpoint, fisher = job.config, job.datasets[0], job.out, job.checkpoint, job.fisher
    clock = clock or JobClock()
    plan = plan_training(job_dir, checkpoint, cfg.lifelong.epochs_per_repo)
    if plan.unreadable and global_rank() == 0:
        for line in plan.unreadable:
            print(f"skipped unreadable checkpoint: {line}", flush=True)
        print(f"resuming from {plan.resume_from or cfg.model.name_or_path} instead", flush=True)
    model = load_retriever(cfg, Path(plan.resume_from) if plan.resume_from else None, weights=plan.from_reference)
    model.clock = clock
    if fisher is not None and cfg.lifelong.ewc_lambda > 0:
        fisher_tensors, _ = read_fisher(fisher)
        model.set_ewc(fisher_tensors, cfg.lifelong.ewc_lambda, anchor=ewc_anchor(cfg, plan))
    # A new repository starts early stopping afresh; a retry of this job keeps its patience count.
    heartbeat = Heartbeat(job_dir)
    mining = [MinedNegatives()] if cfg.data.negatives == "mined" else []
    trainer = build_training_trainer(cfg.trainer, job_dir, plan.target_epochs, [heartbeat, JobTimings(clock), *mining],
                                     resuming_this_job=plan.is_retry)
    if plan.from_reference:
        start_at_epoch(trainer, plan.start_epochs)
    trainer.strategy.barrier()  # before loading data (seed)
    if global_rank() == 0 and not (job_dir / JOB_PLAN).is_file():
        write_json_atomic(job_dir / JOB_PLAN, {"start_checkpoint": plan.start_checkpoint,
                                               "start_epochs": plan.start_epochs,
                                               "target_epochs": plan.target_epochs})
    with clock.part("data"):
        datamodule = make_datamodule(cfg, dataset, model)
    if not datamodule.val_examples:
        raise DatasetError(f"{dataset}/{cfg.data.split}/val.json: no validation example (no tactic with a premise "
                           f"found in the corpus); Recall@10_val, which selects checkpoints, cannot be computed")
    trainer.strategy.barrier()  # before fit
    started = time.monotonic()
    trainer.fit(model, datamodule=datamodule, ckpt_path=plan.ckpt_path, weights_only=True)
    trainer.strategy.barrier()  # after fit (seed)
    fit_seconds = time.monotonic() - started
    ckpt = trainer.checkpoint_callback
    # The history travels in checkpoints (it survives a retry); keep this repository's epochs only.
    history = [h for h in model.validation_history if h["epoch"] >= plan.start_epochs]

    def validated(path: str | None) -> dict:
        """The validation of the epoch a checkpoint was written at (its name starts `epoch=E-step=S-`)."""
        name = Path(path or "").name
        return next((h for h in history if name.startswith(f"epoch={h['epoch']}-step={h['step']}-")), {})

    best_metrics = validated(ckpt.best_model_path) or (history[-1] if history else {})
    latest = latest_epoch_checkpoint(ckpt)
    chosen = latest if cfg.lifelong.checkpoint == "latest" else ckpt.best_model_path
    metrics = {k: best_metrics.get(k) for k in ("Recall@1_val", "Recall@10_val", "MRR")}
    # The checkpoint the next repository starts from may not be the best epoch's: the report shows both.
    metrics["checkpoint_Recall@10_val"] = validated(chosen).get("Recall@10_val")
    # Real tokens over tokens processed (padding included) in this job's training steps; rank 0's, as loss_train.
    tokens = model.token_count_since(plan.start_epochs)
    metrics["train_token_efficiency"] = tokens.efficiency if tokens.processed else None
    return TrainResult(
        program="train",
        # What the next repository starts from and what is evaluated: LeanAgent takes the newest.
        checkpoint=chosen,
        best_checkpoint=ckpt.best_model_path,
        latest_checkpoint=latest,
        last_checkpoint=ckpt.last_model_path,
        epoch=trainer.current_epoch,
        global_step=trainer.global_step,
        world_size=trainer.world_size,
        target_epochs=plan.target_epochs,
        start_epochs=plan.start_epochs,  # epochs the start checkpoint had trained (ours or a reference's)
        resumed_from=plan.resume_from,
        # The optimizer step training (re)started at: 0 from the base model, the step of resumed_from otherwise.
        start_global_step=next((cb.start_global_step for cb in trainer.callbacks
                                if hasattr(cb, "start_global_step")), 0),
        unreadable_checkpoints=list(plan.unreadable),
        dataset=str(dataset),
        ewc=bool(fisher is not None and cfg.lifelong.ewc_lambda > 0),
        metrics=Metrics.model_validate(metrics),
        **model.compile_status(),
        history=history,
        num_train_examples=len(datamodule.train_examples),
        fit_seconds=fit_seconds,
        first_train_batch_time=heartbeat.first_train_batch_time,
    )


def latest_epoch_checkpoint(callback) -> str:
    """The checkpoint of the last epoch trained: the newest epoch file kept, else `last.ckpt` (same weights)."""
    kept = [Path(p) for p in callback.best_k_models if Path(p).is_file()]
    if kept:
        return str(max(kept, key=epoch_step))
    return callback.last_model_path


# ---- fisher ---------------------------------------------------------------------------------

def run_fisher(job: JobRequest, clock: JobClock | None = None) -> FisherResult:
    """The job's checkpoint's Fisher on its dataset, by `lifelong.fisher_estimator` (`leanagent.model.fisher.registry`):
    per_example (the empirical Fisher) or reference (LeanAgent's compute_fisher), each fitted on its own loader."""
    cfg, dataset, job_dir, checkpoint = job.config, job.datasets[0], job.out, job.checkpoint
    clock = clock or JobClock()
    estimator = fisher_estimator(cfg.lifelong.fisher_estimator)
    model = load_retriever(cfg, checkpoint)
    model.clock = clock
    module = estimator(model)
    trainer = build_fisher_trainer(cfg.trainer, job_dir, [Heartbeat(job_dir)])
    trainer.strategy.barrier()  # before loading data
    with clock.part("data"):
        loader = estimator.train_loader(make_datamodule(cfg, dataset, model), trainer.world_size)
    trainer.strategy.barrier()  # before fit
    clock.ready()
    started = time.monotonic()
    with clock.part("fisher"):
        trainer.fit(module, train_dataloaders=loader)
        trainer.strategy.barrier()  # after fit
    fit_seconds = time.monotonic() - started
    out = job_dir / FISHER_FILE
    metadata = {"dataset": str(dataset), "checkpoint": str(checkpoint), "world_size": trainer.world_size,
                **module.metadata()}
    if global_rank() == 0:
        with clock.part("checkpoints"):
            save_fisher(out, module.fisher, metadata)
    return FisherResult(program="fisher", fisher=str(out), fit_seconds=fit_seconds, **metadata)


# ---- evaluate -------------------------------------------------------------------------------

def run_evaluate(job: JobRequest, clock: JobClock | None = None) -> EvaluateResult:
    """Score one model (the job's checkpoint) on the test split of every dataset of the job, loading it once.

    The lifelong flow evaluates every repository seen so far after each one: one job (one torchrun
    start, one model load) per repository stage, not one per (model, dataset) pair. Without a
    checkpoint the base model (`model.name_or_path`) is scored: the lifelong baseline. Under
    `model.embed_premises: needed` the premises the datasets' contexts may use are embedded once, each
    distinct one once however many corpora carry it (`leanagent.model.evaluation`). With `index`, the job also
    writes the premise index of its model over the union of the index's datasets (`StageIndex`): the premises it
    embedded for the tests are not embedded again, only the rest.
    """
    cfg, datasets, job_dir, checkpoint, index = job.config, job.datasets, job.out, job.checkpoint, job.index_request()
    clock = clock or JobClock()
    model = load_retriever(cfg, checkpoint)
    model.clock = clock
    trainer = build_eval_trainer(cfg.trainer, job_dir, [Heartbeat(job_dir)])
    trainer.strategy.barrier()
    modules = []
    with clock.part("data"):
        for dataset in datasets:
            datamodule = make_datamodule(cfg, dataset, model)
            if not datamodule.test_examples:
                raise DatasetError(f"{dataset}/{cfg.data.split}/test.json: no test example (no tactic with a "
                                   f"premise found in the corpus)")
            modules.append(datamodule)
        stage = StageIndex(index.datasets, [dm.corpus for dm in modules]) if index is not None else None
        served = stage.served() if stage is not None else []
        # LeanAgent's `all`: each test embeds its whole corpus, and the index's rows are copied from theirs.
        shared = union_table(modules, "test", served) if cfg.model.embed_premises == "needed" else None
        kept = None
        if stage is not None:
            kept = shared if shared is not None else stage.table()
            model.evaluation.keep(kept)
    clock.ready()
    evaluations = []
    for k, (dataset, datamodule) in enumerate(zip(datasets, modules, strict=True)):
        if shared is not None:
            model.evaluation.share(shared, k)
        trainer.strategy.barrier()
        trainer.test(model, datamodule=datamodule, verbose=False)
        evaluations.append(Evaluation(dataset=str(dataset), metrics=Metrics.model_validate(model.eval_metrics)))
    written = None
    if stage is not None:
        embedding = model.evaluation.kept_embedding(model)  # on every rank: the rows no test embedded, if any
        if global_rank() == 0:
            with clock.part("index"):
                source = checkpoint or Path(cfg.model.name_or_path)
                meta = {"checkpoint": str(source) if checkpoint else None, "model": None if checkpoint else str(source),
                        "model_identity": model_identity.identify(source),
                        "max_seq_len": model.options.max_seq_len, "context_max_len": cfg.data.max_seq_len}
                stage.write(index.out, embedding, kept, meta,
                            read_names(index.after) if index.after else None)
        written = str(index.out)
    model.evaluation.release()
    trainer.strategy.barrier()
    result = EvaluateResult(program="evaluate", evaluations=evaluations, world_size=trainer.world_size,
                            checkpoint=str(checkpoint) if checkpoint else cfg.model.name_or_path,
                            **({"index": written} if written is not None else {}))
    return result.one(0) if len(evaluations) == 1 else result


# The rank programs, one entry each: the function a rank runs for a program of `leanagent.ground.job.PROGRAMS` (its
# spec: the command, the fields it takes, its result model). A program registered from outside the package adds its
# spec there and its function here.
Runner = Callable[[JobRequest, JobClock], JobResult]
RUNNERS: dict[str, Runner] = {"train": run_train, "fisher": run_fisher, "evaluate": run_evaluate}


# ---- entry point ----------------------------------------------------------------------------

def device_sync(cfg: PipelineConfig):
    """What the job's clock runs at each switch between parts: on a GPU, wait for the queued kernels, so that a
    part's seconds are its own work and not the previous part's."""
    if cfg.trainer.accelerator != "cpu" and torch.cuda.is_available():
        return torch.cuda.synchronize
    return None


def job_account(clock: JobClock) -> dict:
    """What result.json says about the job's cost: `timings` (rank 0's parts, seconds), the premises it embedded
    for retrieval and those its evaluations' corpora hold (both counted over all ranks), and the highest peak
    memory of any rank (collective: every rank calls it)."""
    peaks = [peak_rss_mb()]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[float | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, peaks[0])
        peaks = [float(p) for p in gathered if p is not None]
    return {"timings": clock.timings(), "premises_embedded": clock.premises_embedded,
            "premises_in_corpora": clock.premises_in_corpora, "peak_rss_mb": round(max(peaks), 1),
            **({"scoring": sorted(clock.scoring)} if clock.scoring else {})}


def main(argv: list[str] | None = None) -> None:
    clock = JobClock()  # first: the job's time is counted from this process's start (`leanagent.ground.timings`)
    supervision.start()  # record this rank's pid; end it if the launcher or torchrun dies (supervision.py)
    job = JobRequest.from_argv(argv)  # its config read from the file the launcher wrote
    cfg = job.config
    clock.sync = device_sync(cfg)
    job_dir = job.out
    job_dir.mkdir(parents=True, exist_ok=True)
    # First beat before anything that can hang (rendezvous, barriers, data loading), so the
    # launcher's watchdog also covers a rank stuck before training starts.
    beat(job_dir, f"start:{job.program}")
    # Before the process group exists: NCCL reads these when its communicators are created.
    set_nccl_environment(cfg.trainer)
    init_process_group(cfg.trainer)
    cfg.trainer.precision = job_precision(cfg.trainer)  # `auto` resolved once, alike on every rank; in result.json
    pl.seed_everything(cfg.trainer.seed, workers=True)
    refusal = job.refusal()
    if refusal is None and job.program not in RUNNERS:
        refusal = f"{job.program}: no function runs it in this rank (leanagent.train.programs.RUNNERS)"
    if refusal is not None:
        raise SystemExit(refusal)
    try:
        result = RUNNERS[job.program](job, clock)
    except StopRequested as stopped:
        # Asked to stop before a time limit: the step checkpoint is written; a rerun resumes from it.
        if global_rank() == 0:
            write_json_atomic(job_dir / NEEDS_RESUME_FILE, {"checkpoint": str(stopped), "time": time.time()})
        shutdown_process_group()
        return
    result = result.model_copy(update={"program": job.program, "precision": cfg.trainer.precision,
                                       "out": str(job_dir), **job_account(clock)})
    if local_rank() == 0:
        node = 0 if global_rank() == 0 else node_rank()
        write_json_atomic(job_dir / result_filename(node), result.as_json())
    shutdown_process_group()


def shutdown_process_group() -> None:
    """Leave together and tear the group down before the interpreter exits.

    Without it a rank that finishes first exits while gloo's threads are still alive and aborts
    ("terminate called without an active exception"), failing a job whose work was done.
    """
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run_main() -> None:
    """`main()`, with a bad input file reported as the one line that names it, not as a traceback."""
    try:
        main()
    except BadFileError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        freeze_for_exit()


if __name__ == "__main__":
    # `python -m` runs this file as `__main__`, a second copy of the module: run the module's own entry point, whose
    # `RUNNERS` is the table a program registered from outside (on import, as a `sitecustomize` does) was added to.
    from leanagent.train import programs

    programs.run_main()
