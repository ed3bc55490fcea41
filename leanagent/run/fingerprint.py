"""Which settings make a run the experiment it is: the fingerprint two runs of one run_dir must share.

Why a fingerprint: a rerun with a changed hyper-parameter would otherwise resume from checkpoints trained under the
old one and silently mix two experiments. Keys that cannot change a result (where the run lives, how its jobs are
launched, logging cadence, dataloader workers, multi-node addressing) are left out of the fingerprint, so moving
such a knob does not lock the user out of their run. How a job is launched is `launcher` and every launcher's
section, whatever launchers exist: the fingerprint keeps only the keys the ground config itself interprets.

Why the repositories are not in the fingerprint: a lifelong run learns repositories that arrive later. The
fingerprint guards the experiment (model, data, trainer, lifelong settings); the sequence of repositories is data
that only grows at its end (`leanagent.run.state.check_sequence`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from leanagent.ground.config import ABSENT_MEANS, PipelineConfig
from leanagent.ground.names import AUTO
from leanagent.run.manifest import ManifestMismatchError, ManifestRecord

# Where the run's repositories come from: the sequence, which may grow, not the experiment.
SEQUENCE_KEYS = ("repos", "repos_dir")


# Dotted keys that do not change what a run computes; see the module docstring (model.embed_premises: which
# premises are embedded, never what a premise's embedding or a context's ranking is). Not model.sort_by_length,
# model.token_budget or model.compile: beyond float rounding they change which dropout masks training draws.
RUN_IRRELEVANT_KEYS = (
    "run_dir",
    "launcher",
    "data.num_workers",
    "model.embed_premises",
    "trainer.log_every_n_steps",
    "trainer.node_rank",
    "trainer.rdzv_endpoint",
)


# Settings whose `auto` is decided by the machine (`trainer.precision: auto`, by the CPU's bf16 matmuls), each with
# the key of a job's result that says what it ran: the run records the value its first job ran, and continues in it
# on any machine. A config saying `auto` agrees with any recorded value (a run recorded before `auto` existed
# included: its config holds bf16-mixed); a recorded `auto` (no job of the run has finished) agrees with any config.
DECIDED_BY_THE_RUN = {"trainer.precision": "precision"}


def fingerprint_fields(cfg: PipelineConfig) -> dict[str, Any]:
    """The config as JSON, minus RUN_IRRELEVANT_KEYS, the repositories and the launchers' sections: what two runs
    must agree on to share a run_dir."""
    data = {key: value for key, value in cfg.model_dump(mode="json").items() if key in PipelineConfig.model_fields}
    for key in SEQUENCE_KEYS:
        data.pop(key, None)
    for dotted in RUN_IRRELEVANT_KEYS:
        *parents, leaf = dotted.split(".")
        node = data
        for key in parents:
            node = node.get(key, {})
        node.pop(leaf, None)
    return data


def config_fingerprint(cfg: PipelineConfig) -> str:
    return fields_fingerprint(fingerprint_fields(cfg))


def fields_fingerprint(fields: dict[str, Any]) -> str:
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def recorded_setting(config: dict[str, Any], dotted: str) -> Any:
    """A dotted key of a manifest's config, or None."""
    node: Any = config
    for key in dotted.split("."):
        node = node.get(key) if isinstance(node, dict) else None
    return node


def continued(path: Path, recorded: dict[str, Any] | None, cfg: PipelineConfig
              ) -> tuple[dict[str, Any], PipelineConfig]:
    """What a run continues in, given the config its manifest (`path`) `recorded` (None: a new run): the fields to
    record, and the config its jobs get. Both are `cfg`'s, with each setting the run decided (DECIDED_BY_THE_RUN:
    the precision its first job ran under `trainer.precision: auto`) at the recorded value where `cfg` says auto,
    so that a run goes on in its precision on a CPU that would resolve auto otherwise. A recorded config of
    another experiment is refused (`check_config`)."""
    fields = fingerprint_fields(cfg)
    if recorded is None:
        return fields, cfg
    check_config(path, recorded, fields)
    data = cfg.model_dump(mode="json")
    kept = keep_decided(recorded, data)
    return keep_decided(recorded, fields), cfg if kept == data else PipelineConfig.model_validate(kept)


def keep_decided(recorded: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` with each DECIDED_BY_THE_RUN key that says `auto` set to the value `recorded` holds, if any: what
    the run continues in."""
    out = json.loads(json.dumps(fields))
    for dotted in DECIDED_BY_THE_RUN:
        value = recorded_setting(recorded, dotted)
        if recorded_setting(out, dotted) == AUTO and value not in (None, AUTO):
            set_setting(out, dotted, value)
    return out


def set_setting(config: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = config
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`key: old -> new` for every difference that matters.

    A key absent from the stored config is a knob added by a later version of leanagent; the run was computed
    at the value that reproduces the old behaviour: `ABSENT_MEANS` where that is not today's default (an old
    run without `model.sort_by_length` padded its pools: it continues under false only), else the default.
    At that value it is not a change. Nor is `auto` on either side of a DECIDED_BY_THE_RUN key.
    """
    a, b = _flatten(old), _flatten(new)
    before = {**_flatten(fingerprint_fields(PipelineConfig())), **ABSENT_MEANS}
    return [f"{k}: {_stored(a, before, k)} -> {b.get(k, '(absent)')!r}" for k in sorted(a.keys() | b.keys())
            if a.get(k) != b.get(k) and not (k not in a and k in before and b.get(k) == before[k])
            and not (k in DECIDED_BY_THE_RUN and AUTO in (a.get(k), b.get(k)))]


def _stored(old: dict[str, Any], before: dict[str, Any], key: str) -> str:
    if key in old:
        return repr(old[key])
    return f"(absent: {before[key]!r})" if key in ABSENT_MEANS else repr("(absent)")


def describe_differences(old: dict[str, Any], new: dict[str, Any], limit: int = 10) -> str:
    diffs = config_changes(old, new)
    more = f" (and {len(diffs) - limit} more)" if len(diffs) > limit else ""
    return "; ".join(diffs[:limit]) + more


def check_experiment(path: Path, manifest: ManifestRecord, cfg: PipelineConfig) -> None:
    """Refuse a manifest of another experiment (`path` names it in the message); reads nothing itself."""
    check_config(path, manifest.config.fields(), fingerprint_fields(cfg))


def check_config(path: Path, recorded: dict[str, Any], fields: dict[str, Any]) -> None:
    """Refuse the config a manifest `recorded` (`path`) when `fields` (today's) differ from it in what matters."""
    # A version 1 manifest's config holds the repositories: they are the sequence, checked on their own.
    old = {k: v for k, v in recorded.items() if k not in SEQUENCE_KEYS}
    if config_changes(old, fields):
        raise ManifestMismatchError(
            f"{path} belongs to a run of a different config ({describe_differences(old, fields)}); resuming it would "
            f"mix two experiments. Restore the config or choose another run_dir.")
