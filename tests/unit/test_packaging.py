"""What `pip install .` puts into an environment: the library and its orchestration under the name `leanagent`, and
no top-level `flows`, `tasks` or `deployments` (common names a user's own code may hold)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO_ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"leanagent.flows": "flows", "leanagent.tasks": "tasks", "leanagent.deployments": "deployments"}


def _setuptools() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_the_package_list_is_every_folder_of_code() -> None:
    """A new subpackage of leanagent/ must be listed, or `pip install .` leaves it out."""
    found = {".".join(p.relative_to(REPO_ROOT).parts) for p in (REPO_ROOT / "leanagent").rglob("*")
             if p.is_dir() and any(p.glob("*.py"))}
    found |= {"leanagent", *FOLDERS}
    assert sorted(_setuptools()["packages"]) == sorted(found)
    assert _setuptools()["package-dir"] == FOLDERS


def test_a_wheel_installs_no_generic_top_level_package(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(REPO_ROOT)], check=True, timeout=600, capture_output=True)
    wheel = next(tmp_path.glob("leanagent-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"leanagent"}, top
    for package, folder in FOLDERS.items():
        ours = sorted(p.name for p in (REPO_ROOT / folder).glob("*.py"))
        assert sorted(n.rsplit("/", 1)[1] for n in names if n.startswith(package.replace(".", "/") + "/")
                      and n.endswith(".py")) == ours
