"""The run report (rows, recall matrix, lifelong metrics after each repository) against values worked out by
hand, and `leanagent report SOURCE...` on JSON sources and on a run_dir whose manifest is written by RunState."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from leanagent.cli import main
from leanagent.ground.config import PipelineConfig, RepoConfig
from leanagent.report import UNTRAINED, RunReport, load_run, report_from_manifest
from leanagent.run.manifest import EVAL_UNTRAINED, TRAIN, RepoEntry, eval_stage, stage_name
from leanagent.run.state import RunState


def _eval(r10: float) -> dict:
    """An evaluate result: recalls in percent, MRR a fraction."""
    return {"metrics": {"Recall@1": r10 / 2, "Recall@10": r10, "MRR": r10 / 300}}


def _train(epoch: int, val: float | None) -> dict:
    return {"epoch": epoch, "checkpoint": f"{epoch}.ckpt", "metrics": {"Recall@10_val": val}}


def _three_repositories() -> RunReport:
    report = RunReport(["a", "b", "c"])
    report.set_baseline([_eval(20.0), _eval(30.0), _eval(10.0)])
    report.add_repository(0, _train(1, 70.0), [_eval(80.0)])
    report.add_repository(1, _train(2, 75.0), [_eval(60.0), _eval(90.0)])
    report.add_repository(2, _train(3, 72.0), [_eval(50.0), _eval(70.0), _eval(70.0)])
    return report


def test_lifelong_metrics_by_hand() -> None:
    report = _three_repositories()
    assert report.matrix == [[80.0, None, None], [60.0, 90.0, None], [50.0, 70.0, 70.0]]
    assert report.val_r10 == [70.0, 75.0, 72.0]
    m = report.lifelong_metrics()
    assert m["avg"] == pytest.approx([80.0, 75.0, 190.0 / 3])
    assert m["FM"] == pytest.approx(((80 - 50) + (90 - 70)) / 2)  # best of row t minus the final recall on t
    assert m["EBWT"] == pytest.approx((0 + (60 - 80) + 0) / 3)  # pairs j <= t <= 1
    assert m["WP5"] == 0.0  # the average only fell
    assert m["IP"] == pytest.approx(((75 - 70) + (72 - 75)) / 2)
    assert m["CFR"] == pytest.approx((190.0 / 3) / 80.0)
    assert m["WF5"] is None  # 3 repositories: no window of 5
    # The final model over the 3 seen: mean R@1, R@10, MRR; and its gain over the untrained row.
    assert m["final_R@1"] == pytest.approx((25 + 35 + 35) / 3)
    assert m["final_R@10"] == pytest.approx(190.0 / 3)
    assert m["final_MRR"] == pytest.approx((50 + 70 + 70) / 3 / 300)
    assert m["gain_over_untrained"] == pytest.approx(((50 - 20) + (70 - 30) + (70 - 10)) / 3)


def test_rows_carry_the_metrics_after_each_repository() -> None:
    rows = _three_repositories().rows
    assert [r["repository"] for r in rows] == ["a", "b", "c"]
    assert rows[0]["FM"] is None and rows[0]["IP"] is None and rows[0]["CFR"] == 1.0
    assert rows[1]["avg R@10 (seen)"] == pytest.approx(75.0)
    assert rows[1]["avg R@1 (seen)"] == pytest.approx(37.5)
    assert rows[1]["FM"] == pytest.approx(20.0) and rows[1]["IP"] == pytest.approx(5.0)
    assert rows[2]["FM"] == pytest.approx(25.0)
    assert rows[2]["val R@10"] == 72.0
    assert {"R@1", "R@10", "MRR", "epochs", "checkpoint"} <= set(rows[0])


def test_text_and_markdown_show_percent_and_the_metrics() -> None:
    report = _three_repositories()
    text = report.text()
    assert UNTRAINED in text and "EBWT -6.67" in text and "EBWT (higher is better): expanded backward transfer" in text
    assert "FM 25.00" in text and "R@10 gain over untrained: 43.33" in text
    md = report.markdown("m.json")
    assert "| (untrained) | 20.00 | 30.00 | 10.00 |" in md
    assert "## Lifelong metrics after each repository" in md
    assert "| b | 37.50 | 75.00 | 0.250 | - | 20.00 | 0.00 | 0.00 | 5.00 | 0.938 |" in md
    assert "| a | 40.00 | 80.00 | 0.267 | 70.00 | 1 | `1.ckpt` |" in md


def test_the_flow_summary_rebuilds_the_same_report() -> None:
    """`leanagent run` prints RunReport(order, rows, matrix, baseline): the validation curve lives in the rows."""
    report = _three_repositories()
    rebuilt = RunReport(report.names, report.rows, report.matrix, report.baseline)
    assert rebuilt.text() == report.text()
    assert rebuilt.lifelong_metrics() == report.lifelong_metrics()


def test_a_train_result_without_validation_recall_leaves_ip_unknown() -> None:
    report = RunReport(["a", "b"])
    report.add_repository(0, {"epoch": 1, "checkpoint": "a.ckpt"}, [_eval(80.0)])
    report.add_repository(1, _train(2, 75.0), [_eval(60.0), _eval(90.0)])
    assert report.lifelong_metrics()["IP"] is None and report.lifelong_metrics()["FM"] == pytest.approx(20.0)


def test_metrics_of_an_empty_run_are_none() -> None:
    m = RunReport(["a"]).lifelong_metrics()
    assert m["avg"] == [] and {v for k, v in m.items() if k != "avg"} == {None}


# ------------------------------------------------------------------------------------------------
# leanagent report SOURCE [SOURCE...]

RUN_A = {"names": ["x", "y", "z"], "test_recall_at_10": [[80.0], [95.0, 90.0], [50.0, 70.0, 70.0]],
         "val_recall_at_10": [60.0, 65.0, 62.0]}
RUN_B = {"names": ["x", "y", "z"], "test_recall_at_10": [[70.0], [70.0, 80.0], [70.0, 80.0, 90.0]],
         "val_recall_at_10": [60.0, 70.0, 80.0], "label": "steady"}


def _write(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data))
    return path


def _report(*argv: str) -> int:
    with pytest.raises(SystemExit) as exit_:
        main(["report", *argv])
    return exit_.value.code


def test_report_compares_two_json_sources(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = _write(tmp_path / "a.json", RUN_A), _write(tmp_path / "b.json", RUN_B)
    out_json, out_png = tmp_path / "out" / "metrics.json", tmp_path / "out" / "matrix.png"
    assert _report(str(a), str(b), "--json", str(out_json), "--png", str(out_png)) == 0
    printed = capsys.readouterr().out
    assert "1:a" in printed and "2:b" in printed and "2:b = steady" in printed
    assert "FM (lower is better)" in printed and "27.50" in printed  # run a's FM, in its column
    runs = json.loads(out_json.read_text())["runs"]
    assert [r["source"] for r in runs] == [str(a), str(b)]
    ra, rb = runs
    # a: avg 80, 92.5, 63.33;  b: avg 70, 75, 80
    assert ra["FM"] == pytest.approx(27.5) and rb["FM"] == pytest.approx(0.0)
    assert ra["EBWT"] == pytest.approx(5.0) and rb["EBWT"] == pytest.approx(0.0)
    assert ra["WP5"] == pytest.approx(12.5 / 3) and rb["WP5"] == pytest.approx(5.0)
    assert ra["IP"] == pytest.approx(1.0) and rb["IP"] == pytest.approx(10.0)
    assert ra["CFR"] == pytest.approx((190 / 3) / 92.5) and rb["CFR"] == pytest.approx(70 / 80)
    assert ra["WF5"] is None and rb["WF5"] is None
    assert rb["avg"] == pytest.approx([70.0, 75.0, 80.0])
    # WF5 is unknown for both: left out, weights rescaled by 1/0.8. a is best only on EBWT (0.2);
    # b on FM (0.2), WP5 (0.1), IP (0.1) and CFR (0.2).
    assert ra["composite"] == pytest.approx(0.2 / 0.8) and rb["composite"] == pytest.approx(0.6 / 0.8)
    assert ra["final_R@1"] is None  # a JSON source without test_recall_at_1
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_of_one_json_source_has_no_composite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _write(tmp_path / "a.json", {**RUN_A, "test_recall_at_1": [[40.0], [50.0, 45.0], [25.0, 35.0, 35.0]],
                                     "test_mrr": [[0.5], [0.6, 0.55], [0.3, 0.4, 0.5]]})
    out_json = tmp_path / "m.json"
    assert _report(str(a), "--json", str(out_json), "--markdown") == 0
    assert "| metric | 1:a |" in capsys.readouterr().out
    (run,) = json.loads(out_json.read_text())["runs"]
    assert run["composite"] is None
    assert run["final_R@1"] == pytest.approx(95 / 3) and run["final_MRR"] == pytest.approx(0.4)


@pytest.mark.parametrize(("data", "problem"), [
    ({**RUN_A, "test_recall_at_10": [[80.0], [95.0], [50.0, 70.0, 70.0]]}, "test_recall_at_10 row 1 has 1 value(s)"),
    ({**RUN_A, "test_recall_at_10": [[0.8], [0.9, 0.9]]}, "expected 3 rows"),
    ({**RUN_A, "val_recall_at_10": [60.0]}, "val_recall_at_10: expected a list of 3 values"),
    ({**RUN_A, "test_recall_at_10": [[80.0], [95.0, 190.0], [50.0, 70.0, 70.0]]}, "outside [0, 100]"),
    ({**RUN_A, "test_recall_at_10": [[80.0], [95.0, "x"], [50.0, 70.0, 70.0]]}, "'x' is not a number"),
    ({**RUN_A, "val_recal_at_10": []}, "unknown key(s) ['val_recal_at_10']"),
    ({"names": ["x"]}, "missing key 'test_recall_at_10'"),
    ([1, 2], "expected a JSON object"),
])
def test_a_bad_json_source_is_one_line_naming_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       data: object, problem: str) -> None:
    good, bad = _write(tmp_path / "good.json", RUN_A), _write(tmp_path / "bad.json", data)
    out = tmp_path / "never.json"
    assert _report(str(good), str(bad), "--json", str(out)) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {bad}: ") and problem in err, err
    assert not out.exists()


def test_a_source_that_is_neither(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "broken.json").write_text("{not json")
    assert _report(str(tmp_path / "broken.json")) == 1
    assert "not valid JSON at line 1" in capsys.readouterr().err
    assert _report(str(tmp_path / "missing")) == 1
    assert "no such run_dir or JSON file" in capsys.readouterr().err
    assert _report(str(tmp_path)) == 1
    assert "without manifest.json" in capsys.readouterr().err


def _run_dir(tmp_path: Path) -> Path:
    """A finished two-repository run, its manifest written by RunState as the flow writes it."""
    cfg = PipelineConfig(run_dir=tmp_path / "run", repos=[RepoConfig(path=tmp_path / "a"),
                                                          RepoConfig(path=tmp_path / "b")])
    state = RunState(cfg.run_dir, cfg)
    entries = [RepoEntry(r.display_name, r.path) for r in cfg.repos]
    state.extend(entries, entries)
    for j, name in enumerate(["a", "b"]):
        state.record(stage_name(j, name, EVAL_UNTRAINED), _eval([20.0, 30.0][j]))
    state.record(stage_name(0, "a", TRAIN), _train(1, 70.0))
    state.record(stage_name(0, "a", eval_stage(0, "a")), _eval(80.0))
    state.record(stage_name(1, "b", TRAIN), _train(2, 74.0))
    state.record(stage_name(1, "b", eval_stage(0, "a")), _eval(60.0))
    state.record(stage_name(1, "b", eval_stage(1, "b")), _eval(90.0))
    return cfg.run_dir


def test_report_of_a_run_dir_prints_its_full_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _run_dir(tmp_path)
    assert _report(str(run_dir)) == 0
    expected = report_from_manifest(json.loads((run_dir / "manifest.json").read_text())).text()
    assert capsys.readouterr().out.strip() == expected.strip()
    assert _report(str(run_dir), "--markdown") == 0
    assert "## Lifelong metrics after each repository" in capsys.readouterr().out


def test_report_compares_a_run_dir_with_a_json_source(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _run_dir(tmp_path)
    other = _write(tmp_path / "other.json", {"names": ["a", "b"], "test_recall_at_10": [[70.0], [70.0, 80.0]]})
    out_json, out_png = tmp_path / "m.json", tmp_path / "m.png"
    assert _report(str(run_dir), str(other), "--json", str(out_json), "--png", str(out_png)) == 0
    printed = capsys.readouterr().out
    assert "1:run" in printed and "2:other" in printed
    setup = next(line for line in printed.splitlines() if line.startswith("setup "))
    # LeanAgent's trainer (bf16-mixed) recorded; a JSON source has no setup.
    assert setup.split()[1:] == ["single,", "curriculum,", "no", "EWC,", "precision", "bf16-mixed", "-"]
    mine, theirs = json.loads(out_json.read_text())["runs"]
    assert mine["setup"] == "single, curriculum, no EWC, precision bf16-mixed" and theirs["setup"] is None
    assert mine["source"] == str(run_dir) and mine["names"] == ["a", "b"]
    assert mine["FM"] == pytest.approx(20.0) and mine["IP"] == pytest.approx(4.0) and theirs["IP"] is None
    assert mine["final_R@1"] == pytest.approx((30 + 45) / 2) and mine["final_MRR"] == pytest.approx(0.25)
    assert mine["val"] == [70.0, 74.0]
    # WF5 (2 repositories) and IP (no validation recalls in the JSON) are left out of both: total weight 0.7.
    # run: avg 80, 75: FM 20 (worst) 0, WP5 0 (worst) 0, EBWT 0 = 0 (equal) 0.2, CFR 75/80 (best) 0.2
    # other: avg 70, 75: FM 0 (best) 0.2, WP5 2.5 (best) 0.1, EBWT 0.2, CFR 70/75 (worst) 0
    assert theirs["WP5"] == pytest.approx(2.5) and theirs["CFR"] == pytest.approx(70 / 75)
    assert mine["composite"] == pytest.approx(0.4 / 0.7) and theirs["composite"] == pytest.approx(0.5 / 0.7)
    assert out_png.read_bytes()[:4] == b"\x89PNG"


def test_load_run_reads_a_partial_run_dir(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    del manifest["repos"]["01-b"]["stages"]["eval-01-b"]  # b's last evaluation has not finished
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    run = load_run(run_dir)
    assert run.names == ["a"] and run.test_r10 == [[80.0]] and run.metrics()["FM"] is None


def test_a_new_lifelong_metric_is_one_table_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registered once, a metric is computed after each repository, printed with its meaning in the text, the
    markdown and the comparison, written to the comparison's JSON and weighed in the composite score."""
    from leanagent.report import LifelongRun, comparison_json, comparison_text
    from leanagent.report import metrics as lm

    def final_gap(c: lm.Curves) -> float | None:
        return max(c.R[-1]) - min(c.R[-1])

    entry = lm.LifelongMetric("GAP", final_gap, True, "the spread of the last row's recalls", weight=0.1)
    monkeypatch.setitem(lm.REGISTRY, "GAP", entry)
    report = _three_repositories()
    assert [r["GAP"] for r in report.rows] == [0.0, 30.0, 20.0]
    assert "GAP 20.00" in report.text() and "GAP (lower is better): the spread of the last row's recalls" in \
        report.text()
    assert "| CFR | GAP |" in report.markdown("m.json") and "- GAP (lower is better)" in report.markdown("m.json")
    runs = [LifelongRun(str(k), f"run{k}", report.names, report._triangle(), report.val_r10, None, None, None,
                        report, None) for k in range(2)]
    assert "GAP (lower is better)" in comparison_text(runs)
    assert all(r["GAP"] == 20.0 for r in comparison_json(runs)["runs"])


def test_the_png_has_recalls_whole_axis_the_metrics_and_the_runs_setup() -> None:
    from leanagent.report import LifelongRun
    from leanagent.report.png import render

    report = _three_repositories()
    run = LifelongRun("runs/ewc", "ewc", report.names, report._triangle(), report.val_r10, None, None, None, report,
                      "single, curriculum, EWC 0.1")
    heat, curve = render([run]).axes[:2]
    assert curve.get_ylim() == (0.0, 100.0)
    assert "ewc (single, curriculum, EWC 0.1)" in heat.get_title()
    box = "\n".join(t.get_text() for t in curve.texts)
    assert "FM 25.00 (lower is better)" in box and "WF5 - (lower is better)" in box


def test_the_table_says_which_checkpoint_the_next_repository_starts_from_and_its_own_recall() -> None:
    report = RunReport(["a"])
    train = {"epoch": 9, "checkpoint": "epoch=8-step=90-Recall@10_val=86.00.ckpt",
             "metrics": {"Recall@10_val": 87.0, "checkpoint_Recall@10_val": 86.0}}
    report.add_repository(0, train, [_eval(80.0)])
    text = report.text()
    assert "next starts from" in text and "87.00" in text
    assert "epoch=8-step=90-Recall@10_val=86.00.ckpt (86.00)" in text
    assert "(86.00) |" in report.markdown("m.json")


TABLE4 = Path(__file__).resolve().parents[1] / "fixtures" / "leanagent_table4"


def _table4_runs() -> list:
    """The paper's Table 4: LeanAgent and its 7 setups, 14 repositories each (names up to 26 characters)."""
    return [load_run(TABLE4 / "leanagent.json"), *(load_run(p) for p in sorted(TABLE4.glob("setup*.json")))]


def test_a_name_too_long_for_its_column_ends_with_an_ellipsis() -> None:
    from leanagent.report.cells import fit

    names = ["Mathematics in Lean Source", "PrimeNumberTheoremAnd", "FLT", "Matrix Cookbook", "a b c d e f g h i j"]
    for name in names:
        for width in range(1, 30):
            shown = fit(name, width)
            assert len(shown) <= width, (name, width, shown)
            assert shown == name or (shown.endswith("…") and name.startswith(shown[:-1])), (name, width, shown)
            assert (shown == name) == (len(name) <= width)
    assert fit("Mathematics in Lean Source", 24) == "Mathematics in Lean…"  # a wide column cuts at a word's end
    assert fit("Mathematics in Lean Source", 8) == "Mathema…"


def test_table4s_picture_has_one_colour_scale_and_no_name_cut_bare() -> None:
    """Issue: each panel had its own scale (60-82 beside 52.5-72.5) and names read "Mathematics in"."""
    from leanagent.report.png import LABEL_CHARS, render

    runs = _table4_runs()
    fig = render(runs)
    heats = [ax for ax in fig.axes if ax.images]
    assert len(heats) == len(runs) == 8
    values = [v for run in runs for row in run.test_r10 for v in row]
    assert {ax.images[0].get_clim() for ax in heats} == {(min(values), max(values))}
    names = {name for run in runs for name in run.names}
    assert max(map(len, names)) > LABEL_CHARS  # the fixture has names to cut
    for ax in heats:
        labels = [t.get_text() for t in (*ax.get_xticklabels(), *ax.get_yticklabels())]
        assert len(labels) == 2 * 14
        for label in labels:
            assert label in names or (label.endswith("…") and any(n.startswith(label[:-1]) for n in names)), label
            assert len(label) <= LABEL_CHARS
    first = [t.get_text() for t in heats[0].get_yticklabels()]
    assert "Mathematics in Lean…" in first and "PrimeNumberTheoremAnd" in first


def _metric_rows(text: str, markdown: bool) -> list[tuple[str, list[str]]]:
    """(row name, cells) of the comparison's metric table, in the text or the markdown form."""
    lines = text[text.index("Lifelong metrics"):].splitlines()
    if markdown:
        rows = [line.strip("|").split("|") for line in lines if line.startswith("| ")][1:]
        return [(row[0].strip(), [c.strip() for c in row[1:]]) for row in rows]
    rows = lines[2:next(i for i, line in enumerate(lines) if line.startswith("1:"))]
    return [(line[:26].strip(), line[27:].split()) for line in rows]


def test_table4s_comparison_has_no_row_that_no_run_has() -> None:
    """JSON sources carry no setup, R@1 or MRR: those rows would be all `-`; they are named once instead."""
    from leanagent.report import comparison_text

    runs = _table4_runs()
    for markdown in (False, True):
        text = comparison_text(runs, markdown=markdown)
        rows = _metric_rows(text, markdown)
        assert [name for name, _ in rows][:2] == ["repositories", "final R@10"] and rows[-1][0] == "composite"
        assert all(len(cells) == len(runs) and set(cells) != {"-"} for _, cells in rows), rows
        assert "not shown, no run has it: setup, final R@1, final MRR" in text
    # The matrices' names: whole, or cut with an ellipsis (a column of 8, a row label of 24 characters).
    text = comparison_text(runs)
    assert "Mathematics in Lean…" in text and "Mathema…" in text
    assert "Mathematics in Lean Sour " not in text and "Mathemat " not in text
