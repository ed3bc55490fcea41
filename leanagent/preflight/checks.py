"""Checks before any launch, in one place: the CLI's jobs (`leanagent.preflight.run_job.check_job`) and the
lifelong flow (`lifelong_retrieval`, before the curriculum starts) both come through here.

A refusal costs seconds; the same problem found by the ranks costs a queue wait, a GPU allocation
and a traceback. Each check returns its problems as one clear message each; `PreflightError`
carries them all. Nothing here writes anything (but a file made and removed at once, to see that the run's or the
job's folder takes files: `leanagent.ground.atomic.out_folder_problem`).

- datasets validate (`leanagent.data.validate.dataset_problems`);
- the input checkpoint and Fisher file are whole (`leanagent.checkpoints.ours`);
- the model resolves: a local folder holds a config.json, a hub id is in the local Hugging Face
  cache (or, online, its config.json can be fetched); a job starting from a checkpoint needs no model;
- the launcher (`leanagent.launch.registry`): its name, its config section, and its own checks of where the
  ranks will run (this machine's GPUs, a static rendezvous, a cluster's partitions);
- the run (or job) folder is a folder, or can be made, and takes files; its filesystem has room for the
  checkpoints and Fisher files it will keep.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from leanagent.data.validate import dataset_problems
from leanagent.ground.atomic import format_bytes, out_folder_problem
from leanagent.ground.config import PipelineConfig, RepoConfig
from leanagent.ground.job import PROGRAMS, JobInputError
from leanagent.ground.json_files import MIB, JsonFileError, read_json_file
from leanagent.launch.registry import launch_problems
from leanagent.model.options import RetrieverOptions, stored_encoder_config

# A checkpoint holds the fp32 weights (4 bytes per parameter) and AdamW's two moments (8 bytes), plus
# loop/callback state, hparams and zip records (measured: 32 KB over 12 bytes per parameter on the tiny model).
CHECKPOINT_BYTES_PER_PARAMETER = 12
CHECKPOINT_OVERHEAD = 0.02
CHECKPOINT_OVERHEAD_BYTES = 1 << 20
FISHER_BYTES_PER_PARAMETER = 4  # fp32 safetensors, one value per parameter
BEST_AND_LAST = 3  # the next repository's start, the best, last.ckpt (2 when the first two coincide)


class PreflightError(JobInputError):
    """The inputs of a job or a run were refused before anything was launched or written.

    `problems` holds one message per problem; `str()` is them, one per line.
    """

    def __init__(self, problems: str | Sequence[str]) -> None:
        # Accepts its own str() back, so the exception pickles (Prefect stores task exceptions).
        self.problems = problems.splitlines() if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


def _raise_if(problems: list[str]) -> None:
    if problems:
        raise PreflightError(problems)


# ---- datasets -----------------------------------------------------------------------------------

def check_unique_names(named: Sequence[tuple[str, Path]], remedy: str) -> list[str]:
    """Repository names key the curriculum and the job folders: two sharing one would share both."""
    seen: dict[str, Path] = {}
    problems = []
    for name, path in named:
        if name in seen:
            problems.append(f"two repositories are both named {name!r} ({seen[name]} and {path}); {remedy}")
        seen.setdefault(name, path)
    return problems


# ---- model --------------------------------------------------------------------------------------

def _offline() -> bool:
    from huggingface_hub import constants

    # The constant is read at import; the environment is looked at now (a caller may have just set it).
    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.is_offline_mode() or env.strip().lower() in {"1", "on", "yes", "true"}


def _looks_like_path(name: str) -> bool:
    """Hub ids are `name` or `owner/name`; anything else with a separator, a dot prefix or a ~ is a path."""
    return (os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1 or "\\" in name
            or name.endswith("/"))


def resolve_model(name_or_path: str) -> tuple[dict[str, Any] | None, str | None]:
    """(the model's config.json, None) when it resolves without a download; (None, message) otherwise."""
    key = "model.name_or_path"
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            return None, (f"{key} {path}: a folder without config.json, not a saved model; point it at a folder "
                          f"written by save_pretrained (e.g. `leanagent init-model`) or at a hub id")
        return _read_model_config(config, key)
    if path.exists():
        return None, f"{key} {path}: a file, not a model folder (a folder with config.json) or a hub id"
    if _looks_like_path(name_or_path):
        return None, (f"{key} {name_or_path}: no such model folder; point it at a folder holding config.json, "
                      f"or at a hub id")
    from huggingface_hub import constants, try_to_load_from_cache

    cached = try_to_load_from_cache(name_or_path, "config.json")
    if isinstance(cached, str):
        return _read_model_config(Path(cached), key)
    how = (f"download it first on a machine with internet access and the same HF_HOME (`hf download "
           f"{name_or_path}`), or point {key} at a local model folder (with config.json)")
    if cached is not None:  # the cache knows the file does not exist in that repository
        return None, f"{key} {name_or_path!r}: the cached hub repository has no config.json; {how}"
    if _offline():
        return None, (f"{key} {name_or_path!r} is not a local folder and not in the Hugging Face cache "
                      f"({constants.HF_HUB_CACHE}), and the hub is offline (HF_HUB_OFFLINE); {how}")
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url

    try:
        # One request, no retries: an unreachable hub answers in one line, not after huggingface_hub's five
        # retries and their twelve log lines. Only a file the hub has is then downloaded.
        get_hf_file_metadata(hf_hub_url(name_or_path, "config.json"), retry_on_errors=False)
        return _read_model_config(Path(hf_hub_download(name_or_path, "config.json")), key)
    except Exception as exc:  # network, unknown repository, gated model: all end the same way
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        return None, (f"{key} {name_or_path!r} is not a local folder, not in the Hugging Face cache, and cannot "
                      f"be fetched from the hub ({reason}); {how}")


def _read_model_config(path: Path, key: str) -> tuple[dict[str, Any] | None, str | None]:
    try:
        config = read_json_file(Path(path), MIB, "model's config.json")
    except JsonFileError as exc:
        return None, f"{key}: {exc}"
    if not isinstance(config, dict):
        return None, f"{key}: {path} is not a JSON object"
    return config, None


def count_parameters(config: dict[str, Any] | None) -> int | None:
    """Trainable parameters of the T5 encoder a config describes, without building it (None: not a T5 config).

    Shared embedding; per layer: self-attention q, k, v, o, two RMS norms, the feed-forward (three
    matrices when gated); one relative-position bias table; the final norm.
    """
    if not config:
        return None
    try:
        d, heads, d_kv, d_ff = (int(config[k]) for k in ("d_model", "num_heads", "d_kv", "d_ff"))
        layers, vocab = int(config["num_layers"]), int(config["vocab_size"])
    except (KeyError, TypeError, ValueError):
        return None
    buckets = int(config.get("relative_attention_num_buckets", 32))
    gated = str(config.get("feed_forward_proj", "relu")).startswith("gated-")
    per_layer = 4 * d * heads * d_kv + (3 if gated else 2) * d * d_ff + 2 * d
    return vocab * d + layers * per_layer + buckets * heads + d


# ---- the launcher ------------------------------------------------------------------------------------

def check_options(cfg: PipelineConfig) -> list[str]:
    """The retriever's options as a job's ranks will build them (a loss of the losses table, ...)."""
    try:
        RetrieverOptions.from_config(cfg)
    except ValidationError as exc:
        return [f"model.{err['loc'][0]}: {err['msg'].removeprefix('Value error, ')}" for err in exc.errors()]
    return []


def check_launcher(cfg: PipelineConfig, device_count: int | None = None) -> list[str]:
    """The config's launcher, by the registry (leanagent/launch/registry.py): its name and section, then its own
    preflight of where the ranks will run (this machine's GPUs, a cluster's partitions).

    `device_count` stands in for the GPUs torch sees here; torch is asked only if the launcher wants to know.
    """
    return launch_problems(cfg, _visible_gpus if device_count is None else lambda: device_count)


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


# ---- disk -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DiskEstimate:
    parameters: int
    checkpoints: int  # held at the same time, at the peak
    fishers: int
    already_written: int = 0  # bytes of those files already there (a rerun, a retry)

    @property
    def checkpoint_bytes(self) -> int:
        raw = self.parameters * CHECKPOINT_BYTES_PER_PARAMETER
        return int(raw * (1 + CHECKPOINT_OVERHEAD)) + CHECKPOINT_OVERHEAD_BYTES

    @property
    def fisher_bytes(self) -> int:
        return self.parameters * FISHER_BYTES_PER_PARAMETER

    @property
    def total(self) -> int:
        return self.checkpoints * self.checkpoint_bytes + self.fishers * self.fisher_bytes

    @property
    def needed(self) -> int:
        return max(0, self.total - self.already_written)


def checkpoints_per_training(cfg: PipelineConfig) -> int:
    """Files one training job holds when it ends: its epoch checkpoints (save_top_k) and last.ckpt."""
    epochs, top_k = cfg.lifelong.epochs_per_repo, cfg.trainer.save_top_k
    kept = epochs if top_k == -1 else min(top_k, epochs)
    return kept + 1


def estimate_run(cfg: PipelineConfig, parameters: int, repos: int | None = None) -> DiskEstimate:
    """The peak of a whole run of `repos` repositories (default: those `cfg.repos` lists): earlier repositories'
    kept checkpoints, the current one's all, a Fisher each."""
    repos = len(cfg.repos) if repos is None else repos
    during = checkpoints_per_training(cfg)
    after = during if cfg.lifelong.keep_checkpoints == "all" else min(BEST_AND_LAST, during)
    checkpoints = (repos - 1) * after + during if repos else 0
    return DiskEstimate(parameters, checkpoints, repos, _written(cfg.run_dir / "jobs"))


def estimate_job(cfg: PipelineConfig, program: str, out: Path, parameters: int) -> DiskEstimate:
    writes = PROGRAMS[program].writes
    if writes == "checkpoints":
        return DiskEstimate(parameters, checkpoints_per_training(cfg), 0, _written(Path(out) / "checkpoints"))
    if writes == "fisher":
        return DiskEstimate(parameters, 0, 1, _written(Path(out)))
    return DiskEstimate(parameters, 0, 0)


def _written(folder: Path) -> int:
    if not folder.is_dir():
        return 0
    return sum(p.stat().st_size for pattern in ("*.ckpt", "*.safetensors") for p in folder.rglob(pattern)
               if p.is_file())


def free_space(path: Path) -> int:
    """Free bytes on the filesystem that `path` is (or will be created) on."""
    path = Path(path).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def check_disk(estimate: DiskEstimate, where: Path, free_bytes: int | None = None, remedy: str = "") -> list[str]:
    """Refuse when `where`'s filesystem has less free space than the estimate still needs."""
    needed = estimate.needed
    if needed == 0:
        return []
    free = free_space(where) if free_bytes is None else free_bytes
    if free >= needed:
        return []
    parts = []
    if estimate.checkpoints:
        parts.append(f"{estimate.checkpoints} checkpoint(s) at once, each {format_bytes(estimate.checkpoint_bytes)} "
                     f"({estimate.parameters:,} parameters x {CHECKPOINT_BYTES_PER_PARAMETER} bytes: weights and "
                     f"AdamW state)")
    if estimate.fishers:
        parts.append(f"{estimate.fishers} Fisher file(s) of {format_bytes(estimate.fisher_bytes)}")
    written = f", less {format_bytes(estimate.already_written)} already written" if estimate.already_written else ""
    return [f"disk: {where} needs about {format_bytes(needed)} ({' + '.join(parts)}{written}) but its filesystem "
            f"has {format_bytes(free)} free; free some space or choose another folder{remedy}"]


# ---- the two entry points ---------------------------------------------------------------------------

def preflight_job(cfg: PipelineConfig, program: str, datasets: Sequence[Path], out: Path | None = None,
                  checkpoint: Path | None = None, fisher: Path | None = None, validate: bool = True,
                  free_bytes: int | None = None, device_count: int | None = None) -> None:
    """Everything one job needs, checked before it is launched; raises PreflightError listing each problem."""
    problems = check_launcher(cfg, device_count) + check_options(cfg)
    folder = out_folder_problem(out) if out is not None else None
    if folder is not None:
        problems.append(f"job folder {folder}")
    checkpoint_config: dict[str, Any] | None = None
    unknown = False  # a bad input file: what it would have told us (architecture, size) is unknown
    if checkpoint is not None:
        if not Path(checkpoint).exists():
            problems.append(f"checkpoint {checkpoint}: no such file or folder")
            unknown = True
        else:
            # Ours, or a LeanAgent/ReProver checkpoint (file or consolidated DeepSpeed folder) whose weights
            # must fit the architecture found locally.
            checkpoint_config, problem = start_checkpoint_config(Path(checkpoint), cfg.model.name_or_path)
            if problem:
                problems.append(problem)
                unknown = True
    if fisher is not None:
        if not Path(fisher).is_file():
            problems.append(f"fisher {fisher}: no such file")
        else:
            problems += fisher_problems(Path(fisher))
    model_config: dict[str, Any] | None = checkpoint_config
    if checkpoint is None:  # the job starts from model.name_or_path
        model_config, problem = resolve_model(cfg.model.name_or_path)
        if problem:
            problems.append(problem)
    parameters = count_parameters(model_config)
    if out is not None and parameters and not unknown:
        remedy = (", or keep fewer epoch checkpoints (trainer.save_top_k: 1 keeps the best and last.ckpt)"
                  if PROGRAMS[program].writes == "checkpoints" and cfg.trainer.save_top_k != 1 else "")
        problems += check_disk(estimate_job(cfg, program, Path(out), parameters), Path(out), free_bytes, remedy)
    if validate:
        problems += dataset_problems(datasets, cfg.data.split)
    _raise_if(problems)


# Reading a checkpoint or a Fisher file needs torch (~2 s of a core to import), and looking up a LeanAgent/ReProver
# checkpoint's architecture transformers too (~3 s more). These checks import them when they have such a file to
# read: a job that starts from the base model, and `leanagent run`'s checks (a bad input answered before Prefect
# starts), pay nothing; the job's ranks import both anyway.

def start_checkpoint_config(path: Path, name_or_path: str) -> tuple[dict[str, Any] | None, str | None]:
    """(the architecture a start checkpoint gives, None) or (None, the one-line problem naming the file)."""
    from leanagent.checkpoints.files import BadFileError
    from leanagent.checkpoints.foreign import is_leanagent, read_any_checkpoint

    try:
        checkpoint = read_any_checkpoint(path)
        if is_leanagent(checkpoint):  # ours store their architecture
            return stored_encoder_config(checkpoint["hyper_parameters"]), None
        from leanagent.model.loading import reference_encoder_config

        return reference_encoder_config(path, checkpoint, name_or_path), None
    except BadFileError as exc:
        return None, str(exc)


def fisher_problems(path: Path) -> list[str]:
    from leanagent.checkpoints.files import BadFileError, check_fisher

    try:
        check_fisher(path)
    except BadFileError as exc:
        return [str(exc)]
    return []


def preflight_run(cfg: PipelineConfig, repos: Sequence[RepoConfig] | None = None,
                  validate: Sequence[RepoConfig] | None = None, free_bytes: int | None = None,
                  device_count: int | None = None) -> None:
    """Everything a lifelong run needs, checked before its first job; nothing is written into run_dir.

    `repos`: every repository of the run (default `cfg.repos`); `validate`: those whose datasets are read here
    (default all; a continued run skips those it recorded with the same digests).
    """
    repos = list(cfg.repos if repos is None else repos)
    # This module's own checks first, then those of the floors below (the model's options, the launcher, the
    # datasets); the problems are listed in the order a reader fixes them: where it runs, what, on what.
    problems = []
    folder = out_folder_problem(cfg.run_dir)  # a file there, or a folder that takes no file: before any job
    if folder is not None:
        problems.append(f"run_dir {folder}")
    start = cfg.lifelong.start_checkpoint
    if start is not None and not start.exists():
        problems.append(f"lifelong.start_checkpoint: {start}: no such checkpoint file or folder")
    model_config, problem = resolve_model(cfg.model.name_or_path)  # the untrained model is scored first
    if problem:
        problems.append(problem)
    parameters = count_parameters(model_config)
    if parameters:
        remedy = ""
        if cfg.lifelong.keep_checkpoints == "all" and checkpoints_per_training(cfg) > BEST_AND_LAST:
            remedy = (f", or set lifelong.keep_checkpoints: best_and_last (keeps {BEST_AND_LAST} checkpoints per "
                      f"finished repository instead of {checkpoints_per_training(cfg)})")
        problems += check_disk(estimate_run(cfg, parameters, len(repos)), cfg.run_dir, free_bytes, remedy)
    if not repos and cfg.repos_dir is None:
        problems.append("the config lists no repository (`repos` is empty)")
    problems += check_unique_names([(r.display_name, r.path) for r in repos], "give one a distinct `name`")
    options = check_options(cfg)
    launcher = launch_problems(cfg, _visible_gpus if device_count is None else lambda: device_count)
    datasets = dataset_problems([r.path for r in (repos if validate is None else validate)], cfg.data.split)
    _raise_if(launcher + options + problems + datasets)
