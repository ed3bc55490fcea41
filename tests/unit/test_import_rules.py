"""The layers hold: each module imports only its own floor and those below (README's tour), the library imports
no Prefect, and the launchers import no torch (a launcher starts ranks; it must not pay torch's import)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("leanagent", "tasks", "flows", "deployments")

# From the ground floor up: every folder of the library is one floor, and a module's floor is its folder's. A module
# in no listed folder has none, and fails `test_every_module_has_a_floor`: a new folder is placed here on purpose.
FLOORS: dict[str, int] = {
    "leanagent": 0,  # the package itself: `leanagent.retrieve`, resolved on first use
    "leanagent.ground": 0, "leanagent.checkpoints": 0,  # config, atomic files, job records, checkpoints by name
    "leanagent.data": 1,
    "leanagent.model": 2, "leanagent.index": 2, "leanagent.export": 2,
    "leanagent.train": 3, "leanagent.launch": 3,  # the rank programs and the launchers
    "leanagent.preflight": 4, "leanagent.run": 4, "leanagent.report": 4, "leanagent.serve": 4,
    "leanagent.bench": 5, "leanagent.tasks": 5, "leanagent.flows": 5,  # the folders tasks/ and flows/
    "leanagent.deployments": 6,
    "leanagent.cli": 7,
}


def _floor(module: str) -> int:
    """The floor of `module`'s folder (`leanagent.X`), or of the package itself; KeyError for any other."""
    parts = module.split(".")
    key = ".".join(parts[:2])
    if key in FLOORS:
        return FLOORS[key]
    raise KeyError(module)


def _modules():
    """(installed name, file) of every module: tasks/, flows/ and deployments/ install under leanagent."""
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__")
            yield (name if package == "leanagent" else f"leanagent.{name}"), path


def _imports(path: Path):
    """Every imported module name, function-local imports included (a lazy import still points somewhere)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def test_every_module_has_a_floor() -> None:
    unplaced = [name for name, _ in _modules() if _floor_or_none(name) is None]
    assert not unplaced, f"modules in no folder of FLOORS (place the folder on a floor): {unplaced}"


def _floor_or_none(module: str) -> int | None:
    try:
        return _floor(module)
    except KeyError:
        return None


def test_no_module_imports_a_floor_above_its_own() -> None:
    upward = []
    for name, path in _modules():
        for imported in _imports(path):
            if imported.split(".")[0] != "leanagent":
                continue
            try:
                target = _floor(imported)
            except KeyError:
                continue
            if target > _floor(name):
                upward.append(f"{name} (floor {_floor(name)}) imports {imported} (floor {target})")
    assert not upward, "\n".join(sorted(set(upward)))


def test_the_library_imports_no_prefect() -> None:
    found = [f"{name} imports {imported}" for name, path in _modules() if path.is_relative_to(REPO_ROOT / "leanagent")
             for imported in _imports(path) if imported.split(".")[0] == "prefect"]
    assert not found, "\n".join(found)


def test_the_launchers_and_the_file_checks_load_no_torch() -> None:
    """Imported as a launcher uses them (`leanagent.launch.torchrun` is the program torchrun runs, not one); the
    flow prunes checkpoints and the checks read Fisher headers with `checkpoint_files` alone."""
    launch = [name for name, _ in _modules() if name.startswith("leanagent.launch.")
              and name != "leanagent.launch.torchrun"] + ["leanagent.checkpoints.files"]
    probe = ("import importlib, sys\n"
             f"for name in {launch!r}: importlib.import_module(name)\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'pytorch_lightning', 'prefect')))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout
