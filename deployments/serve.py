"""Serve the lifelong flow from this process: a deployment without a work pool or a worker.

For a single machine where a long-lived `python deployments/serve.py` is simpler than a work
pool. Runs are triggered from the UI or `prefect deployment run 'lifelong-retrieval/<name>'`,
or by the optional cron schedule, and execute as subprocesses of this one.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # `python deployments/serve.py` puts deployments/, not the root, on the path

from prefect.schedules import Cron  # noqa: E402

from flows.lifelong import lifelong_retrieval  # noqa: E402
from leanagent.config import ConfigError, load_config  # noqa: E402


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
            load_config(config_path)  # refuse a broken config now, not at the first scheduled run
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        if args.cron:
            # On the schedule only, not as a deployment default: a run triggered with `config` from the UI
            # would otherwise carry both and be refused.
            schedules.append(Cron(args.cron, parameters={"config_path": str(config_path)}))
    # The runner records the flow's entrypoint relative to the working directory; start runs from the root.
    os.chdir(REPO_ROOT)
    lifelong_retrieval.serve(name=args.name, schedules=schedules, tags=["leanagent"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
