"""Following a run: a swap lets requests in flight finish on the old stage and then frees it; a stage whose index
cannot be used is not taken, said once, and the next stage is. (The run itself, continued while `leanagent serve
RUN_DIR` answers a client: tests/prefect/test_prefect_continue.py.)"""

from __future__ import annotations

import gc
import json
import shutil
import time
import weakref
from pathlib import Path

import pytest

from leanagent.index.files import EMBEDDINGS_FILE
from leanagent.index.query import PremiseIndex
from leanagent.run.manifest import MANIFEST_NAME, repo_key
from leanagent.serve import PremiseServer, RetrieveRequest, ServerHolder, StageFollower, StageInfo, run_stages
from leanagent.serve.follow import Stage, StageRefused, check_inside

from .conftest import STATE


def _server(folder: Path, stage: Stage | None = None) -> PremiseServer:
    info = StageInfo(stage.name, stage.position) if stage else None
    return PremiseServer(PremiseIndex.load(folder, dtype="fp32"), stage=info)


def test_a_swap_lets_a_request_in_flight_finish_on_the_old_server_and_then_frees_it(built) -> None:
    folder = built["root"] / "index"
    old, new = _server(folder), _server(folder)
    holder = ServerHolder(old)
    request = RetrieveRequest(state=STATE, k=3)
    old_index = weakref.ref(old.index)
    with holder.using() as server:
        assert server is old
        holder.swap(new)  # a newer stage arrives while the request runs
        assert holder.current is new
        assert server.retrieve(request) == new.retrieve(request)  # answered, on the server it started on
        thread = old.batcher._thread
    thread.join(timeout=60)  # its last request answered, the old server was closed: its encoder thread ends
    assert not thread.is_alive()
    del old, server, thread
    gc.collect()
    assert old_index() is None  # nothing holds the old index any more: its memory goes back
    with holder.using() as server:
        assert server is new


def _manifest(run_dir: Path, stages: list[tuple[str, Path]]) -> None:
    """A run's manifest whose stages are done, each with its evaluation's index."""
    names = [name for name, _ in stages]
    repos = {}
    for i, (name, folder) in enumerate(stages):
        evaluations = {f"eval-{j:02d}-{names[j]}": {"status": "done", "result": {
            "metrics": {"Recall@10": 50.0}, "job": {"out": f"{repo_key(i, name)}/evaluate", "index": str(folder)}}}
            for j in range(i + 1)}
        repos[repo_key(i, name)] = {"index": i, "name": name, "stages": evaluations}
    (run_dir / MANIFEST_NAME).write_text(json.dumps({"order": names, "repos": repos}))


def _stage_index(built, run_dir: Path, name: str) -> Path:
    """The session's index copied where a run writes a stage's (RUN_DIR/index/NAME): a server serves no other."""
    return shutil.copytree(built["root"] / "index", run_dir / "index" / name)


def test_a_broken_stage_is_said_once_and_the_next_one_is_taken(built, tmp_path) -> None:
    run_dir = tmp_path / "run"
    folder = _stage_index(built, run_dir, "00-a")
    broken = _stage_index(built, run_dir, "01-b")
    (broken / EMBEDDINGS_FILE).write_bytes(b"not embeddings")
    _manifest(run_dir, [("a", folder)])
    [first] = run_stages(run_dir)
    holder = ServerHolder(_server(first.index, first))
    lines: list[str] = []
    follower = StageFollower(run_dir, holder, first, lambda s: _server(s.index, s), lines.append)
    assert follower.check() is None and holder.current.stage == StageInfo("a", 0)  # nothing newer
    _manifest(run_dir, [("a", folder), ("b", broken)])
    assert follower.check() is None and follower.check() is None
    assert len(lines) == 1 and lines[0].startswith("warning: stage b (#2) cannot be served, still serving a: ")
    assert "embeddings.safetensors" in lines[0] and holder.current.stage.name == "a"
    _manifest(run_dir, [("a", folder), ("b", broken), ("c", folder)])
    taken = follower.check()
    assert taken is not None and taken.name == "c" and holder.current.stage == StageInfo("c", 2)
    assert lines[-1].startswith("now serving stage c (#3)") and len(lines) == 2
    assert holder.current.health()["stage"] == "c" and holder.current.health()["stage_number"] == 3


def _wait(condition, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not within the time given"
        time.sleep(0.02)


def test_following_survives_a_manifest_of_the_wrong_shape_and_takes_the_stage_written_after(built, tmp_path) -> None:
    """A manifest that is JSON of the wrong shape killed the follower's thread with a traceback, and no later stage
    was ever taken. Now: one line while it lasts, and the next valid manifest's stage is served."""
    run_dir = tmp_path / "run"
    folder = _stage_index(built, run_dir, "00-a")
    _manifest(run_dir, [("a", folder)])
    [first] = run_stages(run_dir)
    holder = ServerHolder(_server(first.index, first))
    lines: list[str] = []
    follower = StageFollower(run_dir, holder, first, lambda s: _server(s.index, s), lines.append, every_s=0.05)
    follower.start()
    try:
        for bad in ({"order": 5, "repos": {}}, {"order": ["a"], "repos": {"00-a": {"stages": []}}}):
            (run_dir / MANIFEST_NAME).write_text(json.dumps(bad))
            _wait(lambda: any("cannot follow the run" in line for line in lines))
            time.sleep(0.3)  # several polls: still one line
            assert len(lines) == 1 and "manifest.json" in lines[0] and "\n" not in lines[0], lines
            assert follower.is_alive()
            lines.clear()
        (run_dir / MANIFEST_NAME).write_text("{\"order\": [\"a\"], \"rep")  # cut short
        _wait(lambda: bool(lines))
        assert "cut short" in lines[0], lines
        _manifest(run_dir, [("a", folder), ("b", _stage_index(built, run_dir, "01-b"))])
        _wait(lambda: holder.current.stage == StageInfo("b", 1))
        assert lines[-1].startswith("now serving stage b (#2)")
    finally:
        follower.stop()
        follower.join(timeout=60)


def test_an_index_outside_the_run_is_not_served(built, tmp_path) -> None:
    """The manifest, or a link in the run's folder, naming an index elsewhere: refused in one line, resolved."""
    run_dir = tmp_path / "run"
    folder = _stage_index(built, run_dir, "00-a")
    (run_dir / "index" / "01-b").symlink_to(built["root"] / "index")  # a valid index, outside the run
    _manifest(run_dir, [("a", folder), ("b", run_dir / "index" / "01-b")])
    with pytest.raises(StageRefused, match="outside the run's folder"):
        check_inside(run_dir, run_stages(run_dir)[-1])
    first = run_stages(run_dir)[0]
    holder = ServerHolder(_server(first.index, first))
    lines: list[str] = []
    follower = StageFollower(run_dir, holder, first, lambda s: _server(s.index, s), lines.append)
    assert follower.check() is None and holder.current.stage.name == "a"
    assert len(lines) == 1 and "outside the run's folder" in lines[0]
