"""Where a run's time went: one row per job (a training, a Fisher pass, an evaluation of several repositories), its
seconds and each part's share of them (`leanagent.ground.timings.PARTS`), and the premises it embedded.

At LeanAgent's scale a curriculum can spend more time embedding the same premises than training; this table is
where a user sees it. Read from the manifest, which records each job's `timings` with its stage (an evaluation
job's under each of its stages, as `job`, once per job here).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from leanagent.ground.results import EvaluateResult, JobResult, StageResult
from leanagent.ground.timings import LAUNCH, PARTS
from leanagent.run.manifest import EVAL_UNTRAINED, FISHER, TRAIN, ManifestRecord, eval_stage, stage_name, stage_result

TITLE = "Where the time went"
_PARTS = {p.name: p for p in (*PARTS, LAUNCH)}


@dataclass
class JobCost:
    """One job's seconds by part (with `launch`: its wall time less the ranks' total, when known), its total, and
    the premises it embedded and its evaluations' corpora hold."""

    job: str
    seconds: dict[str, float] = field(default_factory=dict)
    total: float = 0.0
    premises_embedded: int | None = None
    premises_in_corpora: int | None = None
    peak_rss_mb: float | None = None

    @classmethod
    def of(cls, job: str, result: JobResult) -> JobCost | None:
        timings = result.timings
        if timings is None or "total" not in timings:
            return None  # a job recorded before timings existed
        seconds = {k: float(v) for k, v in timings.items() if k != "total"}
        total = float(timings["total"])
        wall = result.wall_seconds
        if wall is not None and wall > total:
            seconds[LAUNCH.name] = float(wall) - total
            total = float(wall)
        return cls(job, seconds, total, result.premises_embedded, result.premises_in_corpora, result.peak_rss_mb)

    def share(self, part: str) -> float:
        return self.seconds.get(part, 0.0) / self.total if self.total else 0.0


def job_costs(manifest: ManifestRecord) -> list[JobCost]:
    """Every finished job of a run, in the order they ran: the untrained evaluation, then per repository its
    training, Fisher pass and evaluation."""
    names = list(manifest.order or [])
    costs: list[JobCost] = []
    seen: set[str] = set()

    def add(job: str, result: StageResult | None) -> None:
        if not isinstance(result, JobResult):
            return
        if isinstance(result, EvaluateResult) and result.out is not None:  # an evaluation stage: its job's cost,
            folder = Path(result.out)  # once per job, named by its folder (`untrained/evaluate-00-01`)
            job = f"{folder.parent.name}/{folder.name}"
            if job in seen:
                return
            seen.add(job)
        cost = JobCost.of(job, result)
        if cost is not None:
            costs.append(cost)

    for j, name in enumerate(names):
        add(stage_name(j, name, EVAL_UNTRAINED), stage_result(manifest, j, name, EVAL_UNTRAINED))
    for i, name in enumerate(names):
        for stage in (TRAIN, FISHER, *(eval_stage(j, names[j]) for j in range(i + 1))):
            add(stage_name(i, name, stage), stage_result(manifest, i, name, stage))
    return costs


def _columns(costs: Iterable[JobCost]) -> list[str]:
    present = {part for cost in costs for part, s in cost.seconds.items() if s > 0}
    return [p for p in _PARTS if p in present] + sorted(present - set(_PARTS))


def _short(part: str) -> str:
    return _PARTS[part].short if part in _PARTS else part


def _premises(cost: JobCost) -> str:
    if cost.premises_embedded is None or not (cost.premises_embedded or cost.premises_in_corpora):
        return "-"
    if cost.premises_in_corpora:
        return f"{cost.premises_embedded:,} of {cost.premises_in_corpora:,}"
    return f"{cost.premises_embedded:,}"


def _overall(costs: list[JobCost]) -> JobCost:
    total = JobCost("all jobs")
    for cost in costs:
        total.total += cost.total
        for part, s in cost.seconds.items():
            total.seconds[part] = total.seconds.get(part, 0.0) + s
        if cost.premises_embedded is not None:
            total.premises_embedded = (total.premises_embedded or 0) + cost.premises_embedded
            total.premises_in_corpora = (total.premises_in_corpora or 0) + (cost.premises_in_corpora or 0)
    return total


def _rows(costs: list[JobCost]) -> tuple[list[str], list[list[str]]]:
    columns = _columns(costs)
    head = ["job", "seconds", *(_short(c) for c in columns), "premises embedded (of those in corpora)"]
    body = [[c.job, f"{c.total:.1f}", *(f"{100 * c.share(p):.0f}%" for p in columns), _premises(c)]
            for c in [*costs, _overall(costs)]]
    return head, body


PREMISES_MEANING = ("premise encodings for retrieval, summed over ranks, of the premises held by the corpora they "
                    "were ranked against (what embedding each evaluation's whole corpus, as LeanAgent does, embeds)")


def _legend(costs: list[JobCost]) -> list[tuple[str, str]]:
    """(column, meaning) of each part column of the table."""
    return [(_short(p), _PARTS[p].meaning if p in _PARTS else p) for p in _columns(costs)]


def time_text(costs: list[JobCost]) -> str:
    if not costs:
        return ""
    head, body = _rows(costs)
    width = max(len(head[0]), *(len(r[0]) for r in body))
    sizes = [max(len(head[k]), *(len(r[k]) for r in body)) for k in range(1, len(head))]

    def line(cells: list[str]) -> str:
        return f"{cells[0]:<{width}} " + " ".join(f"{c:>{n}}" for c, n in zip(cells[1:], sizes, strict=True))

    key = max(len(name) for name, _ in _legend(costs))
    return "\n".join([f"{TITLE} (each job's seconds, and each part's share of them)", line(head), *map(line, body),
                      "", *(f"  {name:<{key}}  {meaning}" for name, meaning in _legend(costs)),
                      f"  premises embedded: {PREMISES_MEANING}"])


def time_summary(costs: list[JobCost]) -> str:
    """The table's last row in a sentence: all jobs' seconds, the parts by share, the premises embedded."""
    if not costs:
        return ""
    total = _overall(costs)
    shares = sorted(((total.share(p), p) for p in _columns(costs)), reverse=True)
    parts = ", ".join(f"{_short(p)} {100 * share:.0f}%" for share, p in shares if share >= 0.005)
    premises = "" if total.premises_embedded is None else f"; premises embedded: {_premises(total)}"
    return f"{TITLE}: {total.total:.1f} s in {len(costs)} jobs: {parts}{premises}"


def time_markdown(costs: list[JobCost]) -> str:
    if not costs:
        return ""
    head, body = _rows(costs)
    table = "| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n"
    table += "".join("| " + " | ".join(row) + " |\n" for row in body)
    legend = "".join(f"- **{name}**: {meaning}\n" for name, meaning in _legend(costs))
    return (f"## {TITLE}\n\nEach job's seconds, and each part's share of them.\n\n{table}\n{legend}"
            f"- **premises embedded**: {PREMISES_MEANING}\n")
