"""Lifelong metrics over the recall matrix, against values worked out by hand."""

import pytest

from leanagent.report import UNTRAINED, RunReport


def _eval(r10: float) -> dict:
    return {"metrics": {"Recall@1": r10 / 2, "Recall@10": r10, "MRR": r10 / 3}}


def test_lifelong_metrics_by_hand():
    report = RunReport(["a", "b", "c"])
    report.set_baseline([_eval(0.2), _eval(0.3), _eval(0.1)])
    report.add_repository(0, {"epoch": 1, "checkpoint": "a.ckpt"}, [_eval(0.8)])
    report.add_repository(1, {"epoch": 2, "checkpoint": "b.ckpt"}, [_eval(0.6), _eval(0.9)])
    report.add_repository(2, {"epoch": 3, "checkpoint": "c.ckpt"}, [_eval(0.5), _eval(0.7), _eval(0.7)])
    assert report.matrix == [[0.8, None, None], [0.6, 0.9, None], [0.5, 0.7, 0.7]]
    m = report.lifelong_metrics()
    assert m["average"] == pytest.approx((0.5 + 0.7 + 0.7) / 3)
    # Forgetting: a fell from 0.8 to 0.5, b from 0.9 to 0.7: mean(-0.3, -0.2)
    assert m["backward_transfer"] == pytest.approx(-0.25)
    # Final row minus the untrained row: mean(0.3, 0.4, 0.6)
    assert m["gain_over_untrained"] == pytest.approx(((0.5 - 0.2) + (0.7 - 0.3) + (0.7 - 0.1)) / 3)
    assert report.rows[1]["avg R@10 (seen)"] == pytest.approx(0.75)
    text = report.text()
    assert UNTRAINED in text and "backward transfer: -0.250" in text
    assert "| (untrained) | 0.200 | 0.300 | 0.100 |" in report.markdown("m.json")


def test_metrics_of_an_empty_run_are_none():
    assert set(RunReport(["a"]).lifelong_metrics().values()) == {None}
