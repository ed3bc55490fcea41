"""scripts/slowest_tests.py: docs/testing.md's table of the slowest tests, generated from a real pytest report."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("slowest_tests", REPO_ROOT / "scripts" / "slowest_tests.py")
slowest = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = slowest  # a dataclass looks its module up there
SPEC.loader.exec_module(slowest)

SUITE = '''
import time
import pytest

@pytest.fixture(scope="module")
def shared():
    time.sleep(0.3)

def test_fast():
    pass

@pytest.mark.parametrize("n", [1, 2])
def test_param(n):
    time.sleep(0.05 * n)

class TestGroup:
    def test_slow(self, shared):
        pass
'''


def test_the_table_is_written_from_a_real_report_between_the_markers(tmp_path: Path) -> None:
    tests = tmp_path / "tests" / "unit"
    tests.mkdir(parents=True)
    (tests / "test_demo.py").write_text(SUITE)
    report = tmp_path / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                    "tests/unit/test_demo.py"], cwd=tmp_path, check=True, capture_output=True, timeout=300)
    timed, total = slowest.read_report(report)
    assert {t.test for t in timed} == {"tests/unit/test_demo.py::test_fast", "tests/unit/test_demo.py::test_param[1]",
                                       "tests/unit/test_demo.py::test_param[2]",
                                       "tests/unit/test_demo.py::TestGroup::test_slow"}
    assert total >= sum(t.seconds for t in timed) * 0.9 and {t.tier for t in timed} == {"unit"}
    page = tmp_path / "testing.md"
    page.write_text(f"# Tests\n\nbefore\n{slowest.START}\nold table\n{slowest.END}\nafter\n")
    assert slowest.main([str(report), "--top", "2", "--page", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# Tests\n\nbefore\n") and text.endswith(f"{slowest.END}\nafter\n")
    assert "old table" not in text and "The 2 slowest of 4 tests" in text
    rows = [line for line in text.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    # The class's test is charged with its module fixture's 0.3 s: the slowest.
    assert rows[0].startswith("| 1 | `tests/unit/test_demo.py::TestGroup::test_slow` |")
    assert rows[1].startswith("| 2 | `tests/unit/test_demo.py::test_param[2]` |")
    page.write_text("# no markers\n")
    with pytest.raises(SystemExit, match="needs one <!-- slowest-tests --> line"):
        slowest.main([str(report), "--page", str(page)])


def test_the_page_holds_a_generated_table() -> None:
    text = (REPO_ROOT / "docs" / "testing.md").read_text()
    block = text.split(slowest.START)[1].split(slowest.END)[0]
    assert "| # | test | seconds | kind |" in block and block.count("\n| ") >= 20


def test_the_slow_list_is_rewritten_from_what_the_report_ran(tmp_path: Path) -> None:
    listed = tmp_path / "slow_tests.txt"
    listed.write_text(slowest.SLOW_HEADER + "40.0  tests/unit/test_x.py::test_skipped\n"
                      "50.0  tests/unit/test_x.py::test_now_fast\n")
    timed = [slowest.Timed("tests/unit/test_x.py::test_now_fast", 3.0),
             slowest.Timed("tests/unit/test_x.py::test_param[a b]", 31.0),
             slowest.Timed("tests/unit/test_x.py::test_fast", 0.1)]
    added, dropped = slowest.update_slow_list(listed, timed, 30.0)
    assert (added, dropped) == (["tests/unit/test_x.py::test_param[a b]"], ["tests/unit/test_x.py::test_now_fast"])
    # A test the report does not hold (skipped by `-m "not slow"`) keeps its line; a node id may hold spaces.
    assert slowest.read_slow_list(listed) == {"tests/unit/test_x.py::test_param[a b]": 31.0,
                                              "tests/unit/test_x.py::test_skipped": 40.0}
    assert listed.read_text().startswith(slowest.SLOW_HEADER)


def test_every_listed_slow_test_is_there() -> None:
    """A renamed or moved test would silently lose its mark: each listed one names a test function of its file."""
    for test in slowest.read_slow_list():
        path, _, name = test.partition("::")
        function = name.split("::")[-1].split("[")[0]
        assert f"def {function}(" in (REPO_ROOT / path).read_text(), test
