"""Finished stages' results as the flow records them, for tests that write a manifest without running a job."""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter

from leanagent.ground.results import StageResult
from leanagent.run.manifest import stage_program

SCORED = {"Recall@10": 50.0}
# What each program's result holds at least (the manifest refuses a finished stage without it).
REQUIRED: dict[str, dict[str, Any]] = {
    "train": {"checkpoint": "c.ckpt"}, "fisher": {"fisher": "f.safetensors"}, "merge": {"dataset": "merged"},
    "evaluate": {"checkpoint": "c", "metrics": SCORED, "evaluations": [{"metrics": SCORED}]},
}


def finished(stage: str, **fields: Any) -> StageResult:
    """The result of the stage `stage` (`00-a/train`, `eval-00-a`, or a program's name), with `fields`."""
    program = stage_program(stage.rpartition("/")[2]) or stage
    return TypeAdapter(StageResult).validate_python({"program": program, **REQUIRED[program], **fields})
