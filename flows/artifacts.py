"""What a lifelong run shows in the Prefect UI while it runs: a progress bar, the results table and a summary.

The table and summary are refreshed after each repository: a run of days shows its recall matrix and lifelong
metrics as they grow, not only at the end. The progress artifact moves with every stage and names the one
running, so the UI tells which job a long run is in. A continued run's artifacts cover the whole sequence, the
repositories of earlier runs included, and the summary lists the folders of `repos_dir` that were not ready.
"""

from collections.abc import Sequence
from pathlib import Path
from uuid import UUID

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from leanagent.report import RunReport

TABLE_KEY = "lifelong-retrieval-results"
PROGRESS_KEY = "lifelong-retrieval-progress"
SUMMARY_KEY = "lifelong-retrieval-summary"


def stage_count(repositories: int) -> int:
    """Untrained evaluations (one per repository), then per repository i: train, Fisher, i + 1 evaluations."""
    return repositories + 2 * repositories + repositories * (repositories + 1) // 2


class RunArtifacts:
    """The three artifacts of one flow run, under fixed keys (the UI shows the latest version of each)."""

    def __init__(self, report: RunReport, manifest: Path, not_ready: Sequence[str] = ()) -> None:
        self.report = report
        self.manifest = manifest
        self.not_ready = list(not_ready)
        self.total = stage_count(len(report.names))
        self.done: set[str] = set()
        self.progress_id: UUID = create_progress_artifact(
            progress=0.0, key=PROGRESS_KEY, description=f"0 of {self.total} stages done")

    def _publish(self, description: str) -> None:
        update_progress_artifact(self.progress_id, progress=100.0 * len(self.done) / max(1, self.total),
                                 description=description)

    def stages_running(self, names: list[str]) -> None:
        self._publish(f"running {', '.join(names)} ({len(self.done)} of {self.total} stages done)")

    def stages_done(self, names: list[str], publish: bool = True) -> None:
        """`publish=False` for stages skipped as finished: the next running stage's update counts them."""
        self.done.update(names)
        if publish:
            self._publish(f"{len(self.done)} of {self.total} stages done" if len(self.done) < self.total
                          else f"all {self.total} stages done")

    def repository_done(self) -> None:
        done, total = len(self.report.rows), len(self.report.names)
        create_table_artifact(table=self.report.rows, key=TABLE_KEY,
                              description=f"Recall per repository after training on it ({done} of {total} done)")
        publish_summary(self.report, self.manifest, self.not_ready)
        if len(self.done) >= self.total:  # a rerun that skipped every stage still ends at 100 %
            self.stages_done([])

    def nothing_new(self, line: str) -> None:
        """A run with nothing to do: the finished run's table and summary, and the progress at 100 %."""
        if self.report.rows:
            create_table_artifact(table=self.report.rows, key=TABLE_KEY, description=line)
        publish_summary(self.report, self.manifest, self.not_ready, line)
        update_progress_artifact(self.progress_id, progress=100.0, description=line)


def publish_summary(report: RunReport, manifest: Path, not_ready: Sequence[str] = (), note: str = "") -> None:
    markdown = report.markdown(str(manifest))
    if note:
        markdown += f"\n{note}\n"
    if not_ready:
        markdown += "\n## Not ready (skipped this run)\n\n" + "".join(f"- {line}\n" for line in not_ready)
    create_markdown_artifact(markdown=markdown, key=SUMMARY_KEY,
                             description="Lifelong retrieval: recall per repository, recall matrix, lifelong metrics")
