"""Before any launch: `checks.py` (every check a job or a run gets before accelerator time is spent: inputs, model,
devices, disk, a finished job folder) and `run_job.py` (`run_job`: those checks, then the configured launcher)."""
