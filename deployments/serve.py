"""Serve the lifelong flow from this process: a deployment without a work pool or a worker.

For a single machine where a long-lived `python deployments/serve.py` is simpler than a work
pool. Runs are triggered from the UI or `prefect deployment run 'lifelong-retrieval/<name>'`,
or by the optional cron schedule, and execute as subprocesses of this one.

A scheduled run learns the repositories that arrived since the last one (a config with `repos_dir`, e.g.
configs/scheduled.yaml), and ends in seconds when there is none. The deployment runs one flow run at a time
(a concurrency limit of 1, ENQUEUE): a run triggered while another holds the run_dir waits for it
("AwaitingConcurrencySlot") instead of failing on the run_dir's lock. Serve one deployment per run_dir.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # `python deployments/serve.py` puts deployments/, not the root, on the path

from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy  # noqa: E402
from prefect.schedules import Cron  # noqa: E402

from leanagent.flows.lifelong import lifelong_retrieval  # noqa: E402
from leanagent.ground.config import ConfigError  # noqa: E402
from leanagent.launch.registry import load_checked_config  # noqa: E402

# Two runs of one run_dir never overlap: the second waits for the first (the lock would refuse it).
ONE_AT_A_TIME = ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config-path", help="YAML config of the scheduled runs (required with --cron)")
    parser.add_argument("--cron", help="schedule, e.g. '0 3 * * 1' (weekly); none: runs only when triggered")
    parser.add_argument("--name", default="lifelong-retrieval-served", help="deployment name")
    args = parser.parse_args(argv)
    if args.cron and not args.config_path:
        parser.error("--cron needs --config-path: a scheduled run has nobody to fill in its config")
    schedules = []
    if args.config_path:
        config_path = Path(args.config_path).resolve()
        try:
            load_checked_config(config_path)  # refuse a broken config now, not at the first scheduled run
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        if args.cron:
            # On the schedule only, not as a deployment default: a run triggered with `config` from the UI
            # would otherwise carry both and be refused.
            schedules.append(Cron(args.cron, parameters={"config_path": str(config_path)}))
    # The runner records the flow's entrypoint relative to the working directory; start runs from the root.
    os.chdir(REPO_ROOT)
    lifelong_retrieval.serve(name=args.name, schedules=schedules, tags=["leanagent"], global_limit=ONE_AT_A_TIME)
    return 0


if __name__ == "__main__":
    sys.exit(main())
