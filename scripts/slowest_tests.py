"""Write the suite's slowest tests into docs/testing.md, and the tests `slow` marks, from a pytest run's JUnit report.

    .venv/bin/python scripts/slowest_tests.py --run [-- PYTEST_ARGS ...]   # run the suite, then write the table
    .venv/bin/python scripts/slowest_tests.py REPORT.xml [--top 20] [--page docs/testing.md] [--print]
    .venv/bin/python scripts/slowest_tests.py REPORT.xml --slow [--over 30] --print   # tests/slow_tests.txt only

Why a script: the table is a measurement, so it is generated from one run, never edited by hand, and rewritten
whole each time (between the page's `<!-- slowest-tests -->` and `<!-- /slowest-tests -->` lines). A test's time
is pytest's JUnit `time` (setup, call and teardown together), so a test whose fixture starts a shared run is
charged with it, as it is where the time goes. The run's total, the tests counted and the tier of each test (the
folder under tests/: a torchrun job, a Prefect flow, SLURM, or neither) are written with it; the date goes to the
measurements log, not here.

`--slow` also rewrites tests/slow_tests.txt, the list of tests that `slow` marks (tests/conftest.py reads it): each
test of the report over `--over` seconds is listed with its seconds, each under is dropped, and a listed test the
report does not hold keeps its line. So a run of a part re-decides only what it ran: a `-m "not slow"` run adds a
test that now pays for a shared fixture whose first user was skipped, and keeps the skipped ones listed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "testing.md"
SLOW_LIST = ROOT / "tests" / "slow_tests.txt"
SLOW_SECONDS = 30.0
SLOW_HEADER = ("# The tests `slow` marks (tests/conftest.py reads this file), each with its seconds in a run of the\n"
               "# suite: those over 30 s. Written by `scripts/slowest_tests.py REPORT.xml --slow`, not by hand; a\n"
               "# test the report does not hold keeps its line (docs/testing.md).\n")
START, END = "<!-- slowest-tests -->", "<!-- /slowest-tests -->"
# The folder under tests/ a test lives in, and what that says about its cost (`pytest -m` tiers: docs/testing.md).
TIERS = {"ddp": "torchrun", "slurm": "SLURM", "prefect": "Prefect", "serve": "server", "unit": "unit",
         "data": "unit"}


@dataclass(frozen=True)
class Timed:
    test: str  # tests/ddp/test_resume.py::test_name[param]
    seconds: float

    @property
    def tier(self) -> str:
        parts = self.test.split("/")
        return TIERS.get(parts[1], "other") if len(parts) > 2 else "other"


def read_report(path: Path) -> tuple[list[Timed], float]:
    """Every test case of a pytest JUnit report (skipped ones too: they cost their setup) and the run's seconds."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    timed = []
    for case in root.iter("testcase"):
        module = case.get("classname", "").split(".")
        # pytest names a case `tests.ddp.test_resume` + `test_x[param]` (a class adds itself to the classname).
        files = [i for i in range(len(module)) if module[i].startswith("test_")]
        cut = files[0] + 1 if files else len(module)
        test = "/".join(module[:cut]) + ".py::" + "::".join([*module[cut:], case.get("name", "")])
        timed.append(Timed(test, float(case.get("time", 0.0))))
    total = sum(float(s.get("time", 0.0)) for s in suites)
    return timed, total


def table(timed: list[Timed], total: float, top: int) -> str:
    """The markdown block written between the page's markers."""
    slowest = sorted(timed, key=lambda t: -t.seconds)[:top]
    share = sum(t.seconds for t in slowest)
    lines = [f"The {len(slowest)} slowest of {len(timed)} tests, {share / 60:.1f} of the run's {total / 60:.1f} "
             f"minutes (setup, call and teardown; a shared run is charged to the test that starts it):", "",
             "| # | test | seconds | kind |", "|---|---|---|---|"]
    lines += [f"| {i} | `{t.test}` | {t.seconds:.1f} | {t.tier} |" for i, t in enumerate(slowest, start=1)]
    return "\n".join(lines)


def read_slow_list(path: Path = SLOW_LIST) -> dict[str, float]:
    """The listed tests (pytest node ids) with their seconds; none if there is no list."""
    if not path.is_file():
        return {}
    listed = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            seconds, test = line.split(maxsplit=1)
            listed[test] = float(seconds)
    return listed


def update_slow_list(path: Path, timed: list[Timed], over: float) -> tuple[list[str], list[str]]:
    """The report's tests over `over` seconds listed, its others dropped, the rest kept; (added, dropped)."""
    listed = read_slow_list(path)
    ran = {t.test: t.seconds for t in timed}
    kept = {test: seconds for test, seconds in listed.items() if test not in ran}
    slow = {**kept, **{test: seconds for test, seconds in ran.items() if seconds > over}}
    path.write_text(SLOW_HEADER + "".join(f"{seconds:.1f}  {test}\n" for test, seconds in sorted(slow.items())))
    return sorted(set(slow) - set(listed)), sorted(set(listed) - set(slow))


def rewrite(page: Path, block: str) -> None:
    """Replace what lies between the page's markers with `block`; a page without both markers is refused."""
    text = page.read_text()
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise SystemExit(f"error: {page}: needs one {START} line and one {END} line after it")
    head, rest = text.split(START)
    _, tail = rest.split(END)
    page.write_text(f"{head}{START}\n{block}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", nargs="?", type=Path, help="a JUnit XML report of pytest (--junitxml)")
    parser.add_argument("--run", action="store_true", help="run the suite first (arguments after -- go to pytest)")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--page", type=Path, default=PAGE)
    parser.add_argument("--print", action="store_true", help="print the table; leave the page as it is")
    parser.add_argument("--slow", nargs="?", const=SLOW_LIST, type=Path, metavar="LIST",
                        help=f"also rewrite the list of slow tests ({SLOW_LIST.relative_to(ROOT)}) from the report")
    parser.add_argument("--over", type=float, default=SLOW_SECONDS, help="a test over this many seconds is slow")
    args, pytest_args = parser.parse_known_args(argv)
    pytest_args = [a for a in pytest_args if a != "--"]
    if args.run == (args.report is not None):
        parser.error("give REPORT.xml, or --run")
    with tempfile.TemporaryDirectory(prefix="slowest-tests-") as tmp:
        report = args.report
        if args.run:
            report = Path(tmp) / "report.xml"
            code = subprocess.call([sys.executable, "-m", "pytest", f"--junitxml={report}", *pytest_args], cwd=ROOT)
            if code != 0:
                print(f"note: pytest exited {code}; the table is written from the tests that ran", file=sys.stderr)
        if not report.is_file():
            raise SystemExit(f"error: {report}: no such report")
        timed, total = read_report(report)
        block = table(timed, total, args.top)
        if args.slow is not None:
            added, dropped = update_slow_list(args.slow, timed, args.over)
            print(f"{args.slow}: {len(added)} test(s) added, {len(dropped)} dropped")
    if args.print:
        print(block)
    else:
        rewrite(args.page, block)
        print(f"{args.page}: the {args.top} slowest tests written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
