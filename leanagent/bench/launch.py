"""The bench's launch overhead: a real job, from its start to its first training step."""

from __future__ import annotations

import os
import time
from pathlib import Path

from leanagent.bench.results import LaunchFigures
from leanagent.data.synthetic import write_demo_repos
from leanagent.ground.config import PipelineConfig
from leanagent.ground.job import JobRequest
from leanagent.ground.names import TINY
from leanagent.ground.results import TrainResult
from leanagent.launch.progress_view import MODE_ENV
from leanagent.model.presets import write_random_encoder
from leanagent.preflight.run_job import run_job


def bench_launch(workdir: Path) -> LaunchFigures:
    """From the start of a real `train` job (torchrun, 1 CPU rank) to its first training batch, on the demo."""
    repo = write_demo_repos(workdir / "data", 1, seed=0)[0]
    model = write_random_encoder(workdir / "model", TINY)
    cfg = PipelineConfig.model_validate({
        "model": {"name_or_path": str(model), "max_seq_len": 128, "warmup_steps": 1},
        "data": {"num_workers": 0, "max_seq_len": 128},
        "trainer": {"accelerator": "cpu", "devices": 1, "accumulate_grad_batches": 1},
    })

    before = os.environ.get(MODE_ENV)
    os.environ[MODE_ENV] = "off"  # a measurement, not a job to watch: no bar over the bench's table
    start = time.time()
    try:
        job = JobRequest(program="train", config=cfg, datasets=(repo,), out=workdir / "job")
        result = run_job(job, on_line=lambda line: None)
    finally:
        if before is None:
            os.environ.pop(MODE_ENV, None)
        else:
            os.environ[MODE_ENV] = before
    first_batch = result.first_train_batch_time if isinstance(result, TrainResult) else None
    if first_batch is None:
        raise RuntimeError(f"{workdir / 'job'}: the training job recorded no first batch")
    return LaunchFigures(launch_overhead_s=first_batch - start,
                         launch_total_s=time.time() - start)
