"""The commands of README and of the pages under docs/ run as written, after the main job, in a fresh copy of the
repository; the pages build as a site with `mkdocs build --strict`.

The copy holds the repository's files (what a clone has) and this test's own virtual environment under `.venv`,
so the pages' `.venv/bin/...` commands and `bash scripts/demo.sh` run exactly as a user types them. Every bash
block marked `<!-- readme-test -->` is then run, in reading order: README first, then the pages in the order of
mkdocs.yml's nav, each page top to bottom. A block marked `<!-- readme-test: slurm -->` needs SLURM's daemons
(docs/slurm.md starts a two-node cluster on this machine); those run in a test of their own, skipped where
SLURM is not installed, unless LEANAGENT_REQUIRE_SLURM=1. A command that cannot run here (a real cluster, a
GPU, a server that runs until stopped, minutes of measuring) is shown unmarked; it still runs from `.venv/bin/`,
as every command of the pages, and the files the pages name exist. What the pages show of a command's output is
checked against the demo's: a server's `/health` (docs/hosting.md) and the table of jobs (docs/report.md).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from markdown.extensions.toc import slugify
from mkdocs.config import load_config

from tests.slurm.cluster import Cluster, require_slurm
from tests.waiting import wait_for

REPO_ROOT = Path(__file__).resolve().parents[1]
MARKED_BLOCK = re.compile(r"<!-- readme-test(?:: (?P<needs>[a-z]+))? -->\n```bash\n(?P<script>.*?)\n```", re.S)
# README's demo figures, one block per precision `trainer.precision: auto` can take on a CPU, each headed by the
# report's setup line. The fp32 block was the same, bit for bit, with oneDNN, MKL and torch's kernels held to AVX2 as
# with AVX-512 (2026-12-05, docs/measurements.md): it is checked exactly on every CPU. The bf16 block was recorded on
# an Intel Xeon with AMX: bf16 matmuls take other kernels, and may round otherwise, on other CPUs (an AVX2-only EPYC
# once printed repo_2's R@1 as 50.00), so elsewhere it is checked by its labels, which still come from the same code.
FIGURES_CPU = ("GenuineIntel", "amx_bf16")
EXACT_EVERYWHERE = "precision 32-true"
DEMO_LINES = 63  # "at most about 60 lines": what the main job prints, all of it (62 on its first run, with the setup)
# ... not counting its `[progress]` lines: one per stage every 30 s, so their number is the machine's speed (26 of 71
# lines on a machine twice as busy); the rest is 45.
# Commands that were tested before README became a front page, each still in some marked block.
STILL_TESTED = ["leanagent report tests/fixtures/leanagent_table4/leanagent.json",
                "leanagent export \"$CKPT\" demo/export", "leanagent index --model demo/export",
                "leanagent examples demo/data/repo_2", "leanagent retrieve demo/index-repo_2"]


def pages() -> list[Path]:
    """README, then every page of the site in nav order (a page named twice counts once)."""
    config = load_config(str(REPO_ROOT / "mkdocs.yml"))
    docs = Path(config["docs_dir"])
    order: list[Path] = []

    def walk(entries) -> None:
        for entry in entries:
            target = next(iter(entry.values())) if isinstance(entry, dict) else entry
            if isinstance(target, list):
                walk(target)
            elif (docs / target) not in order:
                order.append(docs / target)

    walk(config["nav"])
    return [REPO_ROOT / "README.md", *order]


def marked_blocks(needs: str | None) -> list[tuple[Path, str]]:
    """(page, script) of every marked block with that requirement (None: none), in reading order."""
    return [(page, m["script"]) for page in pages() for m in MARKED_BLOCK.finditer(page.read_text())
            if m["needs"] == needs]


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    copy = tmp_path_factory.mktemp("clone") / "leanagent"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    (copy / ".venv").symlink_to(Path(sys.prefix))
    return copy


def _env(clone: Path, **extra_env: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT",
                                                           "PREFECT_API_URL", "LEANAGENT_VERBOSE", "SLURM_CONF")}
    # The copy's code, not the editable install's; a Prefect home of its own for the temporary server.
    env.update(PYTHONPATH=str(clone), PREFECT_HOME=str(clone / ".prefect"), DO_NOT_TRACK="1", NO_MKDOCS_2_WARNING="1",
               **extra_env)
    (clone / ".prefect").mkdir(exist_ok=True)
    return env


def _bash(clone: Path, script: str, timeout: float, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=clone, capture_output=True, text=True,
                          timeout=timeout, env=_env(clone, **extra_env))


def _run_blocks(clone: Path, blocks: list[tuple[Path, str]], **extra_env: str) -> None:
    for page, block in blocks:
        ran = _bash(clone, block, timeout=900, **extra_env)
        where = page.relative_to(REPO_ROOT)
        assert ran.returncode == 0, \
            f"{where}:\n{block}\n--- stdout:\n{ran.stdout[-3000:]}\n--- stderr:\n{ran.stderr[-3000:]}"
        assert "Traceback" not in ran.stderr, f"{where}:\n{block}\n{ran.stderr}"


@pytest.fixture(scope="module")
def demo(clone: Path) -> subprocess.CompletedProcess:
    """The main job, run once in the copy: every marked block runs after it."""
    ran = _bash(clone, "bash scripts/demo.sh", timeout=1800)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    return ran


def test_readme_has_its_two_setup_commands_and_the_pages_their_marked_blocks():
    readme = (REPO_ROOT / "README.md").read_text()
    setup = re.search(r"## Set up on a fresh machine\n\n```bash\n(.*?)\n```", readme, re.S)
    assert setup is not None
    assert [line.split("#")[0].strip() for line in setup.group(1).splitlines()] == ["bash scripts/demo.sh",
                                                                                     "bash scripts/test.sh"]
    assert "bash scripts/test.sh" in (REPO_ROOT / ".ci" / "run").read_text()
    tested = "\n".join(script for needs in (None, "slurm") for _, script in marked_blocks(needs))
    for command in STILL_TESTED:
        assert command in tested, f"{command!r} is no longer in a block marked <!-- readme-test -->"
    assert marked_blocks("slurm"), "docs/slurm.md's cluster on one machine is no longer tested"
    # A marker with a requirement this file does not know would never run.
    known = {None, "slurm"}
    for page in pages():
        assert {m["needs"] for m in MARKED_BLOCK.finditer(page.read_text())} <= known, page


def test_the_tour_names_every_module_and_the_pages_no_development_tool():
    """A newcomer finds every module on README's tour; the pages are for users (no tool of ours they lack)."""
    readme = (REPO_ROOT / "README.md").read_text()
    tour = readme[readme.index("## A short tour"):readme.index("<!-- --8<-- [end:tour] -->")]
    missing = [str(path.relative_to(REPO_ROOT)) for package in ("leanagent", "tasks", "flows", "deployments")
               for path in sorted((REPO_ROOT / package).rglob("*.py"))
               if path.name not in ("__init__.py", "__main__.py") and path.name not in tour]
    assert not missing, f"modules the tour does not name: {missing}"
    pages = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    for page in pages:
        text = page.read_text()
        for word in ("farm-studio", "farm-bench", "`duplicates`", "this session", "the issue"):
            assert word not in text, f"{page.name} mentions {word}"


BASH_BLOCK = re.compile(r"```bash\n(.*?)\n```", re.S)
# A command that only `.venv` has: written bare, it is not found after README's two set-up commands (or, for
# `python`, it is a Python without leanagent).
VENV_ONLY = re.compile(r"^(?:\w+=\S*\s+)*(leanagent|prefect|python3?|pip3?|pytest|mkdocs|ruff|tensorboard)\b")


def _commands(block: str) -> list[str]:
    """The commands of a bash block: each line's pipeline parts, without comments and here-documents' text."""
    commands, ends = [], None
    for line in block.splitlines():
        if ends is not None:
            ends = None if line.strip() == ends else ends
            continue
        heredoc = re.search(r"<<-?\s*'?(\w+)'?", line)
        ends = heredoc.group(1) if heredoc else None
        code = line.split(" #")[0] if not line.lstrip().startswith("#") else ""
        commands += [part.strip() for part in re.split(r"&&|\|\||;|\||&(?!>)", code) if part.strip()]
    return commands


def test_every_command_of_the_pages_runs_from_venv_bin():
    """README says once that the commands run with `.venv/bin/` in front; a bare `leanagent` or `python` fails."""
    bare = [f"{page.name}: {command}" for page in pages() for block in BASH_BLOCK.findall(page.read_text())
            for command in _commands(block) if VENV_ONLY.match(command)]
    assert not bare, "commands that need .venv/bin/ in front:\n" + "\n".join(bare)
    assert _commands("a && .venv/bin/leanagent x  # leanagent y\ncat <<EOF\npython z\nEOF\npython -c 1 | grep 1") == \
        ["a", ".venv/bin/leanagent x", "cat <<EOF", "python -c 1", "grep 1"]


# Words of text written for this project's maintainers, not its users, with what to write instead. The how-to pages
# (README and every page but the measurements log, which is the project's history) hold none of them.
MAINTAINER_WORDS = {
    r"\bthe seed\b|\bseed's\b": "LeanAgent's settings, called \"LeanAgent's\"",
    r"\.\./shared\b": "where a user's data is (a placeholder such as MINIF2F), not a folder beside this checkout",
    r"scripts/measure_": "the `leanagent bench` section that measures it",
    r"\bthis machine\b|\bmachine kind\b|\bthis project's (?:\S+ )?machines?\b":
        "the CPU a figure was measured on (its vendor and flags), or `the local machine`",
    r"\bxdist\b|\bdevice (?:call|run|time)\b|\b(?:is|was|were) lent\b": "what a user runs, not how we ran it",
}


def test_the_how_to_pages_speak_to_users():
    how_to = [page for page in pages() if page.name != "measurements.md"]
    assert len(how_to) == len(pages()) - 1 and how_to[0].name == "README.md"
    found = [f"{page.name}:{text[:m.start()].count(chr(10)) + 1}: {m.group(0)!r}: write {instead}"
             for page in how_to for text in [page.read_text()] for words, instead in MAINTAINER_WORDS.items()
             for m in re.finditer(words, text)]
    assert not found, "\n".join(found)


# A file of this repository, as a page names it (`leanagent/launch/NAME.py`: NAME is a placeholder).
REPO_FILE = re.compile(r"(?<![\w/.-])((?:leanagent|scripts|configs|deployments|flows|tasks|tests|docs)/"
                       r"[\w./*-]*[\w/*])")
PLACEHOLDER = re.compile(r"/[A-Z_]+(?:\.\w+)?(?:/|$)")


def test_every_file_a_page_names_exists():
    missing = [f"{page.name}: {m.group(1)}" for page in pages() for m in REPO_FILE.finditer(page.read_text())
               if not PLACEHOLDER.search(m.group(1)) and not glob.glob(str(REPO_ROOT / m.group(1)))]
    assert not missing, "pages name files that do not exist:\n" + "\n".join(missing)


def test_readme_links_reach_a_page_and_a_heading_there():
    """mkdocs checks the links between pages; README is outside the site, so its own links are checked here."""
    readme = (REPO_ROOT / "README.md").read_text()
    links = re.findall(r"\]\((?!https?:)([^)#]+)(?:#([^)]+))?\)", readme)
    assert links
    for path, anchor in links:
        target = REPO_ROOT / path
        assert target.is_file(), f"README links to {path}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
            assert anchor in {slugify(h, "-") for h in headings}, f"README links to {path}#{anchor}: no such heading"


def test_the_docs_build_as_a_site_with_strict_checks(tmp_path):
    """A broken link, anchor, snippet or nav entry fails `mkdocs build --strict` (mkdocs.yml's validation)."""
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                           cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, built.stdout + built.stderr
    index = (tmp_path / "site" / "index.html").read_text()
    for heading in ("Set up on a fresh machine", "A short tour", "Command line"):  # README's sections came in
        assert heading in index
    assert "8&lt;" not in index


@pytest.mark.ddp
@pytest.mark.prefect
def test_the_demo_then_every_marked_block_runs_as_written(clone, demo):
    printed = (demo.stdout + demo.stderr).splitlines()
    assert len([line for line in printed if "[progress] " not in line]) <= DEMO_LINES, "\n".join(printed)
    assert "Recall@10 (row: trained through; column: evaluated on)" in demo.stdout
    # README's figures are what the demo prints on the CPU they were recorded on (bit-reproducible there); another
    # CPU's kernels may round differently, so there the rows are checked by their labels.
    blocks = re.findall(r"```text\n(Setup: .*?)\n```", (REPO_ROOT / "README.md").read_text(), re.S)
    assert len(blocks) == 2, "README shows the demo's figures in fp32 and in bf16-mixed"
    setup = next(line for line in printed if line.startswith("Setup: "))  # the precision `auto` took here
    shown = [block for block in blocks if block.splitlines()[0] == setup]
    assert len(shown) == 1, f"no README block for {setup!r}"
    lines = [line for line in shown[0].splitlines() if line]
    if setup.endswith(EXACT_EVERYWHERE) or _cpu_kind() == FIGURES_CPU:
        missing = [line for line in lines if line not in printed]
    else:  # the same rows, each under its label
        labels = {line.split()[0] for line in printed if line.strip()}
        missing = [line for line in lines if line.split()[0] not in labels]
    assert not missing, f"README's demo figures differ from the demo's: {missing}\n" + demo.stdout[-3000:]
    # docs/hosting.md's `/health` is what a server of the demo's run answers (its stage, premises and modules).
    health = _served_health(clone)
    for key, value in _health_shown():
        assert health[key] == value, f"docs/hosting.md shows {key}: {value!r}, the server says {health[key]!r}"
    _run_blocks(clone, marked_blocks(None))
    # docs/continuing.md continued the demo's run with a fourth repository: appended after the three, a row each.
    report = _bash(clone, ".venv/bin/leanagent report demo/run", timeout=120).stdout.splitlines()
    assert [line.split()[0] for line in report[1:5]] == ["repo_0", "repo_1", "repo_2", "repo_3"], report[:6]
    _assert_report_md_shows_the_demos_jobs(report)


def _health_shown() -> list[tuple[str, object]]:
    """The keys and values docs/hosting.md's `/health` example shows (`"…"`, an elided value, left out)."""
    page = (REPO_ROOT / "docs" / "hosting.md").read_text()
    shown = re.search(r'^# (\{"status".*\})$', page, re.M)
    assert shown is not None, "docs/hosting.md no longer shows a /health body"
    pairs = re.findall(r'"(\w+)":("[^"]*"|\d+)', shown.group(1))
    return [(key, value.strip('"') if value.startswith('"') else int(value)) for key, value in pairs
            if value != '"…"']


def _served_health(clone: Path) -> dict:
    """GET /health of `leanagent serve demo/run` (a real server, on a free port), stopped as Ctrl-C stops it."""
    log = clone / "demo" / "serve-health.log"
    with log.open("w") as err:
        proc = subprocess.Popen([".venv/bin/leanagent", "serve", "demo/run", "--port", "0"], cwd=clone,
                                env=_env(clone), stdout=subprocess.DEVNULL, stderr=err)
    try:
        def url() -> str | None:
            found = re.search(r" at (http://127\.0\.0\.1:\d+)", log.read_text())
            return found.group(1) if found else None

        wait_for(lambda: url() is not None, 300, "leanagent serve's address", proc, log.read_text)
        return httpx.get(f"{url()}/health", timeout=60).json()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _assert_report_md_shows_the_demos_jobs(report: list[str]) -> None:
    """docs/report.md's table of jobs is the demo's: the same columns, and each row shown a job of the demo with the
    premises it embedded (those are the same on every run; the seconds are one run's, so only their form counts)."""
    page = (REPO_ROOT / "docs" / "report.md").read_text()
    shown = re.search(r"```text\n(job .*?)\n```", page, re.S)
    assert shown is not None, "docs/report.md no longer shows the table of jobs"
    head, *rows = shown.group(1).splitlines()
    assert head.split() in [line.split() for line in report], f"docs/report.md's header is not the report's:\n{head}"
    printed = {line.split()[0]: line.split() for line in report if line.strip()}
    parts = len(head.split("premises")[0].split()) - 2  # the columns between `seconds` and the premises
    for row in rows:
        cells = row.split()
        job = printed.get(cells[0])
        assert job is not None, f"docs/report.md shows a job the demo does not run: {cells[0]}"
        assert cells[2 + parts:] == job[2 + parts:], f"docs/report.md: {row}\nthe demo's: {' '.join(job)}"
        assert re.fullmatch(r"\d+\.\d", cells[1]) and all(re.fullmatch(r"\d+%", c) for c in cells[2:2 + parts]), row
        assert len(cells) == len(job), f"docs/report.md: {row}\nthe demo's: {' '.join(job)}"


def _cpu_kind() -> tuple[str, str]:
    """lscpu's vendor of this machine's CPU and whether it has AMX bf16 ("" where lscpu is missing: macOS)."""
    try:
        listed = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "", ""
    vendor = re.search(r"^Vendor ID:\s*(\S+)", listed, re.M)
    flags = re.search(r"^Flags:\s*(.*)$", listed, re.M)
    bf16 = "amx_bf16" if flags and "amx_bf16" in flags.group(1).split() else ""
    return (vendor.group(1) if vendor else ""), bf16


def _free_port_run(count: int) -> int:
    """The first of `count` consecutive free ports on 127.0.0.1, above the range SLURM jobs take for torchrun."""
    for base in range(45000 + os.getpid() % 5000, 60000, 7):
        sockets = [socket.socket() for _ in range(count)]
        try:
            for i, s in enumerate(sockets):
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no free ports")


def _running_daemons(cluster: Cluster) -> list[str]:
    """The daemons whose pid files the page's cluster wrote and that still run."""
    return [name for name, pid in cluster.pids().items()
            if subprocess.run(["ps", "-o", "comm=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
            in ("slurmctld", "slurmd")]


@pytest.mark.ddp
@pytest.mark.prefect
@pytest.mark.slurm
def test_the_slurm_cluster_on_one_machine_runs_as_written(clone, demo):
    require_slurm()
    # docs/slurm.md lays its cluster out as tests/slurm/cluster.py does, so that fixture can stop it too.
    cluster = Cluster(clone / "demo" / "slurm")
    try:
        # The page's own port unless it is taken (another clone's cluster, a test's): the same blocks otherwise.
        _run_blocks(clone, marked_blocks("slurm"), SLURM_TRY_PORT=str(_free_port_run(3)))
        deadline = time.monotonic() + 60
        while _running_daemons(cluster) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _running_daemons(cluster), "the page's stop left daemons running"
    finally:  # whatever failed, nothing of this cluster outlives the test
        if _running_daemons(cluster):
            cluster.stop()
