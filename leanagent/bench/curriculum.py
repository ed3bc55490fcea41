"""The cost of a curriculum: where a lifelong run's time goes when its repositories share a dependency.

`bench_curriculum` writes repositories that all carry one shared dependency (as LeanAgent's nearly all carry
Mathlib) and a tiny encoder, then runs the whole curriculum twice in one sitting through `leanagent run` (the
real flow, each in its own process and run_dir): once re-embedding every corpus at every evaluation, as LeanAgent
does (`model.embed_premises: all`), once embedding each distinct premise once per job, only those its contexts
can rank (`needed`). From each run's manifest it reads every job's time by part and the premises it embedded
(`leanagent.report.timing`), and checks that both runs computed the same recall matrix.

`project_curriculum` is arithmetic, not a measurement: LeanAgent's 14 repositories on 4 GPUs, from an embedding
rate and a training step time (the bench's, on a GPU), in passes over the shared dependency and in hours.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from leanagent.bench.options import CurriculumOptions, ProjectionOptions
from leanagent.bench.results import Section
from leanagent.data.corpus import Corpus
from leanagent.data.synthetic import write_demo_repos
from leanagent.data.synthetic_scale import ScaleSpec
from leanagent.ground.names import CORPUS_FILE
from leanagent.ground.results import EvaluateResult
from leanagent.launch.progress_view import MODE_ENV
from leanagent.model.presets import write_random_encoder
from leanagent.report.timing import JobCost, job_costs
from leanagent.run.manifest import MANIFEST_NAME, ManifestRecord, read_manifest

MODES = ("all", "needed")  # model.embed_premises: LeanAgent's re-embedding, then embedding once


@dataclass
class ModeFigures:
    """One run of the curriculum under one `model.embed_premises`."""

    embed_premises: str
    jobs: int
    seconds: float  # the jobs' wall times, summed
    flow_seconds: float  # the whole `leanagent run`, its Prefect server's start included
    parts: dict[str, float]  # seconds by part, summed over the jobs
    premises_embedded: int
    corpus_passes: float  # premises embedded over one repository's corpus

    def share(self, part: str) -> float:
        return self.parts.get(part, 0.0) / self.seconds if self.seconds else 0.0


@dataclass
class CurriculumFigures(Section):
    repos: int
    dependency_premises: int
    corpus_premises: float  # one repository's corpus: the dependency and its own files (the mean)
    runs: dict[str, ModeFigures] = field(default_factory=dict)
    same_results: bool | None = None  # both runs' recall matrices, bit for bit

    def flat(self) -> dict:
        out: dict = {"curriculum_repos": self.repos, "curriculum_dependency_premises": self.dependency_premises,
                     "curriculum_corpus_premises": self.corpus_premises,
                     "curriculum_same_results": self.same_results}
        for mode, run in self.runs.items():
            out.update({f"curriculum_{mode}_{key}": value for key, value in (
                ("seconds", run.seconds), ("flow_seconds", run.flow_seconds), ("jobs", run.jobs),
                ("premises_embedded", run.premises_embedded), ("corpus_passes", run.corpus_passes))})
            out.update({f"curriculum_{mode}_{part}_s": s for part, s in run.parts.items()})
        return out


def _config(work: Path, data: list[Path], model: Path, options: CurriculumOptions, mode: str) -> Path:
    """The demo's trainer (bf16-mixed, 2 CPU ranks by default), LeanAgent's one epoch per repository, in run_dir
    runs/MODE."""
    cfg = {
        "launcher": options.launcher,
        "model": {"name_or_path": str(model), "lr": 2e-3, "warmup_steps": 10, "max_seq_len": 256,
                  "embed_premises": mode},
        "data": {"batch_size": 8, "eval_batch_size": 32, "max_seq_len": 256, "num_workers": 0},
        "trainer": {"accelerator": options.accelerator, "devices": options.devices, "precision": "bf16-mixed",
                    "accumulate_grad_batches": 1},
        "lifelong": {"epochs_per_repo": options.epochs, "ewc_lambda": 0.1},
        "run_dir": str(work / "runs" / mode),
        "repos": [{"path": str(p)} for p in data],
    }
    path = work / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _run(config: Path, log: Path) -> float:
    """`leanagent run --config CONFIG` in its own process (the real flow); its wall time."""
    env = {**os.environ, MODE_ENV: "off"}
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, "-m", "leanagent.cli", "run", "--config", str(config)], stdout=out,
                              stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"the curriculum run of {config} failed (exit {proc.returncode}); see {log}")
    return time.monotonic() - start


def _figures(mode: str, manifest: ManifestRecord, flow_seconds: float, corpus_premises: float) -> ModeFigures:
    costs: list[JobCost] = job_costs(manifest)
    parts: dict[str, float] = {}
    for cost in costs:
        for part, s in cost.seconds.items():
            parts[part] = parts.get(part, 0.0) + s
    embedded = sum(c.premises_embedded or 0 for c in costs)
    return ModeFigures(mode, len(costs), sum(c.total for c in costs), flow_seconds, parts, embedded,
                       embedded / corpus_premises)


def bench_curriculum(options: CurriculumOptions) -> CurriculumFigures:
    with tempfile.TemporaryDirectory(prefix="leanagent-curriculum-") as tmp:
        work = Path(options.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        dependency = ScaleSpec(files=options.dependency_files, premises=options.dependency_premises)
        data = write_demo_repos(work / "data", options.repos, theorems_per_repo=options.theorems, scale=2,
                                dependency=dependency)
        model = write_random_encoder(work / "model", options.preset)
        corpus_premises = sum(len(Corpus.from_jsonl(d / CORPUS_FILE)) for d in data) / len(data)
        figures = CurriculumFigures(options.repos, options.dependency_premises, corpus_premises)
        matrices = []
        for mode in MODES:
            config = _config(work, data, model, options, mode)
            flow_seconds = _run(config, work / f"{mode}.log")
            manifest = read_manifest(work / "runs" / mode / MANIFEST_NAME)
            figures.runs[mode] = _figures(mode, manifest, flow_seconds, corpus_premises)
            matrices.append(_recalls(manifest))
        figures.same_results = matrices[0] == matrices[1]
    return figures


def _recalls(manifest: ManifestRecord) -> list:
    """Every evaluation's metrics, stage by stage: what the two runs must agree on."""
    return [(key, stage, entry.result.metrics if isinstance(entry.result, EvaluateResult) else None)
            for key, repo in sorted(manifest.repos.items())
            for stage, entry in sorted(repo.stages.items()) if stage.startswith("eval")]


def curriculum_table(figures: CurriculumFigures) -> str:
    head = (f"curriculum: {figures.repos} repositories sharing a dependency of {figures.dependency_premises:,} "
            f"premises (each corpus {figures.corpus_premises:,.0f}); the same results in both runs: "
            f"{'yes' if figures.same_results else 'NO'}")
    parts = sorted({p for run in figures.runs.values() for p in run.parts},
                   key=lambda p: -max(run.parts.get(p, 0.0) for run in figures.runs.values()))
    lines = [head, f"  {'model.embed_premises':<22} {'jobs':>5} {'seconds':>9} {'premises embedded':>18} "
                   f"{'corpus passes':>14}  " + " ".join(f"{p:>13}" for p in parts)]
    for mode, run in figures.runs.items():
        cells = " ".join(f"{run.parts.get(p, 0.0):>7.1f} ({100 * run.share(p):>2.0f}%)" for p in parts)
        lines.append(f"  {mode:<22} {run.jobs:>5} {run.seconds:>9.1f} {run.premises_embedded:>18,} "
                     f"{run.corpus_passes:>14.2f}  {cells}")
    if set(MODES) <= set(figures.runs):
        before, after = (figures.runs[m] for m in MODES)
        embed = before.parts.get("embed", 0.0) / max(1e-9, after.parts.get("embed", 0.0))
        lines.append(f"  embedding once: {before.premises_embedded / max(1, after.premises_embedded):.2f}x fewer "
                     f"premises embedded, {embed:.2f}x less embedding time, the jobs "
                     f"{before.seconds / max(1e-9, after.seconds):.2f}x faster")
    return "\n".join(lines)


# ---- the projection --------------------------------------------------------------------------------------------

@dataclass
class Projection(Section):
    options: ProjectionOptions
    passes_before: float  # over the shared dependency, LeanAgent's re-embedding
    passes_after: float
    premises_before: float  # every premise embedded, the repositories' own included
    premises_after: float
    embed_hours_before: float
    embed_hours_after: float
    train_hours: float

    def flat(self) -> dict:
        return {f"projection_{k}": v for k, v in self.__dict__.items() if k != "options"}


def project_curriculum(options: ProjectionOptions) -> Projection:
    """Passes and hours of embedding against training, before and after embedding once.

    Before (LeanAgent): every validation embeds its corpus (repos x epochs), the untrained model is evaluated on each
    repository (repos), and after repository i every repository seen so far (i each). After: validation as before,
    one evaluation job for the untrained model and one per stage, each embedding the union once; every evaluation
    only the `needed_share` its contexts can rank."""
    n, e, dep, own, share = (options.repos, options.epochs_per_repo, options.dependency_premises,
                             options.own_premises, options.needed_share)
    validations, untrained, stages = n * e, n, n * (n + 1) // 2
    passes_before = float(validations + untrained + stages)
    passes_after = share * (validations + 1 + n)
    corpus = dep + own
    premises_before = passes_before * corpus
    # The union after repository i holds the dependency and the own premises of i repositories.
    union = [dep + own * (i + 1) for i in range(n)]
    premises_after = share * (validations * corpus + union[-1] + sum(union))
    rate = options.embed_per_s * options.gpus
    train_hours = n * options.train_examples * e * options.step_s_per_example / options.gpus / 3600
    return Projection(options, passes_before, passes_after, premises_before, premises_after,
                      premises_before / rate / 3600, premises_after / rate / 3600, train_hours)


def projection_table(p: Projection) -> str:
    o = p.options
    lines = [f"projection (arithmetic, not a measurement): {o.repos} repositories x {o.epochs_per_repo} epoch(s) on "
             f"{o.gpus} GPUs, a shared dependency of {o.dependency_premises:,} premises and {o.own_premises:,} of "
             f"each repository's own, {o.train_examples:,} training examples each; {o.embed_per_s:,.0f} premises/s "
             f"and {o.step_s_per_example} s/example per GPU",
             f"  {'':<26} {'passes over the dependency':>27} {'premises embedded':>18} {'embedding (h)':>14} "
             f"{'training (h)':>13} {'embedding share':>16}"]
    for label, passes, premises, hours in (("LeanAgent (re-embed all)", p.passes_before, p.premises_before,
                                            p.embed_hours_before),
                                           ("embedding once", p.passes_after, p.premises_after, p.embed_hours_after)):
        share = hours / (hours + p.train_hours)
        lines.append(f"  {label:<26} {passes:>27.1f} {premises:>18,.0f} {hours:>14.2f} {p.train_hours:>13.2f} "
                     f"{100 * share:>15.0f}%")
    return "\n".join(lines)
