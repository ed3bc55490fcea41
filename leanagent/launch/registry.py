"""Launchers by name: the config's `launcher: NAME` picks the launcher plugin called NAME.

Where they come from, with no list kept by hand:

- every module (or package) of leanagent/launch/ that defines a module-level `PLUGIN` (a `LauncherPlugin`):
  adding a launcher is adding its file;
- every entry point of the group `leanagent.launchers` of an installed distribution, each loading to one, so a
  site ships its own launcher in its own package (as pytest and Lightning find plugins):

      [project.entry-points."leanagent.launchers"]
      kube = "mysite.kube:PLUGIN"

This is also what checks a config for what config.py (the ground layer, which knows no launcher) cannot: the
`launcher` name, every launcher's section with its own pydantic model, any other unknown top-level key (each
with the nearest known key), and the chosen launcher's own cross-checks (`LauncherPlugin.check_config`). The
CLI, the flow and the deployments load configs through `load_checked_config`; the preflight checks again
(`launch_problems`), for a config built in Python or given in the Prefect UI.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import pkgutil
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from pathlib import Path

from pydantic import ConfigDict, Field, ValidationError, create_model

from leanagent.ground.config import ConfigError, PipelineConfig, config_source, format_validation_error, load_config
from leanagent.launch.base import JobStatus, Launcher, LauncherPlugin

ENTRY_POINT_GROUP = "leanagent.launchers"
PLUGIN_ATTRIBUTE = "PLUGIN"
PACKAGE = "leanagent.launch"


@functools.cache
def plugins() -> dict[str, LauncherPlugin]:
    """Every launcher there is, by name: this folder's modules first, then the installed entry points."""
    found: dict[str, tuple[LauncherPlugin, str]] = {}

    def add(plugin: object, where: str) -> None:
        if not isinstance(plugin, LauncherPlugin) or not plugin.name:
            raise ConfigError(f"launcher plugin {where}: {PLUGIN_ATTRIBUTE} is not a LauncherPlugin with a name")
        if plugin.name in PipelineConfig.model_fields:
            raise ConfigError(f"launcher plugin {where}: its name {plugin.name!r} is a config key of its own")
        if plugin.name in found:
            raise ConfigError(f"two launchers are named {plugin.name!r}: {found[plugin.name][1]} and {where}")
        found[plugin.name] = (plugin, where)

    package = importlib.import_module(PACKAGE)
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{PACKAGE}.{info.name}")
        if hasattr(module, PLUGIN_ATTRIBUTE):
            add(getattr(module, PLUGIN_ATTRIBUTE), f"{module.__name__}")
    for point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            plugin = point.load()
        except Exception as exc:  # a broken third-party package: one line naming it, not a traceback
            raise ConfigError(f"launcher plugin {point.name} ({point.value}, entry point {ENTRY_POINT_GROUP}) "
                              f"does not load: {type(exc).__name__}: {exc}") from None
        if getattr(plugin, "name", None) != point.name:
            raise ConfigError(f"launcher plugin {point.value}: its entry point is named {point.name!r}, the "
                              f"launcher {getattr(plugin, 'name', None)!r}; name both alike")
        add(plugin, f"{point.value} (entry point {ENTRY_POINT_GROUP})")
    return {name: plugin for name, (plugin, _) in found.items()}


def plugin_named(name: str) -> LauncherPlugin:
    """The launcher `name`; ConfigError naming the known ones (and the nearest) otherwise."""
    known = plugins()
    if name in known:
        return known[name]
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"launcher: {name!r} is not a known launcher{hint}; known: {', '.join(sorted(known))}")


class _Strict(PipelineConfig):
    model_config = ConfigDict(extra="forbid")


@functools.cache
def _checked_model() -> type[PipelineConfig]:
    """PipelineConfig with each launcher's section as a typed field and no other key allowed: for checking only
    (the config handed on keeps its sections as written, so it pickles and dumps as a plain PipelineConfig)."""
    sections = {name: (p.section, Field(default_factory=p.section)) for name, p in plugins().items() if p.section}
    return create_model("CheckedConfig", __base__=_Strict, __module__=__name__, **sections)


def config_problems(cfg: PipelineConfig) -> list[str]:
    """What only the registry can refuse in a config, read only: one line (the first problem found).

    The `launcher` name, then every top-level key (a launcher's section validated with its model, any other
    unknown key named with the nearest known one), then the chosen launcher's cross-checks with the rest.
    """
    try:
        plugin = plugin_named(cfg.launcher)
        model = _checked_model()
        data = cfg.model_dump()
        model.model_validate({key: {} if value is None and key in plugins() else value for key, value in data.items()})
    except ConfigError as exc:
        return [str(exc)]
    except ValidationError as exc:
        return [format_validation_error(exc, model)]
    return plugin.check_config(cfg)


def load_checked_config(path: str | Path, overrides: Sequence[str] = ()) -> PipelineConfig:
    """`leanagent.ground.config.load_config` (with `--set` overrides), then `config_problems`: ConfigError naming
    the file and the key."""
    cfg = load_config(path, overrides)
    problems = config_problems(cfg)
    if problems:
        raise ConfigError(f"{config_source(path, overrides)}: {'; '.join(problems)}")
    return cfg


def launch_problems(cfg: PipelineConfig, visible_gpus: Callable[[], int]) -> list[str]:
    """Before a launch: `config_problems`, and when there are none, the chosen launcher's own preflight."""
    return config_problems(cfg) or plugin_named(cfg.launcher).preflight(cfg, visible_gpus)


def launcher_for(cfg: PipelineConfig) -> Launcher:
    """The `Launcher` of the config's `launcher`."""
    return plugin_named(cfg.launcher).launcher(cfg)


def run_status(run_dir: Path) -> list[tuple[str, JobStatus]]:
    """(launcher name, job) for every job of the run that a launcher has on record with a queue."""
    return [(name, job) for name, plugin in sorted(plugins().items()) for job in plugin.status(Path(run_dir))]


def cancel_run(run_dir: Path) -> list[tuple[str, JobStatus]]:
    """End every job of the run still queued or running, under whichever launcher submitted it; those ended."""
    return [(name, job) for name, plugin in sorted(plugins().items()) for job in plugin.cancel(Path(run_dir))]
