"""The run-state readers fuzzed: whatever a manifest.json, an index.json or a result.json holds (any JSON value, a
valid file with any part replaced by any JSON value, any bytes), the reader gives back an object its consumers can
read without failing, or one line naming the file. Reproducible: derandomized, bounded examples, no deadline."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leanagent.ground import model_identity
from leanagent.ground.results import ResultUnreadableError, read_result
from leanagent.index.files import INDEX_FILE, PremiseIndexError
from leanagent.index.read import check_model, read_meta
from leanagent.report import report_from_manifest
from leanagent.report.compare import run_setup
from leanagent.run.fingerprint import check_config
from leanagent.run.manifest import (
    ManifestMismatchError,
    ManifestUnreadableError,
    given_before,
    read_manifest,
    recorded_sequence,
    stage_indexes,
    waiting_repositories,
)

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                max_size=3), max_leaves=8)

EVAL = {"metrics": {"Recall@1": 10.0, "Recall@10": 50.0, "MRR": 0.25, "num_contexts": 7}, "world_size": 1,
        "checkpoint": "ckpt"}
MANIFEST = {
    "version": 2, "fingerprint": "f" * 64, "created_at": "2026-12-05T00:00:00+0000", "order": ["a"], "given": ["a"],
    "config": {"lifelong": {"dataset_strategy": "replay", "replay_fraction": 0.5, "curriculum": True,
                            "ewc_lambda": 0.1},
               "model": {"loss": "mse"}, "data": {"negatives": "random"}, "trainer": {"devices": 1}},
    "repos": {"00-a": {"index": 0, "name": "a", "path": "/data/a", "dataset": {"corpus.jsonl": "0" * 64},
                       "stages": {
                           "eval-untrained": {"status": "done", "result": EVAL},
                           "train": {"status": "done", "result": {"checkpoint": "c", "epoch": 1,
                                                                  "metrics": {"Recall@10_val": 60.0}}},
                           "fisher": {"status": "failed", "error": "x"},
                           "eval-00-a": {"status": "done", "result": {**EVAL, "job": {
                               "out": "a/evaluate-00", "index": "index/00-a", "wall_seconds": 2.0,
                               "timings": {"embed": 0.5, "total": 1.5}, "premises_embedded": 3}}}}}},
}


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place in a JSON value, as a key path."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def _replace(value: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    out = copy.deepcopy(value)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = new
    return out


def damaged(base: dict) -> st.SearchStrategy[Any]:
    """The valid file with one place (any, the whole included) replaced by any JSON value."""
    return st.tuples(st.sampled_from(_paths(base)), JSON).map(lambda pn: _replace(base, pn[0], pn[1]))


def _write(path: Path, value: Any) -> None:
    path.write_bytes(value if isinstance(value, bytes) else json.dumps(value).encode())


def _one_line(exc: Exception, path: Path) -> None:
    message = str(exc)
    assert "\n" not in message and str(path) in message, message


def _use_manifest(data: dict, path: Path) -> None:
    """What the flow, the report and the server read of a manifest."""
    report_from_manifest(data).text()
    stage_indexes(data)
    waiting_repositories(data)
    recorded_sequence(data)
    given_before(data)
    run_setup(data.get("config"))
    try:
        check_config(path, data, {"lifelong": {}})
    except ManifestMismatchError:
        pass


@FUZZ
@given(st.one_of(JSON, damaged(MANIFEST), st.binary(max_size=64)))
def test_a_manifest_reads_as_one_its_readers_can_use_or_one_line(tmp_path: Path, value: Any) -> None:
    path = tmp_path / "manifest.json"
    _write(path, value)
    try:
        data = read_manifest(path)
    except ManifestUnreadableError as exc:
        _one_line(exc, path)
        return
    _use_manifest(data, path)


INDEX_META = {"format": 2, "num_premises": 3, "max_seq_len": 512, "context_max_len": 1024, "embedding_dim": 64,
              "num_files": 1, "checkpoint": None, "model": "/nowhere/model", "base_model": None,
              "model_identity": {"path": "/nowhere/model", "files": [{"name": "model.safetensors", "size": 10,
                                                                      "mtime_ns": 1, "sha256": "a" * 64}]},
              "embeddings_sha256": "b" * 64, "file_sizes": {"embeddings.safetensors": 100},
              "dtype": "bfloat16", "created_at": "2026-12-05"}


@FUZZ
@given(st.one_of(JSON, damaged(INDEX_META), st.binary(max_size=64)))
def test_an_index_json_reads_as_one_its_readers_can_use_or_one_line(tmp_path: Path, value: Any) -> None:
    folder = tmp_path / "index"
    folder.mkdir(exist_ok=True)
    _write(folder / INDEX_FILE, value)
    try:
        meta = read_meta(folder)
    except PremiseIndexError as exc:
        _one_line(exc, folder)
        return
    # What loading reads of it before any model: the lengths, the model named, its identity.
    assert 1 <= int(meta["max_seq_len"]) <= 1 << 16 and int(meta.get("context_max_len") or 1024) >= 1
    model_identity.digest(meta.get("model_identity"))
    try:
        check_model(folder, meta, tmp_path / "model", force=True)
    except PremiseIndexError as exc:
        _one_line(exc, folder)


RESULT = {"program": "evaluate", "checkpoint": "c", "world_size": 2, "dataset": "/d",
          "evaluations": [{"dataset": "/d", "metrics": EVAL["metrics"]}], "index": "i",
          "timings": {"total": 1.0}, "premises_embedded": 3, "peak_rss_mb": 100.0, "wall_seconds": 2.0}


@FUZZ
@given(st.one_of(JSON, damaged(RESULT), st.binary(max_size=64)))
def test_a_result_json_reads_as_one_its_readers_can_use_or_one_line(tmp_path: Path, value: Any) -> None:
    path = tmp_path / "result.json"
    _write(path, value)
    try:
        result = read_result(path)
    except ResultUnreadableError as exc:
        _one_line(exc, path)
        return
    # What the flow reads of an evaluation's result (flows/stages.py) and the report of any job's.
    for evaluation in result.get("evaluations") or []:
        assert isinstance(evaluation["metrics"], dict)
    for seconds in (result.get("timings") or {}).values():
        assert float(seconds) >= 0


@pytest.mark.parametrize("edit, match", [
    (lambda r: r.update(evaluations="none"), "evaluations: must be a valid list"),
    (lambda r: r.update(world_size=0), "world_size: must be greater than or equal to 1"),
    (lambda r: r["timings"].update(total=-1.0), "timings.total: -1.0 is not a number of seconds"),
    (lambda r: r["evaluations"][0]["metrics"].update(MRR=2.0), "evaluations.0.metrics.MRR: must be less than"),
])
def test_a_result_json_of_the_wrong_shape_is_one_line_naming_the_key(tmp_path: Path, edit, match) -> None:
    value = copy.deepcopy(RESULT)
    edit(value)
    _write(tmp_path / "result.json", value)
    with pytest.raises(ResultUnreadableError, match=match.replace("(", r"\(").replace(".", r"\.")) as refused:
        read_result(tmp_path / "result.json")
    _one_line(refused.value, tmp_path / "result.json")
