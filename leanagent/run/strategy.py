"""What repository i of a lifelong run trains and computes its Fisher on: `lifelong.dataset_strategy`.

- `single` (LeanAgent's main setup): repository i itself.
- `merge_all`: the merge of repositories 0..i in curriculum order (`leanagent.data.merge`, LeanAgent's rules),
  written once per repository under `run_dir/merged/NN-name/` and recorded in the manifest as the stage
  `NN-name/merge`, with the SHA-256 of every file it read and wrote.

Why recorded: a lifelong run takes days and reruns resume it. A rerun reuses each recorded merge after checking
that its inputs and its own files are unchanged; a changed input (a repository's corpus or split edited since)
refuses the run as a changed config does, since resuming would train later repositories on other data than
the earlier ones. Every merge is written (and validated) before the first job, so a problem with the last one
costs seconds, not the training of the others. Evaluation is unaffected: each repository is scored on its own
test split under both strategies, so the recall matrix means the same thing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from leanagent.data.errors import DatasetError
from leanagent.data.merge import MERGE_FILE, digests, merge_datasets
from leanagent.data.validate import validate_dataset
from leanagent.ground.atomic import read_json
from leanagent.ground.config import PipelineConfig
from leanagent.ground.names import dataset_files
from leanagent.preflight.checks import PreflightError, format_bytes, free_space
from leanagent.run.manifest import MERGE, ManifestMismatchError, repo_key, stage_name
from leanagent.run.state import RunState

MERGED_DIR = "merged"
LISTED = 20


def training_datasets(cfg: PipelineConfig, names: Sequence[str], paths: Sequence[Path], state: RunState,
                      log: Callable[[str], None] = print) -> list[Path]:
    """datasets[i]: what repository i (in curriculum order) trains and computes its Fisher on."""
    if cfg.lifelong.dataset_strategy == "single":
        return [Path(p) for p in paths]
    split = cfg.data.split
    read: dict[Path, dict[str, str]] = {}

    def inputs(i: int) -> dict[str, dict[str, str]]:
        for p in paths[: i + 1]:
            if Path(p) not in read:
                read[Path(p)] = digests(Path(p), split)
        return {str(Path(p)): read[Path(p)] for p in paths[: i + 1]}

    root = cfg.run_dir / MERGED_DIR
    pending = [i for i, name in enumerate(names) if state.stage_done(stage_name(i, name, MERGE)) is None
               and not (root / repo_key(i, name)).exists()]
    _check_disk(root, [paths[: i + 1] for i in pending], split)
    return [_merged(state, i, name, [Path(p) for p in paths[: i + 1]], root / repo_key(i, name), split, inputs(i),
                    log) for i, name in enumerate(names)]


def _merged(state: RunState, i: int, name: str, sources: list[Path], out: Path, split: str,
            inputs: dict[str, dict[str, str]], log: Callable[[str], None]) -> Path:
    stage = stage_name(i, name, MERGE)
    done = state.stage_done(stage)
    if done is not None:
        _refuse_if_changed(state, stage, done, inputs, split)
        log(f"{stage}: merged dataset {done['dataset']} ({_summary(done)}) recorded in an earlier run; reused")
        return Path(done["dataset"])
    if out.exists():  # written just before a crash, before the manifest recorded it: take it only if it is ours
        info = read_json(out / MERGE_FILE) if (out / MERGE_FILE).is_file() else None
        if not info or info.get("inputs") != inputs or info.get("outputs") != digests(out, split):
            raise PreflightError(f"{out}: exists but is not a merge of {[str(s) for s in sources]} that this run "
                                 f"wrote; move it away to have it rebuilt (nothing was changed)")
        log(f"{stage}: merged dataset {out} found complete, not yet recorded; taken")
    else:
        state.start(stage)
        try:
            info = merge_datasets(sources, out, split)
        except (DatasetError, OSError) as exc:
            state.fail(stage, f"{type(exc).__name__}: {exc}")
            raise PreflightError(f"{stage}: merging {len(sources)} repositories into {out} failed: {exc}") from None
        log(f"{stage}: merged {len(sources)} repositories into {out} ({_summary(info)})")
    problems = validate_dataset(out, split)
    if problems:
        state.fail(stage, f"{len(problems)} problem(s) in the merged dataset")
        listed = [f"  {p}" for p in problems[:LISTED]]
        more = [f"  ... and {len(problems) - LISTED} more"] if len(problems) > LISTED else []
        raise PreflightError([f"{stage}: the merged dataset {out} of {[s.name for s in sources]} has "
                              f"{len(problems)} problem(s) (kept for `leanagent validate`); nothing was trained:",
                              *listed, *more])
    state.record(stage, {**info, "dataset": str(out)})
    return out


def _refuse_if_changed(state: RunState, stage: str, done: dict[str, Any], inputs: dict[str, dict[str, str]],
                       split: str) -> None:
    """A recorded merge is reused only if what it read and what it wrote are as they were."""
    recorded = done.get("inputs", {})
    for source in sorted(recorded.keys() | inputs.keys()):
        before, now = recorded.get(source, {}), inputs.get(source, {})
        for name in dataset_files(split):
            if before.get(name) != now.get(name):
                raise ManifestMismatchError(
                    f"{state.path}: {stage} merged {Path(source) / name} (sha256 {_short(before.get(name))}), which "
                    f"is now sha256 {_short(now.get(name))}; resuming would train later repositories on other data. "
                    f"Restore it or choose another run_dir.")
    dataset = Path(done["dataset"])
    written = digests(dataset, split)
    for name, digest in done.get("outputs", {}).items():
        if written.get(name) != digest:
            raise ManifestMismatchError(
                f"{state.path}: {stage}'s merged dataset {dataset / name} changed since it was written (sha256 "
                f"{_short(digest)}, now {_short(written.get(name))}); restore it or choose another run_dir.")


def _check_disk(root: Path, pending: list[Sequence[Path]], split: str) -> None:
    """The merges still to write hold at most every input they merge: refuse before writing any if that is short."""
    needed = sum((Path(p) / name).stat().st_size for sources in pending for p in sources
                 for name in dataset_files(split) if (Path(p) / name).is_file())
    free = free_space(root)
    if needed > free:
        raise PreflightError(f"disk: {root} needs up to {format_bytes(needed)} for {len(pending)} merged dataset(s) "
                             f"(lifelong.dataset_strategy: merge_all) but its filesystem has {format_bytes(free)} "
                             f"free; free some space or choose another run_dir")


def _summary(info: dict[str, Any]) -> str:
    t = info.get("theorems", {})
    text = (f"{info.get('files')} files, {t.get('train')}/{t.get('val')}/{t.get('test')} train/val/test theorems, "
            f"{info.get('duplicate_theorems')} duplicate theorem(s) dropped")
    if info.get("corpus_conflicts"):
        text += f", {info['corpus_conflicts']} path(s) whose later copies differ (first kept)"
    return text


def _short(digest: str | None) -> str:
    return "missing" if digest in (None, "missing") else str(digest)[:12]
