"""Every third-party package the shipped code imports is declared in pyproject.toml, so a fresh install (pip,
a Mac laptop) has it; nothing is there only because another package happened to bring it."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO_ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ("leanagent", "tasks", "flows", "deployments")
OURS = set(SHIPPED)


def _imported_top_level_modules() -> dict[str, str]:
    """Top-level module -> one file importing it, over every import statement (function-local ones included)."""
    found: dict[str, str] = {}
    for package in SHIPPED:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name.split(".")[0], str(path.relative_to(REPO_ROOT)))
    return found


def _normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_imported_third_party_package_is_declared() -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    declared = {_normalised(re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0]) for req in project["dependencies"]}
    distributions = importlib.metadata.packages_distributions()
    missing = {}
    for module, where in _imported_top_level_modules().items():
        if module in OURS or module in sys.stdlib_module_names or module == "__future__":
            continue
        owners = {_normalised(d) for d in distributions.get(module, [module])}
        if not owners & declared:
            missing[module] = f"{sorted(owners)} (imported by {where})"
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"
