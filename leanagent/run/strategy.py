"""What repository i of a lifelong run trains and computes its Fisher on: `lifelong.dataset_strategy`, an entry of
the table `leanagent.data.strategies.DATASET_STRATEGIES`.

- `single` (LeanAgent's main setup): repository i itself.
- `merge_all`: the merge of repositories 0..i in curriculum order (`leanagent.data.merge`, LeanAgent's rules).
- `replay`: that merge with `lifelong.replay_fraction` of each earlier repository's training theorems, drawn from the
  run's seed, the stage and the repositories' content (`leanagent.data.replay`).

A merging strategy's dataset is written once per repository under `run_dir/merged/NN-name/` and recorded in the
manifest as the stage `NN-name/merge`, with the SHA-256 of every file it read and wrote (and, under replay, each
draw's key and counts; `merge.json` beside the dataset lists the positions drawn).

Why recorded: a lifelong run takes days and reruns resume it. A rerun reuses each recorded merge after checking
that its inputs and its own files are unchanged; a changed input (a repository's corpus or split edited since)
refuses the run as a changed config does, since resuming would train later repositories on other data than
the earlier ones. Every merge is written (and validated) before the first job, so a problem with the last one
costs seconds, not the training of the others. Evaluation is unaffected: each repository is scored on its own
test split under every strategy, so the recall matrix means the same thing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from leanagent.data.errors import DatasetError
from leanagent.data.merge import MERGE_FILE, dataset_files, digests, merge_datasets
from leanagent.data.replay import Draw, replay_key
from leanagent.data.strategies import DATASET_STRATEGIES
from leanagent.data.validate import validate_dataset
from leanagent.ground.atomic import format_bytes
from leanagent.ground.config import PipelineConfig
from leanagent.ground.json_files import MIB, read_json_file, validate_as
from leanagent.ground.results import MergeResult, ReplayDraw
from leanagent.preflight.checks import PreflightError, free_space
from leanagent.run.manifest import MERGE, ManifestMismatchError, repo_key, stage_name
from leanagent.run.state import RunState

MERGED_DIR = "merged"
LISTED = 20


def training_datasets(cfg: PipelineConfig, names: Sequence[str], paths: Sequence[Path], state: RunState,
                      log: Callable[[str], None] = print) -> list[Path]:
    """datasets[i]: what repository i (in curriculum order) trains and computes its Fisher on.

    Under a merging strategy, in this order, before any merge is written: the disk has room for those still to
    write, and every merge the run recorded (or wrote just before a crash) still has the inputs and the files (and
    the draws) it had. Then each merge still missing is written, validated and recorded, in the run's order."""
    strategy = DATASET_STRATEGIES[cfg.lifelong.dataset_strategy]
    if strategy.parts is None:
        return [Path(p) for p in paths]
    split = cfg.data.split
    parts = [strategy.parts(i, cfg.lifelong) for i in range(len(names))]
    sources = [[Path(paths[j]) for j, _ in stage] for stage in parts]
    stages = [stage_name(i, name, MERGE) for i, name in enumerate(names)]
    outs = [cfg.run_dir / MERGED_DIR / repo_key(i, name) for i, name in enumerate(names)]
    done = [_recorded(state, stage) for stage in stages]
    pending = [i for i, out in enumerate(outs) if done[i] is None and not out.exists()]
    free = free_space(cfg.run_dir / MERGED_DIR)
    files = dataset_files(split)
    needed = sum((p / name).stat().st_size for i in pending for p in sources[i] for name in files
                 if (p / name).is_file())
    if needed > free:
        raise PreflightError(f"disk: {cfg.run_dir / MERGED_DIR} needs up to {format_bytes(needed)} for "
                             f"{len(pending)} merged dataset(s) (lifelong.dataset_strategy: "
                             f"{cfg.lifelong.dataset_strategy}) but its filesystem has {format_bytes(free)} free; "
                             f"free some space or choose another run_dir")
    read = {Path(p): digests(Path(p), split) for p in paths}
    inputs = [{str(p): read[p] for p in group} for group in sources]
    # Each stage's draws (replay): the key of each source drawn from, from content only (leanagent.data.replay).
    draws = [[None if share is None else Draw(share, replay_key(cfg.trainer.seed, i, read[Path(paths[i])],
                                                                read[Path(paths[j])]))
              for j, share in stage] for i, stage in enumerate(parts)]
    kept = [Path(d.dataset) if d is not None else out if out.exists() else None
            for d, out in zip(done, outs, strict=True)]
    written = [digests(k, split) if k is not None else None for k in kept]
    found = [merge_record(k) if d is None and k is not None and (k / MERGE_FILE).is_file() else None
             for d, k in zip(done, kept, strict=True)]
    for i, (d, k) in enumerate(zip(done, kept, strict=True)):
        if d is not None:  # recorded: reused only if what it read and what it wrote are as they were
            _refuse_if_changed(state.path, stages[i], d, inputs[i], written[i], files)
        elif k is not None and (not found[i] or found[i].inputs != inputs[i] or found[i].outputs != written[i]
                                or _draws_of(found[i]) != _planned(sources[i], draws[i])):
            raise PreflightError(f"{k}: exists but is not a merge of {[str(p) for p in sources[i]]} that this run "
                                 f"wrote; move it away to have it rebuilt (nothing was changed)")
    return [_merged(state, stages[i], sources[i], draws[i], outs[i], split, done[i], found[i], log)
            for i in range(len(names))]


def _planned(sources: list[Path], draws: list[Draw | None]) -> dict[str, tuple[float, str]]:
    """{source: (fraction, key)} of the draws this run makes (to compare with a merge found on disk)."""
    return {str(s): (d.fraction, d.key) for s, d in zip(sources, draws, strict=True) if d is not None}


def _draws_of(info: MergeResult) -> dict[str, tuple[float, str]]:
    """{source: (fraction, key)} of a merge's draws ({} for merge_all's)."""
    return {s: (d.fraction, d.key) for s, d in info.replay.items()}


def _without_positions(info: MergeResult) -> MergeResult:
    """A merge's record in the manifest: merge.json's, less the positions drawn (merge.json keeps them; the
    output's digests pin them)."""
    if not info.replay:
        return info
    return info.model_copy(update={"replay": {s: ReplayDraw(fraction=d.fraction, key=d.key, of=d.of, kept=d.kept)
                                              for s, d in info.replay.items()}})


def _recorded(state: RunState, stage: str) -> MergeResult | None:
    """A merge stage's record (the manifest holds a merge's result under a merge stage's name, or refuses to load)."""
    done = state.stage_done(stage)
    return done if isinstance(done, MergeResult) else None


def merge_record(folder: Path, error: type[Exception] = PreflightError) -> MergeResult:
    """The `merge.json` a merge wrote into `folder`, as the merge stage records it; `error`, naming the file, for one
    that is not a merge record of ours."""
    data = read_json_file(folder / MERGE_FILE, MIB, "merge record", error)
    if isinstance(data, dict):
        data = {**data, "program": MERGE, "dataset": str(folder)}
    return validate_as(data, MergeResult, str(folder / MERGE_FILE), "merge record", error)


def _merged(state: RunState, stage: str, sources: list[Path], draws: list[Draw | None], out: Path, split: str,
            done: MergeResult | None, found: MergeResult | None, log: Callable[[str], None]) -> Path:
    """The merged dataset of one stage: reused when recorded, taken when written just before a crash (both checked
    already), else written now; validated and recorded in either of the last two cases."""
    if done is not None:
        log(f"{stage}: merged dataset {done.dataset} ({_summary(done)}) recorded in an earlier run; reused")
        return Path(done.dataset)
    info = found
    if info is not None:
        log(f"{stage}: merged dataset {out} found complete, not yet recorded; taken")
    else:
        state.start(stage)
    problems: list = []
    try:
        info = info or MergeResult.model_validate({**merge_datasets(sources, out, split, draws), "program": MERGE,
                                                   "dataset": str(out)})
        problems = validate_dataset(out, split)
    except (DatasetError, OSError) as exc:
        failure, refusal = f"{type(exc).__name__}: {exc}", [f"{stage}: merging {len(sources)} repositories into "
                                                            f"{out} failed: {exc}"]
    else:
        if found is None:
            log(f"{stage}: merged {len(sources)} repositories into {out} ({_summary(info)})")
        failure = f"{len(problems)} problem(s) in the merged dataset" if problems else None
        refusal = [f"{stage}: the merged dataset {out} of {[s.name for s in sources]} has {len(problems)} "
                   f"problem(s) (kept for `leanagent validate`); nothing was trained:",
                   *(f"  {p}" for p in problems[:LISTED]),
                   *([f"  ... and {len(problems) - LISTED} more"] if len(problems) > LISTED else [])]
    if failure is not None:
        state.fail(stage, failure)
        raise PreflightError(refusal)
    state.record(stage, _without_positions(info))
    return out


def _refuse_if_changed(manifest: Path, stage: str, done: MergeResult, inputs: dict[str, dict[str, str]],
                       written: dict[str, str] | None, files: list[str]) -> None:
    """A recorded merge is reused only if what it read and what it wrote are as they were."""
    recorded = done.inputs
    for source in sorted(recorded.keys() | inputs.keys()):
        before, now = recorded.get(source, {}), inputs.get(source, {})
        for name in files:
            if before.get(name) != now.get(name):
                raise ManifestMismatchError(
                    f"{manifest}: {stage} merged {Path(source) / name} (sha256 {_short(before.get(name))}), which "
                    f"is now sha256 {_short(now.get(name))}; resuming would train later repositories on other data. "
                    f"Restore it or choose another run_dir.")
    for name, digest in done.outputs.items():
        if (written or {}).get(name) != digest:
            raise ManifestMismatchError(
                f"{manifest}: {stage}'s merged dataset {Path(done.dataset) / name} changed since it was written "
                f"(sha256 {_short(digest)}, now {_short((written or {}).get(name))}); restore it or choose another "
                f"run_dir.")


def _summary(info: MergeResult) -> str:
    t = info.theorems or {}
    text = (f"{info.files} files, {t.get('train')}/{t.get('val')}/{t.get('test')} train/val/test theorems, "
            f"{info.duplicate_theorems} duplicate theorem(s) dropped")
    if info.corpus_conflicts:
        text += f", {info.corpus_conflicts} path(s) whose later copies differ (first kept)"
    if info.replay:
        text += ", training theorems replayed: " + ", ".join(
            f"{d.kept}/{d.of} of {Path(s).name}" for s, d in info.replay.items())
    return text


def _short(digest: str | None) -> str:
    return "missing" if digest in (None, "missing") else str(digest)[:12]
