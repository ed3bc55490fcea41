"""Each name has one home (leanagent/ground/names.py): a dataset's file names, LeanDojo's splits and their parts, the
presets and the Fisher estimators are spelled out there once, and every table keyed by them is checked against it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from leanagent.ground import names

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCES = [p for folder in ("leanagent", "flows", "tasks", "deployments") for p in (REPO_ROOT / folder).rglob("*.py")]
# Names whose quoted spelling is theirs alone. Not the dtypes ("bf16" is also a precision's prefix) nor "random" (also
# a value of data.negatives) nor the parts (also Lightning's stage names): those are checked as the tables they head.
ONE_SPELLING = (names.CORPUS_FILE, *names.SPLITS[1:], *names.PRESET_NAMES, *names.FISHER_ESTIMATORS,
                *(names.part_file(part) for part in names.PARTS))


@pytest.mark.parametrize("name", ONE_SPELLING)
def test_a_name_is_spelled_out_once(name: str) -> None:
    quoted = re.compile(rf"(?<![\"'\w])[\"']{re.escape(name)}[\"']")  # a string literal, not a docstring's word
    found = [f"{p.relative_to(REPO_ROOT)}:{n}" for p in SOURCES
             for n, line in enumerate(p.read_text().splitlines(), start=1) if quoted.search(line)]
    assert len(found) <= 1, f"{name!r} spelled out in several places (import it from leanagent.ground.names): {found}"
    assert all(f.startswith("leanagent/ground/names.py:") for f in found), found


def test_the_tables_hold_the_names_of_their_home() -> None:
    from leanagent.ground.config import LifelongConfig
    from leanagent.model.dtypes import DTYPES
    from leanagent.model.engines import ENGINES
    from leanagent.model.fisher.registry import ESTIMATORS
    from leanagent.model.presets import PRESETS

    assert tuple(ESTIMATORS) == names.FISHER_ESTIMATORS
    assert tuple(PRESETS) == names.PRESET_NAMES
    assert DTYPES == names.TORCH_DTYPE_CHOICES == (names.AUTO, *ENGINES[names.TORCH].dtypes)
    assert tuple(ENGINES) == names.ENGINE_NAMES
    assert set(names.DTYPES) == {d for e in ENGINES.values() for d in e.dtypes}
    schema = LifelongConfig.model_json_schema()["properties"]["fisher_estimator"]
    assert tuple(schema["enum"]) == names.FISHER_ESTIMATORS  # the Prefect form's choices


def test_every_rank_program_has_its_function_and_every_function_its_program() -> None:
    """The rank programs' table (`RUNNERS`, where torch lives) names a function for each spec the launcher side
    reads (`PROGRAMS`), each returning its spec's result model."""
    import typing

    from leanagent.ground.job import PROGRAMS
    from leanagent.train.programs import RUNNERS

    assert RUNNERS.keys() == PROGRAMS.keys()
    assert all(typing.get_type_hints(run)["return"] is PROGRAMS[name].result for name, run in RUNNERS.items())


def test_a_table_that_drifts_from_its_names_is_refused_at_import() -> None:
    with pytest.raises(RuntimeError, match="add or remove the name on both sides"):
        names.check_table("a table", ("a", "b"), {"a": 1})
