"""Helpers for the data-layer tests; a uniquely named module so it cannot clash with other test folders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from leanagent.ground.config import LifelongConfig, PipelineConfig, RepoConfig, TrainerConfig
from leanagent.run.manifest import RepoEntry
from leanagent.run.state import RunState

REPO_ROOT = Path(__file__).resolve().parents[2]

# The shared core file of the synthetic repositories (`leanagent.data.synthetic`): the `repos` fixture edits it.
CORE = ".lake/packages/core/Core/Basic.lean"


def load_json(path: Path) -> Any:
    return json.loads(path.read_text())


def run_state(tmp_path: Path, repos: list[Path], strategy: str, **lifelong: Any) -> tuple[PipelineConfig, RunState]:
    """(config, RunState) of a run_dir under `tmp_path` whose manifest holds `repos` as its sequence, as the flow
    leaves it before `training_datasets`; `lifelong` adds settings (replay_fraction) and `seed` the trainer's."""
    seed = lifelong.pop("seed", TrainerConfig().seed)
    cfg = PipelineConfig(run_dir=tmp_path / "run", repos=[RepoConfig(path=r) for r in repos],
                         trainer=TrainerConfig(seed=seed),
                         lifelong=LifelongConfig(dataset_strategy=strategy, **lifelong))
    state = RunState(cfg.run_dir, cfg)
    entries = [RepoEntry(r.name, r) for r in repos]
    state.extend(entries, entries)
    return cfg, state


def shared_data_dir() -> Path | None:
    """The real sample data lives beside the repository (CI clones it next to shared/), never inside it."""
    for candidate in (REPO_ROOT.parent / "shared" / "data", REPO_ROOT / "shared" / "data"):
        if candidate.is_dir():
            return candidate
    return None


def premise(name: str | None, start: tuple[int, int], end: tuple[int, int], code: str | None = None) -> dict[str, Any]:
    return {
        "full_name": name,
        "code": f"theorem {name} : True" if code is None else code,
        "start": list(start),
        "end": list(end),
        "kind": "commonTheorem",
    }


# Indices: a1=0 a2=1 b1=2 b2=3 c1=4 c2=5 c3=6 x1=7 y1=8 (dropped premises take no index).
HAND_RECORDS: list[dict[str, Any]] = [
    {"path": "A.lean", "imports": [], "premises": [premise("a1", (1, 1), (2, 10)), premise("a2", (4, 1), (5, 10))]},
    {
        "path": "B.lean",
        "imports": ["A.lean"],
        "premises": [
            premise("b1", (1, 1), (2, 5)),
            premise(None, (3, 1), (3, 5)),
            premise("_private.user__.n.foo", (3, 1), (3, 5)),
            premise("b_empty", (3, 1), (3, 5), code=""),
            premise("[Mutual.one, Mutual.two]", (3, 1), (3, 5)),
            premise("b2", (10, 1), (12, 5)),
        ],
    },
    {
        "path": "C.lean",
        "imports": ["B.lean"],
        "premises": [premise("c1", (1, 1), (1, 30)), premise("c2", (5, 1), (6, 2)), premise("c3", (20, 1), (21, 1))],
    },
    {"path": "X.lean", "imports": ["Y.lean"], "premises": [premise("x1", (1, 1), (2, 1))]},
    {"path": "Y.lean", "imports": ["X.lean"], "premises": [premise("y1", (1, 1), (2, 1))]},
]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, records: list[Any]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
