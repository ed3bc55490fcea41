"""A sweep: several setups of one lifelong experiment, each an ordinary run under `sweep_dir/NAME`, run as one.

A sweep file is YAML with four keys:

    base: leanagent-ewc.yaml          # a config file (relative to the sweep file), or a config written inline
    sweep_dir: ../runs/table4         # every setup's run_dir is sweep_dir/NAME; shared jobs live in sweep_dir/shared
    max_parallel: 2                   # setups running at once
    setups:                           # name: the overrides of `base`, each KEY=VALUE as `--set` takes them
      leanagent: [lifelong.ewc_lambda=0]
      setup3: [lifelong.ewc_lambda=0.1]

Why each setup is an ordinary run: `report`, `serve`, `export` and `run` then work on it as on any run, and a setup
is checked, resumed and refused exactly as `leanagent run` checks, resumes and refuses its config (`plan_run`): a
rerun skips what is finished, and a setup whose overrides changed meets its own manifest, which names the keys
that changed. Everything here is read only: `plan_sweep` checks every setup before anything is written, and a
bad input is one line naming the sweep file, the setup's line and the key.

`sweep.json` in sweep_dir records the setups in the order they were first given and what became of each
(`SweepRecord`), for `leanagent report SWEEP_DIR` to show a setup that failed or is still running as such.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from leanagent.ground.atomic import write_json_atomic
from leanagent.ground.config import (
    ConfigError,
    PipelineConfig,
    config_from_data,
    format_validation_error,
    read_config_data,
)
from leanagent.ground.json_files import MIB, read_model
from leanagent.launch.registry import config_problems
from leanagent.run.manifest import ManifestMismatchError
from leanagent.run.plan import BAD_INPUT, RunPlan, plan_run

SWEEP_RECORD = "sweep.json"
SHARED_DIR = "shared"  # sweep_dir/shared: the jobs the setups share (leanagent.run.shared)
RESERVED = (SHARED_DIR, SWEEP_RECORD)
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


class SweepFile(BaseModel):
    """What a sweep file holds (module docstring); also the `lifelong_sweep` flow's form in the Prefect UI."""

    model_config = ConfigDict(extra="forbid")

    base: Path | dict[str, Any] = Field(
        description="the config every setup starts from: a YAML file (relative to the sweep file) or a config "
                    "written inline (its relative paths resolve against the sweep file's folder); its run_dir is "
                    "replaced by sweep_dir/NAME")
    sweep_dir: Path = Field(description="each setup runs in sweep_dir/NAME; shared jobs in sweep_dir/shared")
    max_parallel: int = Field(1, ge=1, description="setups running at once")
    setups: dict[str, list[str]] = Field(
        min_length=1, description="each setup's name (its folder) and its overrides of base, KEY=VALUE as --set "
                                  "takes them ([]: base itself)")

    @field_validator("setups")
    @classmethod
    def _names_and_overrides(cls, setups: dict[str, list[str]]) -> dict[str, list[str]]:
        for name, overrides in setups.items():
            if not NAME_PATTERN.fullmatch(name) or name in RESERVED:
                raise ValueError(f"setup {name!r}: a name is a folder of sweep_dir: letters, digits, '.', '_', '-', "
                                 f"not starting with '.' or '-', and not {' or '.join(RESERVED)}")
            for item in overrides:
                key = item.partition("=")[0].strip()
                if key == "run_dir":
                    raise ValueError(f"setup {name!r}: {item}: a setup's run_dir is sweep_dir/{name}; set "
                                     f"sweep_dir instead")
        return setups


class LoadedSweep(BaseModel):
    """A sweep file as read: its content, where it is, and the line of each setup (for the refusals)."""

    sweep: SweepFile
    path: Path
    lines: dict[str, int] = {}


class _NoDuplicates(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that gives one key twice (PyYAML keeps the last one silently: two
    setups of one name would be one setup)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(f"line {line}: {key!r} is given twice (first on line {seen[key]}): a mapping's "
                                  f"keys, setups' names included, are given once")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_sweep_file(path: str | Path) -> LoadedSweep:
    """A sweep file, checked as YAML and as a `SweepFile`; ConfigError naming the file (and the line, the key)."""
    path = Path(path)
    try:
        text = path.read_text()
    except (FileNotFoundError, IsADirectoryError):
        raise ConfigError(f"{path}: no such sweep file") from None
    try:
        node = yaml.compose(text, Loader=_NoDuplicates)
        data = _NoDuplicates(text).get_single_data() if node is not None else {}
    except ConfigError as exc:
        raise ConfigError(f"{path}, {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping (base, sweep_dir, max_parallel, setups), got "
                          f"{type(data).__name__}")
    try:
        sweep = SweepFile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{path}: {format_validation_error(exc, SweepFile)}") from None
    return LoadedSweep(sweep=sweep, path=path, lines=_setup_lines(node))


def _setup_lines(node: Any) -> dict[str, int]:
    for key_node, value_node in getattr(node, "value", []):
        if getattr(key_node, "value", None) == "setups" and isinstance(value_node, yaml.MappingNode):
            return {k.value: k.start_mark.line + 1 for k, _ in value_node.value}
    return {}


class SetupPlan(BaseModel):
    """One setup, checked: its name, its overrides, and the plan of its run (`plan_run`)."""

    model_config = ConfigDict(frozen=True)

    name: str
    overrides: list[str]
    plan: RunPlan

    @property
    def run_dir(self) -> Path:
        return self.plan.cfg.run_dir


class SweepPlan(BaseModel):
    """A sweep, checked: what `leanagent sweep` hands to the flow, and what the flow makes itself when a deployment
    starts it (a flow parameter: typed and JSON-serializable)."""

    model_config = ConfigDict(frozen=True)

    source: str  # the sweep file, or INLINE
    sweep_dir: Path
    max_parallel: int
    setups: list[SetupPlan]
    overrides: list[str] = []  # given for every setup (`leanagent sweep --set`)

    @property
    def shared_dir(self) -> Path:
        return self.sweep_dir / SHARED_DIR


def setup_config(sweep: SweepFile, name: str, base_dir: Path, where: str, overrides: list[str] = ()
                 ) -> PipelineConfig:
    """The config of setup `name`: base, then `overrides` (every setup's), then the setup's own, checked as a config
    file is, with run_dir sweep_dir/NAME; ConfigError starting with `where` (the sweep file, the setup's line)."""
    if isinstance(sweep.base, Path):
        base_file = sweep.base if sweep.base.is_absolute() else base_dir / sweep.base
        raw, folder = read_config_data(base_file), base_file.parent
    else:
        raw, folder = sweep.base, base_dir
    given = [*overrides, *sweep.setups[name]]
    source = f"{where}: setup {name!r}" + (f" ({', '.join(given)})" if given else "")
    try:
        cfg = config_from_data({**raw, "run_dir": str(sweep_dir_of(sweep, base_dir) / name)}, source, folder, given)
    except ConfigError as exc:  # an override that is no KEY=VALUE names only itself: the setup is named here
        if str(exc).startswith(source):
            raise
        raise ConfigError(f"{source}: {exc}") from None
    problems = config_problems(cfg)
    if problems:
        raise ConfigError(f"{source}: {'; '.join(problems)}")
    return cfg


def sweep_dir_of(sweep: SweepFile, base_dir: Path) -> Path:
    return (sweep.sweep_dir if sweep.sweep_dir.is_absolute() else base_dir / sweep.sweep_dir).resolve()


def plan_sweep(sweep: SweepFile, source: str, base_dir: Path, overrides: list[str] = (),
               lines: dict[str, int] | None = None) -> SweepPlan:
    """Every check of every setup (`plan_run`) before anything is written: ConfigError (or the run's own refusal)
    naming the sweep file, the setup and the key, or the plan. `base_dir`: the sweep file's folder (relative paths
    of the file resolve against it)."""
    sweep_dir = sweep_dir_of(sweep, base_dir)
    if sweep_dir.exists() and not sweep_dir.is_dir():
        raise ConfigError(f"{source}: sweep_dir {sweep_dir} is a file, not a folder; choose another sweep_dir")
    setups = []
    for name, own in sweep.setups.items():
        where = f"{source}, line {lines[name]}" if lines and name in lines else source
        cfg = setup_config(sweep, name, base_dir, where, list(overrides))
        try:
            plan = plan_run(cfg, source=f"{source} (setup {name})")
        except BAD_INPUT as exc:
            hint = (" (in a sweep: restore the setup's overrides, or give the changed setup a new name)"
                    if isinstance(exc, ManifestMismatchError) else "")
            raise ConfigError(f"{where}: setup {name!r}: {exc}{hint}") from None
        setups.append(SetupPlan(name=name, overrides=list(own), plan=plan))
    return SweepPlan(source=source, sweep_dir=sweep_dir, max_parallel=sweep.max_parallel, setups=setups,
                     overrides=list(overrides))


def plan_sweep_file(path: str | Path, overrides: list[str] = (), base: str | Path | None = None,
                    sweep_dir: str | Path | None = None, max_parallel: int | None = None) -> SweepPlan:
    """`plan_sweep` of a sweep file, with its `base`, `sweep_dir` or `max_parallel` replaced where given (paths
    relative to the working directory, as a command line's are): what `leanagent sweep` and the flow both check."""
    loaded = load_sweep_file(path)
    replaced = {key: value for key, value in (("base", Path(base).resolve() if base else None),
                                              ("sweep_dir", Path(sweep_dir).resolve() if sweep_dir else None),
                                              ("max_parallel", max_parallel)) if value is not None}
    try:
        sweep = SweepFile.model_validate({**loaded.sweep.model_dump(), **replaced})
    except ValidationError as exc:
        raise ConfigError(f"{path}: {format_validation_error(exc, SweepFile)}") from None
    return plan_sweep(sweep, str(path), loaded.path.parent, list(overrides), loaded.lines)


# ---- sweep.json: the setups and what became of each -------------------------------------------------------------

Status = Literal["waiting", "running", "done", "failed", "interrupted"]


class SetupRecord(BaseModel):
    model_config = ConfigDict(extra="allow")

    overrides: list[str] = []
    status: Status = "waiting"
    message: str | None = None
    updated_at: str | None = None


class SweepRecordFile(BaseModel):
    """sweep.json, as `leanagent report SWEEP_DIR` reads it back."""

    model_config = ConfigDict(extra="allow")

    version: int = 1
    source: str | None = None
    order: list[str] = []  # the setups in the order the sweep first gave them (JSON objects are written sorted)
    setups: dict[str, SetupRecord] = {}

    def ordered(self) -> list[tuple[str, SetupRecord]]:
        names = [n for n in self.order if n in self.setups] + sorted(n for n in self.setups if n not in self.order)
        return [(name, self.setups[name]) for name in names]


MAX_RECORD_BYTES = 16 * MIB  # sweep.json: a few hundred bytes per setup


def read_sweep_record(sweep_dir: Path) -> SweepRecordFile | None:
    """sweep_dir/sweep.json, or None when there is none; JsonFileError (a ValueError) naming the file when it is not
    one."""
    path = Path(sweep_dir) / SWEEP_RECORD
    if not path.exists():
        return None
    return read_model(path, SweepRecordFile, MAX_RECORD_BYTES, "sweep record")


class SweepRecord:
    """sweep_dir/sweep.json while a sweep runs: written at once on every change, by any of its setups' threads.
    Hold the sweep's lock (`RunLock(sweep_dir)`) while one is open."""

    def __init__(self, plan: SweepPlan) -> None:
        self.path = plan.sweep_dir / SWEEP_RECORD
        self._mutex = threading.Lock()
        self.data = read_sweep_record(plan.sweep_dir) or SweepRecordFile()
        self.data.source = plan.source
        for setup in plan.setups:  # a setup given before keeps its place; a new one goes last
            known = self.data.setups.get(setup.name)
            self.data.setups[setup.name] = SetupRecord(overrides=setup.overrides, status="waiting" if known is None
                                                       or known.status != "done" else "done", updated_at=_now())
            if setup.name not in self.data.order:
                self.data.order.append(setup.name)
        self._write()

    def set(self, name: str, status: Status, message: str | None = None) -> None:
        with self._mutex:
            entry = self.data.setups[name]
            self.data.setups[name] = entry.model_copy(update={"status": status, "message": message,
                                                              "updated_at": _now()})
            self._write()

    def _write(self) -> None:
        write_json_atomic(self.path, self.data.model_dump(mode="json"))


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
