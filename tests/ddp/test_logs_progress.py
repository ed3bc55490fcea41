"""What a person sees of a real job: no known third-party noise (unless --verbose), progress lines when the
output is not a terminal, the rank log files complete, and TensorBoard runs that continue across repositories."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from leanagent.launch.quiet import NOISE

pytestmark = pytest.mark.ddp

OMP_BANNER = "Setting OMP_NUM_THREADS environment variable"
# Printed by every train job of this config (2 CPU ranks): the test is void without them. Lightning's model summary
# warns of bf16-mixed only where the job ran in it (`trainer.precision: auto`: on a CPU with bf16 matmuls).
EXPECTED_IN_RANK_LOGS = ("`isinstance(treespec, LeafSpec)` is deprecated", "Tip: For seamless cloud logging")
BF16_SUMMARY = "Precision bf16-mixed is not supported by the model summary"
# The job is short: its lines may all come from the validation that ends an epoch ("train repo_0 (validate): ...").
PROGRESS_LINE = re.compile(r"^\[progress\] train (\S+)(?: \((validate)\))?: epoch (\d+)/(\d+), "
                           r"step (\d+)/(\d+) \(\d+%\), (bf16-mixed|32-true)(, [\d.]+ examples/s)?(, ETA \S+)?$")


def _rank_logs(job: Path) -> str:
    files = sorted((job / "logs").rglob("*.log"))
    assert files, f"no rank log file under {job / 'logs'}"
    return "\n".join(f.read_text(errors="replace") for f in files)


@pytest.fixture
def jobs(ddp_jobs) -> dict:
    """Repo A from the base model, repo B from A's checkpoint (both quiet), and a --verbose evaluation (conftest)."""
    return ddp_jobs


def test_known_warnings_are_not_shown_but_stay_in_the_rank_logs(jobs):
    shown = jobs["shown_a"].stdout + jobs["shown_a"].stderr
    for pattern in NOISE:
        assert not pattern.search(shown), f"{pattern.pattern!r} was shown:\n{shown[-3000:]}"
    assert OMP_BANNER not in shown
    logs = _rank_logs(jobs["work"] / "a")
    bf16 = (BF16_SUMMARY,) if jobs["a"]["precision"] == "bf16-mixed" else ()
    for message in (*EXPECTED_IN_RANK_LOGS, *bf16):
        assert message in logs, f"{message!r} missing from the rank logs"


def test_verbose_shows_everything(jobs):
    shown = jobs["shown_ev"].stdout + jobs["shown_ev"].stderr
    assert "`isinstance(treespec, LeafSpec)` is deprecated" in shown
    assert "Using `DistributedSampler` with the dataloaders" in shown
    assert OMP_BANNER in shown


def test_plain_progress_lines_when_not_on_a_terminal(jobs):
    shown = [line for line in jobs["shown_a"].stdout.splitlines() if line.startswith("[progress]")]
    lines = [m for m in map(PROGRESS_LINE.match, shown) if m]
    assert lines and len(lines) == len(shown), f"[progress] lines not as expected:\n{jobs['shown_a'].stdout[-3000:]}"
    assert len(set(shown)) == len(shown), "the same progress line printed twice"
    assert {m.group(1) for m in lines} == {jobs["repo_a"]}
    assert all(int(m.group(4)) == 1 for m in lines)  # epochs_per_repo: 1
    # Validation beats while it embeds the corpus, before its first batch: `step 0/N` is where it is then, and
    # whether a line catches it depends on the machine's speed. Training beats only after a batch.
    assert all(0 <= int(m.group(5)) <= int(m.group(6)) for m in lines)
    assert all(int(m.group(5)) > 0 for m in lines if m.group(2) is None), "a train line before any step"
    assert int(lines[-1].group(5)) == int(lines[-1].group(6)), f"the last line is not where the job ended: {shown[-1]}"
    # Which stages a line catches depends on timing; within each stage the steps only go forward (validation counts
    # its own batches from 1).
    for stage in ("train", "validate"):
        steps = [int(m.group(5)) for m in lines if (m.group(2) or "train") == stage]
        assert steps == sorted(steps), (stage, steps)
    assert {m.group(7) for m in lines} == {jobs["a"]["precision"]}, "the progress lines name another precision"
    assert any(m.group(8) for m in lines), "no examples/s in any progress line"


def _scalars(run: Path) -> dict[str, list[int]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert list(run.glob("events.out.tfevents.*")), f"no events file in {run}"
    acc = EventAccumulator(str(run))
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_one_run_per_repository_with_continuing_steps(jobs):
    a = _scalars(jobs["work"] / "a" / "tensorboard")
    b = _scalars(jobs["work"] / "b" / "tensorboard")
    for scalars in (a, b):
        assert "loss_train_step" in scalars and any(t.startswith("lr-") for t in scalars), sorted(scalars)
        assert "Recall@10_val" in scalars
    assert max(a["loss_train_step"]) <= jobs["a"]["global_step"]
    assert min(b["loss_train_step"]) >= max(a["loss_train_step"]), "repository B's steps restart instead of continuing"
