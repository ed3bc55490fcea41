"""Session fixtures shared by suites that need a Prefect server or real (tiny) training inputs.

Both are session-scoped because they are the slow part: a Prefect server takes seconds to start
on two cores, and the demo data and tiny model are inputs, not the thing under test. Neither is
autouse, so suites that need neither (data, unit) start no server.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
import yaml


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


@pytest.fixture(scope="session")
def write_cpu_config(demo_assets: DemoAssets) -> Callable[..., Path]:
    """Write a 2-rank CPU config YAML; call it as `write_cpu_config(path, run_dir, repos, **section_overrides)`.

    The flows' tests train in the CPU's own precision (`auto`: fp32 where bf16 autocast would be emulated, several
    times slower; bf16-mixed on a CPU with bf16 matmuls), as the demo does: what these tests check (orchestration,
    continuation, reruns) is the same in either precision.
    """

    def write(path: Path, run_dir: Path, repos: list[Path], **overrides: Any) -> Path:
        cfg: dict[str, Any] = {
            "model": {"name_or_path": str(demo_assets.model), "warmup_steps": 5, "max_seq_len": 256,
                      "num_retrieved": 100, "lr": 1e-3},
            "data": {"batch_size": 4, "eval_batch_size": 16, "num_workers": 0, "max_seq_len": 256},
            "trainer": {"accelerator": "cpu", "devices": 2, "precision": "auto", "accumulate_grad_batches": 1},
            "lifelong": {"epochs_per_repo": 1, "ewc_lambda": 0.1},
            "run_dir": str(run_dir),
            "repos": [{"path": str(p)} for p in repos],
        }
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(_merge(cfg, overrides), sort_keys=False))
        return path

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
