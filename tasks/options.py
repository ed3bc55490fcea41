"""How the orchestration supervises jobs: retries and deadlines, kept out of the experiment's config.

These knobs change how a run is babysat, never what it computes, so they are flow parameters
and not keys of PipelineConfig (whose fingerprint guards the run_dir against mixed experiments).
Deadlines are handed to the launcher, which kills the job's whole process group: Prefect's own
`timeout_seconds` cannot interrupt a task blocked in a worker thread.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class JobOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    retries: int = Field(2, ge=0, description="retries per job; a train retry resumes from its last.ckpt")
    retry_delay_s: float = Field(10.0, ge=0, description="seconds between a failed attempt and its retry")
    train_timeout_s: float | None = Field(None, gt=0, description="deadline of one train attempt")
    fisher_timeout_s: float | None = Field(None, gt=0, description="deadline of one Fisher attempt")
    evaluate_timeout_s: float | None = Field(None, gt=0, description="deadline of one evaluation attempt")
    # With the seed's one-year collective timeout torch never notices a hung rank; this watchdog does.
    # Ranks beat at every batch and while embedding the corpus, so an hour of silence is a hang.
    heartbeat_timeout_s: float | None = Field(
        3600.0, gt=0, description="end a job whose ranks have not reported progress for this long (hung collective)")
