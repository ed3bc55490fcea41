"""`report`: recall matrices and LeanAgent's lifelong metrics of one run, of several side by side, or of a sweep's
setups (a SWEEP_DIR: one row per setup, Table 4's way)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from leanagent.cli.common import CommandError, check_out_file


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="recall matrices and LeanAgent's lifelong metrics of runs, side by side")
    p.add_argument("sources", nargs="+", metavar="SOURCE",
                   help="a run_dir (with manifest.json), a sweep_dir (with sweep.json: its setups side by side), or a "
                        "JSON file {names, test_recall_at_10 (lower-triangular rows, percent), val_recall_at_10}")
    p.add_argument("--markdown", action="store_true", help="print markdown instead of plain text")
    p.add_argument("--json", metavar="OUT", help="write {runs: [{source, WF5, FM, EBWT, WP5, IP, CFR, composite, "
                                                 "avg, ...}]} here, in the order given")
    p.add_argument("--png", metavar="OUT", help="draw each run's recall matrix and its average/validation curves")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from leanagent.ground.atomic import write_json_atomic
    from leanagent.report import SourceError, comparison_json, comparison_text, load_run, write_png
    from leanagent.report.sweep import is_sweep
    from leanagent.run.manifest import MANIFEST_NAME

    check_out_file("--json", args.json)
    check_out_file("--png", args.png)
    if len(args.sources) == 1 and is_sweep(Path(args.sources[0])):
        return _report_sweep(args)
    try:
        runs = [load_run(source) for source in args.sources]
    except SourceError as exc:
        raise CommandError(str(exc)) from None
    only = runs[0].report if len(runs) == 1 else None
    if only is not None:  # one run_dir: its full report, as before
        manifest = Path(runs[0].source) / MANIFEST_NAME
        print(only.markdown(str(manifest)) if args.markdown else only.text())
    else:
        print(comparison_text(runs, markdown=args.markdown))
    if args.json:
        write_json_atomic(Path(args.json), comparison_json(runs))
        print(f"wrote {args.json}", file=sys.stderr)
    if args.png:
        write_png(runs, Path(args.png))
        print(f"wrote {args.png}", file=sys.stderr)
    return 0


def _report_sweep(args: argparse.Namespace) -> int:
    """A sweep_dir: its setups in one table (a setup that has not finished shown as such), and the finished setups'
    recall matrices in one picture."""
    from leanagent.ground.atomic import write_json_atomic
    from leanagent.report import SourceError, write_png
    from leanagent.report.sweep import finished_runs, load_sweep, sweep_json, sweep_text

    try:
        rows = load_sweep(args.sources[0])
    except SourceError as exc:
        raise CommandError(str(exc)) from None
    print(sweep_text(rows, markdown=args.markdown, source=args.sources[0]))
    if args.json:
        write_json_atomic(Path(args.json), sweep_json(rows))
        print(f"wrote {args.json}", file=sys.stderr)
    if args.png:
        runs = finished_runs(rows)
        if not runs:
            raise CommandError(f"--png {args.png}: no setup of {args.sources[0]} has finished; nothing to draw")
        write_png(runs, Path(args.png))
        print(f"wrote {args.png} ({len(runs)} finished setups)", file=sys.stderr)
    return 0
