"""A sweep before and after its flow, without Prefect: the sweep file's checks (one line naming the file, the setup's
line and the key, before anything is written), a job's identity by content (`leanagent.run.identity`), a shared job
made a setup's own (`leanagent.run.shared`), the identity's lock, and `leanagent report SWEEP_DIR`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from leanagent.cli import main
from leanagent.data.merge import merge_datasets
from leanagent.ground.config import ConfigError, PipelineConfig, RepoConfig
from leanagent.ground.job import PROGRAMS, JobRequest
from leanagent.ground.results import EvaluateResult
from leanagent.run.identity import IGNORED, dataset_identity, job_identity
from leanagent.run.manifest import EVAL_UNTRAINED, TRAIN, RepoEntry, eval_stage, stage_name
from leanagent.run.shared import REQUEST_FILE, SharedRun, SharedWork, relocate
from leanagent.run.state import RunState
from leanagent.run.sweep import SWEEP_RECORD, load_sweep_file, plan_sweep
from leanagent.tasks.shared import FlockLockManager
from tests.stage_results import finished

REPO_ROOT = Path(__file__).resolve().parents[2]
BASE = {"model": {"lr": 1e-3}, "trainer": {"accelerator": "cpu", "devices": 2}}


def _sweep(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    return path


def _base(tmp_path: Path, demo_assets, repos: list[Path]) -> Path:
    path = tmp_path / "conf" / "base.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({**BASE, "model": {"name_or_path": str(demo_assets.model)},
                                    "repos": [{"path": str(p)} for p in repos]}))
    return path


def _plan(path: Path, overrides: list[str] = ()):
    loaded = load_sweep_file(path)
    return plan_sweep(loaded.sweep, str(path), loaded.path.parent, list(overrides), loaded.lines)


# ---- the sweep file ---------------------------------------------------------------------------------------------

def test_each_setup_is_the_base_with_its_overrides_in_a_folder_of_the_sweep(tmp_path: Path, demo_assets) -> None:
    _base(tmp_path, demo_assets, demo_assets.repos[:1])
    path = _sweep(tmp_path, "base: conf/base.yaml\nsweep_dir: out\nmax_parallel: 2\nsetups:\n"
                            "  plain: []\n  ewc: [lifelong.ewc_lambda=0.1]\n")
    plan = _plan(path, ["lifelong.epochs_per_repo=2"])
    assert [s.name for s in plan.setups] == ["plain", "ewc"] and plan.max_parallel == 2
    plain, ewc = (s.plan.cfg for s in plan.setups)
    assert plain.run_dir == tmp_path / "out" / "plain" and ewc.run_dir == tmp_path / "out" / "ewc"
    assert (plain.lifelong.ewc_lambda, ewc.lifelong.ewc_lambda) == (0.0, 0.1)
    assert plain.lifelong.epochs_per_repo == ewc.lifelong.epochs_per_repo == 2  # the overrides of every setup
    assert plain.repos[0].path == demo_assets.repos[0]
    assert not (tmp_path / "out").exists()  # checked, nothing written


def test_an_inline_base_resolves_its_paths_against_the_sweep_file(tmp_path: Path, demo_assets) -> None:
    shutil.copytree(demo_assets.repos[0], tmp_path / "data" / "repo_0")
    inline = {**BASE, "model": {"name_or_path": str(demo_assets.model)}, "repos": [{"path": "data/repo_0"}]}
    path = _sweep(tmp_path, yaml.safe_dump({"base": inline, "sweep_dir": "out", "setups": {"only": []}}))
    [setup] = _plan(path).setups
    assert setup.plan.cfg.repos[0].path == tmp_path / "data" / "repo_0"


@pytest.mark.parametrize(("text", "expected"), [
    # two setups of one name: YAML would silently keep the second
    ("setups:\n  a: []\n  b: []\n  a: [model.lr=0.1]\n", r"sweep.yaml, line 6: 'a' is given twice \(first on line 4\)"),
    ("setups:\n  a: [lifelong.ewc_lamda=0.1]\n",
     r"sweep.yaml, line 4: setup 'a' \(lifelong.ewc_lamda=0.1\): lifelong.ewc_lamda: unknown key \(did you mean "
     r"'ewc_lambda'\?\)"),
    ("setups:\n  a: [model.lr]\n", r"sweep.yaml, line 4: setup 'a' \(model.lr\): --set model.lr: expected KEY=VALUE"),
    ("setups:\n  a: [run_dir=elsewhere]\n", r"setups: setup 'a': run_dir=elsewhere: a setup's run_dir "
                                           r"is sweep_dir/a"),
    ("setups:\n  shared: []\n", r"setup 'shared': a name is a folder of sweep_dir"),
    ("setups:\n  ../up: []\n", r"setup '../up': a name is a folder of sweep_dir"),
    ("setups: {}\n", r"setups: .*at least 1 item"),
    ("setups:\n  a: []\nmax_paralel: 2\n", r"max_paralel: unknown key \(did you mean 'max_parallel'\?\)"),
    ("setups:\n  a: [lifelong.dataset_strategy=replay, lifelong.replay_fraction=1.5]\n",
     r"line 4: setup 'a' \(lifelong.dataset_strategy=replay, lifelong.replay_fraction=1.5\): lifelong.replay_fraction: "
     r".*\(0, 1\]"),
    ("setups:\n  a: [lifelong.dataset_strategy=replay, lifelong.replay_fraction=0]\n",
     r"line 4: setup 'a' .*lifelong.replay_fraction: .*\(0, 1\]"),
])
def test_bad_input_is_one_line_naming_the_file_the_line_and_the_key(tmp_path: Path, demo_assets, text: str,
                                                                      expected: str) -> None:
    _base(tmp_path, demo_assets, demo_assets.repos[:1])
    path = _sweep(tmp_path, "base: conf/base.yaml\nsweep_dir: out\n" + text)
    with pytest.raises(ConfigError, match=expected) as info:
        _plan(path)
    assert "\n" not in str(info.value) and str(info.value).startswith(str(path))
    assert not (tmp_path / "out").exists()


def test_a_sweep_dir_that_is_a_file_is_refused(tmp_path: Path, demo_assets) -> None:
    _base(tmp_path, demo_assets, demo_assets.repos[:1])
    (tmp_path / "out").write_text("my notes")
    path = _sweep(tmp_path, "base: conf/base.yaml\nsweep_dir: out\nsetups:\n  a: []\n")
    with pytest.raises(ConfigError, match=r"sweep_dir .*/out is a file, not a folder"):
        _plan(path)
    assert (tmp_path / "out").read_text() == "my notes"


def test_a_changed_setup_is_refused_naming_the_keys_that_changed(tmp_path: Path, demo_assets) -> None:
    _base(tmp_path, demo_assets, demo_assets.repos[:1])
    path = _sweep(tmp_path, "base: conf/base.yaml\nsweep_dir: out\nsetups:\n  a: []\n  b: [model.lr=0.002]\n")
    first = _plan(path)
    for setup in first.setups:  # as a run of each leaves its manifest
        entries = list(setup.plan.entries.values())
        RunState(setup.run_dir, setup.plan.cfg).extend(entries, entries)
    path.write_text(path.read_text().replace("model.lr=0.002", "model.lr=0.003"))
    with pytest.raises(ConfigError, match=r"line 5: setup 'b': .*b/manifest.json belongs to a run of a different "
                                          r"config \(model.lr: 0.002 -> 0.003\)"):
        _plan(path)


def test_the_shipped_table4_sweep_is_the_papers_eight_setups_and_two_of_replay(tmp_path: Path, demo_assets) -> None:
    """configs/leanagent-table4.yaml on a base of one's own: each of its eight LeanAgent setups is what the paper's
    Table 4 calls it (the labels of tests/fixtures/leanagent_table4, from the authors' data)."""
    loaded = load_sweep_file(REPO_ROOT / "configs" / "leanagent-table4.yaml")
    sweep = loaded.sweep.model_copy(update={"base": _base(tmp_path, demo_assets, demo_assets.repos),
                                            "sweep_dir": tmp_path / "table4"})
    plan = plan_sweep(sweep, str(loaded.path), loaded.path.parent, [], loaded.lines)
    setups = {s.name: s.plan.cfg.lifelong for s in plan.setups}
    assert list(setups) == ["leanagent", *(f"setup{k}" for k in range(1, 8)), "replay-10", "replay-50"]
    for name in list(setups)[:8]:
        label = json.loads((REPO_ROOT / "tests" / "fixtures" / "leanagent_table4" / f"{name}.json").read_text())
        label = label["label"]
        lifelong = setups[name]
        assert ("Merge All" in label) == (lifelong.dataset_strategy == "merge_all"), label
        assert ("curriculum order" in label) == lifelong.curriculum, label
        assert ("no EWC" in label) == (lifelong.ewc_lambda == 0), label
    assert [(setups[n].dataset_strategy, setups[n].replay_fraction) for n in ("replay-10", "replay-50")] == \
        [("replay", 0.1), ("replay", 0.5)]


# ---- a job's identity --------------------------------------------------------------------------------------------

def _job(program: str, datasets: list[Path], out: Path, cfg: PipelineConfig | None = None, **fields) -> JobRequest:
    return JobRequest(program=program, config=cfg or PipelineConfig(), datasets=tuple(datasets), out=out, **fields)


def test_identity_is_content_not_path(tmp_path: Path, unit_repo: Path, tiny_model: Path) -> None:
    cfg = PipelineConfig(run_dir=tmp_path / "one")
    cfg.model.name_or_path = str(tiny_model)
    moved = shutil.copytree(unit_repo, tmp_path / "elsewhere" / "renamed")
    model = shutil.copytree(tiny_model, tmp_path / "model-copy")
    here = job_identity(_job("evaluate", [unit_repo], tmp_path / "a", cfg))
    there = job_identity(_job("evaluate", [moved], tmp_path / "b", cfg.model_copy(update={
        "run_dir": tmp_path / "two", "model": cfg.model.model_copy(update={"name_or_path": str(model)})})))
    assert here == there and here.digest() == there.digest()
    (moved / "corpus.jsonl").write_text((moved / "corpus.jsonl").read_text() + "\n")
    assert job_identity(_job("evaluate", [moved], tmp_path / "b", cfg)).digest() != here.digest()


def test_ewc_lambda_is_in_a_training_identity_only_with_a_fisher(tmp_path: Path, unit_repo: Path) -> None:
    off = PipelineConfig()
    on = off.model_copy(update={"lifelong": off.lifelong.model_copy(update={"ewc_lambda": 0.1})})
    lr = off.model_copy(update={"model": off.model.model_copy(update={"lr": 2e-3})})
    fisher = tmp_path / "fisher.safetensors"
    fisher.write_bytes(b"weights")

    def digest(cfg: PipelineConfig, program: str, **fields) -> str:
        return job_identity(_job(program, [unit_repo], tmp_path / "j", cfg, **fields)).digest()

    assert digest(off, "train") == digest(on, "train")  # the first training: nothing to anchor to
    assert digest(off, "train", fisher=fisher) != digest(on, "train", fisher=fisher)
    for program in ("fisher", "evaluate"):  # neither reads it at all
        assert digest(off, program, checkpoint=fisher) == digest(on, program, checkpoint=fisher)
    assert digest(off, "train") != digest(lr, "train")
    for program in ("fisher", "evaluate"):  # no optimizer: the untrained evaluation of an lr sweep is one job
        assert digest(off, program, checkpoint=fisher) == digest(lr, program, checkpoint=fisher)
    assert set(IGNORED) == set(PROGRAMS)  # every program says what it does not read


def test_a_merge_of_one_repository_is_that_repository(tmp_path: Path, unit_repo: Path) -> None:
    merged = tmp_path / "merged"
    merge_datasets([unit_repo], merged)
    assert (merged / "random" / "train.json").read_bytes() != (unit_repo / "random" / "train.json").read_bytes()
    assert dataset_identity(merged, "random") == dataset_identity(unit_repo, "random")
    both = tmp_path / "both"
    merge_datasets([unit_repo, merged], both)  # two sources: a dataset of its own
    assert dataset_identity(both, "random") != dataset_identity(unit_repo, "random")
    (merged / "random" / "test.json").write_text("[]")  # edited after the merge: its own files, not the source's
    assert dataset_identity(merged, "random") != dataset_identity(unit_repo, "random")


# ---- a shared job made a setup's own -----------------------------------------------------------------------------

def test_a_shared_job_is_linked_into_a_setup_with_its_own_paths(tmp_path: Path) -> None:
    work = SharedWork(root=tmp_path / "sweep" / "shared")
    data_a, data_b = tmp_path / "data" / "repo", tmp_path / "sweep" / "b" / "merged" / "00-repo"
    start_a, start_b = tmp_path / "sweep" / "a" / "start.ckpt", tmp_path / "sweep" / "b" / "start.ckpt"
    own_a = _job("evaluate", [data_a], tmp_path / "sweep" / "a" / "jobs" / "ev", checkpoint=start_a,
                 index=tmp_path / "sweep" / "a" / "index" / "00-repo")
    own_b = _job("evaluate", [data_b], tmp_path / "sweep" / "b" / "jobs" / "ev", checkpoint=start_b,
                 index=tmp_path / "sweep" / "b" / "index" / "00-repo")
    shared = work.request(own_a, "ab" * 32)
    assert shared.out == work.jobs / f"evaluate-{'ab' * 10}" and shared.index == work.indexes / ("ab" * 10)
    (shared.out / "logs").mkdir(parents=True)
    (shared.out / "logs" / "rank0.log").write_text("ran once")
    scores = {"Recall@10": 50.0}
    result = EvaluateResult.model_validate({
        "program": "evaluate", "checkpoint": str(start_a), "index": str(shared.index),
        "evaluations": [{"dataset": str(data_a), "metrics": scores}], "note": f"{data_a}-not-a-path-under-it"})
    (shared.out / "result.json").write_text(json.dumps(result.as_json()))
    (shared.out / REQUEST_FILE).write_text(shared.model_dump_json())
    shared.index.mkdir(parents=True)
    (shared.index / "embeddings.safetensors").write_bytes(b"rows")
    (shared.index / "index.json").write_text(json.dumps({"checkpoint": str(start_a), "datasets": [str(data_a)]}))
    got = work.materialize(SharedRun(job=shared, result=result), own_b, log=lambda line: None)
    assert got.as_json() == {"program": "evaluate", "checkpoint": str(start_b), "index": str(own_b.index),
                             "evaluations": [{"dataset": str(data_b), "metrics": scores}],
                             "note": f"{data_a}-not-a-path-under-it"}
    assert json.loads((own_b.out / "result.json").read_text()) == got.as_json()
    assert sorted(p.name for p in own_b.out.iterdir()) == ["logs", "result.json"]  # no request.json
    assert os.path.samefile(own_b.out / "logs" / "rank0.log", shared.out / "logs" / "rank0.log")
    assert os.path.samefile(own_b.index / "embeddings.safetensors", shared.index / "embeddings.safetensors")
    assert json.loads((own_b.index / "index.json").read_text()) == {"checkpoint": str(start_b),
                                                                    "datasets": [str(data_b)]}
    # Again (a crash between the links and the manifest's record): the same, nothing moved aside.
    assert work.materialize(SharedRun(job=shared, result=result), own_b, log=print) == got
    # A folder of this setup's own earlier attempt is moved aside, not overwritten.
    (own_a.out / "logs").mkdir(parents=True)
    (own_a.out / "logs" / "rank0.log").write_text("an attempt of a's own")
    lines: list[str] = []
    work.materialize(SharedRun(job=shared, result=result), own_a, log=lines.append)
    [aside] = [p for p in own_a.out.parent.iterdir() if p.name.startswith("ev.before-sweep-")]
    assert (aside / "logs" / "rank0.log").read_text() == "an attempt of a's own" and "moved to" in lines[0]


def test_relocate_moves_paths_and_what_lies_under_them_only() -> None:
    moves = [("/s/jobs/x", "/a/jobs/t"), ("/s", "/a")]
    assert relocate({"k": ["/s/jobs/x/c.ckpt", "/s/jobs/xy", "/s", "/sx", 3, None]}, moves) == \
        {"k": ["/a/jobs/t/c.ckpt", "/a/jobs/xy", "/a", "/sx", 3, None]}


# ---- the identity's lock -----------------------------------------------------------------------------------------

def test_the_lock_makes_a_second_holder_wait_and_dies_with_its_holder(tmp_path: Path) -> None:
    locks = FlockLockManager(tmp_path / "locks")
    assert locks.acquire_lock("k", holder="first")
    got = threading.Event()

    def second() -> None:
        FlockLockManager(tmp_path / "locks").acquire_lock("k", holder="second")
        got.set()

    waiter = threading.Thread(target=second, daemon=True)
    waiter.start()
    assert not got.wait(1.0) and locks.is_locked("k") and locks.is_lock_holder("k", "first")
    locks.release_lock("k", holder="first")
    assert got.wait(30.0)
    # A holder killed with SIGKILL leaves its lock file, and the lock goes with it.
    probe = ("import sys, time; sys.path.insert(0, sys.argv[2]);\n"
             "from leanagent.tasks.shared import FlockLockManager\n"
             "FlockLockManager(sys.argv[1]).acquire_lock('other', holder='doomed'); print('held', flush=True); "
             "time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", probe, str(tmp_path / "locks"), os.getcwd()],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert locks.is_locked("other") and not locks.acquire_lock("other", holder="me", acquire_timeout=0.5)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
    assert (tmp_path / "locks" / "other.lock").exists() and not locks.is_locked("other")
    started = time.monotonic()
    assert locks.acquire_lock("other", holder="me", acquire_timeout=5.0) and time.monotonic() - started < 5.0


# ---- the sweep's table -------------------------------------------------------------------------------------------

def _finished(run_dir: Path, r10: list[float], ewc: float = 0.0) -> None:
    """A finished two-repository run (its manifest as the flow writes it)."""
    cfg = PipelineConfig(run_dir=run_dir, repos=[RepoConfig(path=Path("/data/a")), RepoConfig(path=Path("/data/b"))])
    cfg.lifelong.ewc_lambda = ewc
    state = RunState(run_dir, cfg)
    entries = [RepoEntry(r.display_name, r.path) for r in cfg.repos]
    state.extend(entries, entries)
    metrics = [finished("evaluate", metrics={"Recall@1": v / 2, "Recall@10": v, "MRR": v / 300}) for v in r10]
    for j, name in enumerate(["a", "b"]):
        state.record(stage_name(j, name, EVAL_UNTRAINED), metrics[0])
    state.record(stage_name(0, "a", TRAIN), finished("train", epoch=1, checkpoint="1.ckpt",
                                                     metrics={"Recall@10_val": 70.0}))
    state.record(stage_name(0, "a", eval_stage(0, "a")), metrics[0])
    if len(r10) > 1:
        state.record(stage_name(1, "b", TRAIN), finished("train", epoch=2, checkpoint="2.ckpt",
                                                         metrics={"Recall@10_val": 72.0}))
        state.record(stage_name(1, "b", eval_stage(0, "a")), metrics[1])
        state.record(stage_name(1, "b", eval_stage(1, "b")), metrics[2])


def test_report_of_a_sweep_has_a_row_per_setup_and_no_number_for_one_unfinished(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = tmp_path / "sweep"
    _finished(sweep / "plain", [80.0, 60.0, 90.0])
    _finished(sweep / "ewc", [80.0, 70.0, 85.0], ewc=0.1)
    _finished(sweep / "broken", [80.0])  # failed in its second repository
    record = {"version": 1, "order": ["plain", "ewc", "broken", "later"],
              "setups": {"plain": {"status": "done"}, "ewc": {"status": "done"},
                         "broken": {"status": "failed", "message": "LaunchError: rank 1 failed"},
                         "later": {"status": "waiting"}}}
    (sweep / SWEEP_RECORD).write_text(json.dumps(record))
    out = tmp_path / "table.json"
    with pytest.raises(SystemExit) as code:
        main(["report", str(sweep), "--json", str(out), "--png", str(tmp_path / "t.png")])
    assert code.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in lines[2:6]}
    assert list(rows) == ["plain", "ewc", "broken", "later"]
    assert "single, curriculum, EWC 0.1" in rows["ewc"] and "done" in rows["ewc"]
    assert rows["broken"].split()[1:] == ["failed", "(1", "of", "2", "repositories)"]  # no number at all
    assert rows["later"].split()[1:] == ["waiting"]
    assert any(line == "broken: LaunchError: rank 1 failed" for line in lines)
    table = json.loads(out.read_text())["setups"]
    plain, ewc, broken, later = table
    assert plain["final_R@10"] == pytest.approx(75.0) and ewc["final_R@10"] == pytest.approx(77.5)
    assert plain["composite"] is not None and ewc["composite"] is not None
    assert broken["final_R@10"] is None and broken["composite"] is None and broken["status"] == "failed"
    assert later["status"] == "waiting" and later["FM"] is None
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_leanagent_sweep_refuses_bad_input_in_one_line_before_prefect(tmp_path: Path, demo_assets,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    _base(tmp_path, demo_assets, demo_assets.repos[:1])
    path = _sweep(tmp_path, "base: conf/base.yaml\nsweep_dir: out\nsetups:\n  a: []\n  a: [model.lr=0.1]\n")
    started = time.monotonic()
    with pytest.raises(SystemExit) as code:
        main(["sweep", "--config", str(path)])
    assert code.value.code == 1 and time.monotonic() - started < 60
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {path}, line 5: 'a' is given twice"), err
    # The command's own keys: a --base that is no config file, named as given.
    path.write_text("base: conf/base.yaml\nsweep_dir: out\nsetups:\n  a: []\n")
    with pytest.raises(SystemExit) as code:
        main(["sweep", "--config", str(path), "--base", str(tmp_path / "missing.yaml"), "--max-parallel", "2"])
    missing = tmp_path / "missing.yaml"
    assert code.value.code == 1 and capsys.readouterr().err == f"error: {missing}: no such config file\n"
    assert not (tmp_path / "out").exists()


def test_status_and_cancel_of_a_sweep_ask_about_its_shared_jobs(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    sweep = tmp_path / "sweep"
    (sweep / "shared" / "jobs").mkdir(parents=True)
    (sweep / SWEEP_RECORD).write_text(json.dumps({"version": 1, "order": [], "setups": {}}))
    for command, said in (("status", "nothing queued"), ("cancel", "nothing queued, nothing cancelled")):
        with pytest.raises(SystemExit) as code:
            main([command, str(sweep)])
        assert code.value.code == 0 and capsys.readouterr().out.startswith(f"{sweep / 'shared'}: {said}")
