"""Session fixtures shared by suites that need a Prefect server or real (tiny) training inputs.

Both are session-scoped because they are the slow part: a Prefect server takes seconds to start
on two cores, and the demo data and tiny model are inputs, not the thing under test. Neither is
autouse, so suites that need neither (data, unit) start no server.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
import yaml

from tests.waiting import wait_for

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class DemoAssets:
    repos: list[Path]
    model: Path


def pytest_configure(config: pytest.Config) -> None:
    """SIGINT back to Python's default when the suite was started with it ignored.

    A shell starts a background command (`cmd &`, no job control) with SIGINT ignored, and an ignored signal
    stays ignored across exec, in every command a test starts. The tests that Ctrl-C a command then wait
    for nothing: `leanagent` keeps an ignored SIGINT ignored, as `nohup` asks. A handled signal is reset to
    its default at exec, so the commands start as under a terminal's foreground.
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _slow_tests() -> dict[str, float]:
    """tests/slow_tests.txt as scripts/slowest_tests.py (which writes it) reads it."""
    spec = importlib.util.spec_from_file_location("slowest_tests", REPO_ROOT / "scripts" / "slowest_tests.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules.setdefault(spec.name, module)  # a dataclass looks its module up there
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.read_slow_list()


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by mark
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`slow` on every test tests/slow_tests.txt lists: over 30 s in a run of the suite (docs/testing.md)."""
    slow = _slow_tests()
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def prefect_harness() -> Iterator[None]:
    """A temporary Prefect server and database for the session; request it (usefixtures) where flows run."""
    from prefect.testing.utilities import prefect_test_harness

    with pytest.MonkeyPatch.context() as env:
        # A deployment run held back by its concurrency limit is retried after this wait (Prefect's default 30 s,
        # read by the server as it starts): the scheduled-deployment test waits for one such retry.
        env.setenv("PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS", "2")
        with prefect_test_harness(server_startup_timeout=120):
            yield


# The dependency every test repository carries, as LeanAgent's carry Mathlib (the same files in every corpus, of
# which each repository imports a part): small, so that a test's evaluation still embeds in a blink.
TEST_DEPENDENCY = {"files": 12, "premises": 150}


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory: pytest.TempPathFactory) -> DemoAssets:
    """Three synthetic LeanDojo repositories sharing a dependency, and a tiny random ByT5 encoder, built once."""
    from leanagent.data.synthetic import write_demo_repos
    from leanagent.data.synthetic_scale import ScaleSpec
    from leanagent.model.presets import write_random_encoder

    root = tmp_path_factory.mktemp("demo")
    repos = write_demo_repos(root / "data", 3, dependency=ScaleSpec(**TEST_DEPENDENCY))
    model = root / "model"
    write_random_encoder(model, "tiny")
    return DemoAssets(repos=[Path(p) for p in repos], model=model)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random ByT5 encoder folder (seed 0), shared by every test that only reads it."""
    from leanagent.model.presets import write_random_encoder

    return write_random_encoder(tmp_path_factory.mktemp("tiny_model") / "model", "tiny", seed=0)


@pytest.fixture(scope="session")
def unit_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One small synthetic LeanDojo repository (seed 3), shared by every test that only reads it."""
    from leanagent.data.synthetic import write_demo_repos

    return write_demo_repos(tmp_path_factory.mktemp("unit_repo") / "data", 1, seed=3)[0]


@pytest.fixture(scope="session")
def ddp_assets(tmp_path_factory) -> dict[str, Path]:
    """Two synthetic repositories (seed 7) and a tiny encoder: the DDP and SLURM jobs' inputs."""
    root = tmp_path_factory.mktemp("ddp_assets")
    from leanagent.data.synthetic import write_demo_repos
    from leanagent.model.presets import write_random_encoder

    repos = write_demo_repos(root / "data", 2, seed=7)
    model = write_random_encoder(root / "model", "tiny", seed=0)
    return {"root": root, "repo_a": repos[0], "repo_b": repos[1], "model": model}


def read_json(path: Path) -> Any:
    """A JSON file as it was written (a job's result.json, a run's manifest), for a test to look at its keys."""
    return json.loads(Path(path).read_text())


def file_times(folder: Path) -> dict[str, int]:
    """Every file under `folder` with its mtime: equal before and after means nothing was written there."""
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*")) if p.is_file()}


@dataclass(frozen=True)
class FinishedRun:
    config_path: Path
    run_dir: Path
    flow_run_id: UUID
    summary: dict


@pytest.fixture(scope="session")
def lifelong_run3(prefect_harness: None, tmp_path_factory: pytest.TempPathFactory, demo_assets: DemoAssets,
                  write_cpu_config: Callable[..., Path]) -> FinishedRun:
    """The lifelong flow on the three demo repositories (2 gloo ranks, one epoch each, EWC 0.1), run once.

    It is the slow part of every test that reads a finished `single` run: the flow's own tests, `merge_all`'s
    comparison, and the SLURM flow's local reference. Tests only read it, or rerun it to see nothing change.
    """
    from leanagent.flows.lifelong import lifelong_retrieval

    root = tmp_path_factory.mktemp("lifelong")
    # Its folder's name is the run's label in `leanagent report` ("single" beside "merge_all").
    config_path = write_cpu_config(root / "config.yaml", root / "single", demo_assets.repos[:3])
    with pytest.MonkeyPatch.context() as env:
        # Every rank line, Lightning's per-job ones included: rank 1 prints little else, and the flow's tests
        # check that the lines of both ranks reach the flow run's logs.
        env.setenv("LEANAGENT_VERBOSE", "1")
        # What torchrun gives 2 local ranks anyway; a SLURM job's single rank per node needs it said, and the
        # SLURM flow test compares its matrix with this run's bit for bit.
        env.setenv("OMP_NUM_THREADS", "1")
        state = lifelong_retrieval(config_path=str(config_path), return_state=True)
    assert state.is_completed(), state.message
    return FinishedRun(config_path, root / "single", state.state_details.flow_run_id, state.result())


@dataclass(frozen=True)
class MergeAllRun(FinishedRun):
    repos: list[Path]  # the copies of the three demo repositories it ran on


@pytest.fixture(scope="session")
def merge_all_run3(prefect_harness: None, tmp_path_factory: pytest.TempPathFactory, demo_assets: DemoAssets,
                   write_cpu_config: Callable[..., Path]) -> MergeAllRun:
    """`lifelong_run3`'s config under `lifelong.dataset_strategy: merge_all`, on copies of its repositories (a test
    may edit one, and restores it), run once: merge_all's own tests, and the sweep's reference for that setup."""
    import shutil

    from leanagent.flows.lifelong import lifelong_retrieval

    root = tmp_path_factory.mktemp("merge_all")
    repos = [Path(shutil.copytree(r, root / "data" / r.name)) for r in demo_assets.repos[:3]]
    config = write_cpu_config(root / "merge_all.yaml", root / "merge_all", repos,
                              lifelong={"dataset_strategy": "merge_all"})
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")  # as `lifelong_run3`: compared with runs of other layouts bit for bit
        state = lifelong_retrieval(config_path=str(config), return_state=True)
    assert state.is_completed(), state.message
    return MergeAllRun(config, root / "merge_all", state.state_details.flow_run_id, state.result(), repos)


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


# Which launcher starts a test's jobs (docs/testing.md lists which tests use which): `warm` forks the ranks from the
# session's fork server, which has imported torch, Lightning and the rank programs once; `local` (torchrun) where
# torchrun is what a test is about.
WARM, TORCHRUN = "warm", "local"


class ForkServer:
    """The session's fork server for `launcher: warm` (leanagent/launch/warm.py), started when the first warm config
    is written; LEANAGENT_FORK_SERVER names it to every launcher of the session, in this process and the commands
    it starts."""

    def __init__(self, folder: Path, env: pytest.MonkeyPatch) -> None:
        self.folder = folder
        self.env = env
        # The session's environment, not a test's (its imports read some variables once, for every job).
        self.server_env = dict(os.environ)
        self.proc: subprocess.Popen | None = None

    def ensure(self) -> None:
        from leanagent.launch.warm import SERVER_ENV, start_fork_server

        if self.proc is None:
            socket_path = self.folder / "fork.sock"
            self.proc = start_fork_server(socket_path, self.folder / "fork-server.log", self.server_env)
            self.env.setenv(SERVER_ENV, str(socket_path))

    def wait_ready(self) -> None:
        """Until the server has done its imports (a job sent earlier waits for them, counted in its own time)."""
        from leanagent.launch.warm import READY

        self.ensure()
        log = self.folder / "fork-server.log"
        wait_for(lambda: READY in log.read_text(), 600, "the fork server's imports", self.proc, log.read_text)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=60)


@pytest.fixture(scope="session")
def fork_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    with pytest.MonkeyPatch.context() as env:
        server = ForkServer(tmp_path_factory.mktemp("fork"), env)
        try:
            yield server
        finally:
            server.stop()


BASE_CPU_CONFIG: dict[str, Any] = {
    "model": {"warmup_steps": 5, "max_seq_len": 256, "num_retrieved": 100, "lr": 1e-3},
    "data": {"batch_size": 4, "eval_batch_size": 16, "num_workers": 0, "max_seq_len": 256},
    "trainer": {"accelerator": "cpu", "devices": 2, "precision": "auto", "accumulate_grad_batches": 1},
    "lifelong": {"epochs_per_repo": 1, "ewc_lambda": 0.1},
}


def write_cpu_config_file(path: Path, *, encoder: Path, run_dir: Path | None = None, repos: Sequence[Path] = (),
                          launcher: str = WARM, **sections: Any) -> Path:
    """The tests' one CPU config writer: a 2-rank CPU config YAML at `path`, training `encoder`; its path.

    `sections` are merged into the config key by key (`trainer={"devices": 1}`); a top-level value replaces it. The
    tests train in the CPU's own precision (`auto`: fp32 where bf16 autocast would be emulated, several times slower;
    bf16-mixed on a CPU with bf16 matmuls), as the demo does: what they check (orchestration, continuation, reruns,
    resumes) is the same in either. A warm config needs the session's fork server: write it with `write_cpu_config`.
    """
    cfg = {"launcher": launcher, **_merge(BASE_CPU_CONFIG, {"model": {"name_or_path": str(encoder)}})}
    if run_dir is not None:
        cfg["run_dir"] = str(run_dir)
    if repos:
        cfg["repos"] = [{"path": str(p)} for p in repos]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(_merge(cfg, sections), sort_keys=False))
    return path


@pytest.fixture(scope="session")
def write_cpu_config(demo_assets: DemoAssets, fork_server: ForkServer) -> Callable[..., Path]:
    """`write_cpu_config(path, run_dir=None, repos=(), encoder=None, launcher=WARM, **sections)`:
    `write_cpu_config_file`, the encoder the demo's tiny one unless given, and for a warm config the session's fork
    server started."""

    def write(path: Path, run_dir: Path | None = None, repos: Sequence[Path] = (), *, encoder: Path | None = None,
              launcher: str = WARM, **sections: Any) -> Path:
        if launcher == WARM:
            fork_server.ensure()
        return write_cpu_config_file(path, encoder=encoder or demo_assets.model, run_dir=run_dir, repos=repos,
                                     launcher=launcher, **sections)

    return write


@pytest.fixture
def unwritable_folder(tmp_path: Path) -> Iterator[Path]:
    """An empty folder in which no new file can be made, for whoever runs the tests: mode 0555, and for root (whom
    modes do not stop) the immutable attribute too (`chattr +i`); skipped where neither holds on this filesystem.
    Made writable again afterwards, so that pytest can remove it."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    immutable = os.geteuid() == 0 and shutil.which("chattr") is not None and subprocess.run(
        ["chattr", "+i", str(folder)], capture_output=True).returncode == 0
    try:
        try:
            (folder / "probe").touch()
        except OSError:
            yield folder
        else:
            pytest.skip(f"no way to make {folder} unwritable here (mode 0555 does not stop root, chattr +i failed)")
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        folder.chmod(0o755)
