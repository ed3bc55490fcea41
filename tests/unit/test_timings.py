"""A job's clock: every second goes to exactly one part (the innermost open one), so the parts add up to the total;
and the report's table of where a run's time went, read from a manifest."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from leanagent.ground.results import TrainResult
from leanagent.ground.timings import PART_NAMES, JobClock, process_start_time
from leanagent.report.timing import JobCost, job_costs, time_markdown, time_text
from leanagent.run.manifest import ManifestRecord, stage_name


class Ticks:
    """A monotonic clock the test moves by hand: the figures are exact, whatever the machine is doing."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture
def ticks() -> Ticks:
    return Ticks()


def test_nested_parts_are_exclusive_and_add_up_to_the_total(ticks: Ticks) -> None:
    clock = JobClock(started_at=time.time(), now=ticks)
    ticks.advance(3)  # imports, model load: startup
    with clock.part("data"):
        ticks.advance(1)
    clock.ready()
    clock.start("train_loader")
    ticks.advance(0.5)
    with clock.part("train_steps"):
        ticks.advance(4)
    with clock.part("rank"):
        ticks.advance(0.25)
        with clock.part("embed"):  # validation's embedding, inside validation: counted once, as embed
            ticks.advance(2)
        with clock.part("mining"):
            ticks.advance(0.75)
    clock.stop("train_loader")
    ticks.advance(0.5)  # after startup, time nobody claims is "other"
    timings = clock.timings()
    assert timings == {"startup": 3.0, "data": 1.0, "train_steps": 4.0, "train_loader": 0.5, "embed": 2.0,
                       "rank": 0.25, "mining": 0.75, "other": 0.5, "total": 12.0}
    assert sum(v for k, v in timings.items() if k != "total") == timings["total"]
    assert list(timings)[:-1] == [p for p in PART_NAMES if p in timings]  # the table's order


def test_stopping_an_outer_part_closes_what_was_left_open_inside_it(ticks: Ticks) -> None:
    clock = JobClock(started_at=time.time(), now=ticks)
    clock.ready()
    clock.start("rank")
    clock.start("embed")
    ticks.advance(2)
    clock.stop("rank")  # an exception left embed open: it ends with its caller
    ticks.advance(1)
    clock.stop("embed")  # no longer open: nothing happens
    clock.start("rank")
    clock.start("rank")  # already the innermost: not opened twice
    ticks.advance(1)
    clock.stop("rank")
    assert clock.timings() == {"embed": 2.0, "rank": 1.0, "other": 1.0, "total": 4.0}


def test_startup_counts_from_the_process_start(ticks: Ticks) -> None:
    clock = JobClock(started_at=time.time() - 5.0, now=ticks)  # the process began 5 s before the clock
    clock.ready()
    timings = clock.timings()
    assert timings["startup"] == pytest.approx(5.0, abs=0.5) and timings["total"] == timings["startup"]


def test_a_clock_syncs_the_device_at_every_switch(ticks: Ticks) -> None:
    calls: list[int] = []
    clock = JobClock(started_at=time.time(), now=ticks, sync=lambda: calls.append(1))
    with clock.part("embed"):
        pass
    assert len(calls) == 2


def _manifest() -> ManifestRecord:
    """A version 2 manifest (an evaluation stage's job under `job`), read as today's."""
    evaluation = {"out": "00-a/evaluate-00", "timings": {"embed": 3.0, "rank": 1.0, "startup": 2.0, "total": 6.0},
                  "premises_embedded": 150, "premises_in_corpora": 400, "wall_seconds": 8.0}
    untrained = {**evaluation, "out": "untrained/evaluate-00-01"}
    scored = {"metrics": {"Recall@10": 50.0}, "checkpoint": "c"}
    stages = {
        "eval-untrained": {"status": "done", "result": {**scored, "job": untrained}},
        "train": {"status": "done", "result": {"checkpoint": "a.ckpt",
                                               "timings": {"startup": 2.0, "train_steps": 5.0, "embed": 1.0,
                                                           "total": 8.0},
                                               "premises_embedded": 100, "premises_in_corpora": 200,
                                               "wall_seconds": 10.0}},
        "fisher": {"status": "done", "result": {"fisher": "a.safetensors", "timings": {"fisher": 3.0, "total": 4.0}}},
        "eval-00-a": {"status": "done", "result": {**scored, "job": evaluation}},
    }
    second = {"eval-untrained": {"status": "done", "result": {**scored, "job": untrained}},
              "train": {"status": "running"}}
    return ManifestRecord.model_validate({"version": 2, "order": ["a", "b"],
                                          "repos": {"00-a": {"stages": stages}, "01-b": {"stages": second}}})


def test_the_time_table_has_each_job_once_in_the_order_they_ran() -> None:
    costs = job_costs(_manifest())
    # The untrained evaluation is one job for both repositories; b's training has not finished.
    assert [c.job for c in costs] == ["untrained/evaluate-00-01", stage_name(0, "a", "train"),
                                      stage_name(0, "a", "fisher"), "00-a/evaluate-00"]
    train = costs[1]
    assert train.total == 10.0 and train.seconds["launch"] == 2.0  # the launcher's wall time less the ranks'
    assert train.share("train_steps") == 0.5
    text = time_text(costs)
    assert "Where the time went" in text
    head, *rows = [line for line in text.splitlines()[1:] if line.strip()][:5]
    assert head.split()[:3] == ["job", "seconds", "startup"]
    assert rows[1].split()[:3] == ["00-a/train", "10.0", "20%"] and "100 of 200" in rows[1]
    total = text.splitlines()[6]
    assert total.startswith("all jobs") and total.split()[2] == "30.0" and "400 of 1,000" in total
    assert "embed" in text and "embedding premises for retrieval" in text  # each column's meaning
    assert "| 00-a/fisher | 4.0 |" in time_markdown(costs)


def test_jobs_recorded_before_timings_existed_are_left_out() -> None:
    assert JobCost.of("old", TrainResult(program="train", checkpoint="a.ckpt")) is None
    assert time_text([]) == "" and time_markdown([]) == ""



def test_a_process_knows_when_it_started_to_the_clock_tick():
    """A child's start, as it reads it after its imports, lies between the moments just before and just after it was
    spawned, within a clock tick (10 ms) each side: not a whole-second boot time away (psutil's create_time)."""
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "from leanagent.ground.timings import process_start_time as t; "
                                                    "print(repr(t()))"], stdout=subprocess.PIPE, text=True)
    after = time.time()
    started = float(child.communicate(timeout=300)[0])
    assert before - 0.02 <= started <= after + 0.02, (before, started, after)
    assert process_start_time() <= before  # this process, long started
