"""Every folder (or file) a command writes is checked before any work: a file where it goes, a file where one of its
parents goes, or a folder that takes no new file is one line naming it, exit 1, nothing written, no traceback.

Real files and folders; the unwritable one is really unwritable for whoever runs the tests (`unwritable_folder`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from leanagent.cli import main as cli_main
from leanagent.ground.atomic import out_file_problem, out_folder_problem, refuse_non_empty


def test_a_folder_that_can_be_written_or_made_has_no_problem(tmp_path):
    assert out_folder_problem(tmp_path) is None
    assert out_folder_problem(tmp_path / "new" / "deeper") is None
    (tmp_path / "kept").write_text("a user's file")
    assert out_folder_problem(tmp_path) is None  # a run_dir or a job folder may hold files
    assert out_folder_problem(tmp_path, new_or_empty=True) == f"{tmp_path} exists and is not empty; nothing was " \
                                                               f"overwritten"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]  # the probe file was removed
    assert not (tmp_path / "new").exists()  # and nothing made


def test_a_file_where_the_folder_or_a_parent_goes_is_named(tmp_path):
    file = tmp_path / "notes.txt"
    file.write_text("a user's file")
    assert out_folder_problem(file) == f"{file} exists and is not a folder; nothing was overwritten"
    assert out_folder_problem(file / "run" / "x") == f"{file / 'run' / 'x'}: its parent {file} is not a folder"
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    assert out_folder_problem(tmp_path / "dangling") == (f"{tmp_path / 'dangling'} exists and is a link to nothing; "
                                                         f"nothing was overwritten")
    assert file.read_text() == "a user's file"


def test_a_folder_that_takes_no_file_is_named_with_the_systems_reason(unwritable_folder):
    problem = out_folder_problem(unwritable_folder / "run")
    assert problem is not None and problem.startswith(f"{unwritable_folder / 'run'}: cannot write in "
                                                      f"{unwritable_folder} (")
    assert problem.endswith("); choose a folder you can write to")
    with pytest.raises(FileExistsError, match="cannot write in"):
        refuse_non_empty(unwritable_folder)


def test_an_output_file_is_checked_through_its_folder(tmp_path):
    assert out_file_problem(tmp_path / "new" / "figures.json") is None
    assert out_file_problem(tmp_path) == f"{tmp_path} is a folder; give a file name"
    file = tmp_path / "notes.txt"
    file.write_text("x")
    assert out_file_problem(file / "figures.json") == f"{file / 'figures.json'}: {file} exists and is not a " \
                                                      f"folder; nothing was overwritten"


# Each command that writes a folder or a file, with OUT where the user gave it.
COMMANDS = {
    "run": ["run", "--config", "{run_config}"],
    "train": ["train", "--config", "{config}", "--dataset", "{repo}", "--out", "{out}"],
    "evaluate --index": ["evaluate", "--config", "{config}", "--dataset", "{repo}", "--checkpoint", "{model}",
                         "--out", "{tmp}/job", "--index", "{out}"],
    "examples": ["examples", "{repo}", "--out", "{out}"],
    "demo-data": ["demo-data", "{out}", "--repos", "1"],
    "init-model": ["init-model", "{out}"],
    "export": ["export", "{model}", "{out}"],
    "index": ["index", "--model", "{model}", "--dataset", "{repo}", "--out", "{out}"],
    "curriculum --json": ["curriculum", "{repo}", "--json", "{out}/order.json"],
    "report --json": ["report", "{tmp}/any-run", "--json", "{out}/report.json"],
    "report --png": ["report", "{tmp}/any-run", "--png", "{out}/report.png"],
    "bench --json": ["bench", "projection", "--json", "{out}/figures.json"],
    "bench --work": ["bench", "curriculum", "--work", "{out}"],
    "bench serve WORK": ["bench", "serve", "{out}"],
}
WHERE = {
    "a file": ("{tmp}/notes.txt", "exists and is not a folder"),
    "under a file": ("{tmp}/notes.txt/sub", "its parent {tmp}/notes.txt is not a folder"),
    "unwritable": ("{unwritable}/sub", "cannot write in {unwritable} ("),
}


@pytest.mark.parametrize("where", list(WHERE))
@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_refuses_an_out_it_cannot_write_in_one_line(command, where, tiny_model, unit_repo, tmp_path,
                                                                   request, capsys):
    unwritable = request.getfixturevalue("unwritable_folder") if where == "unwritable" else tmp_path / "unused"
    notes = tmp_path / "notes.txt"
    notes.write_text("a user's file")
    raw, expected = WHERE[where]
    fill = {"tmp": tmp_path, "unwritable": unwritable, "model": tiny_model, "repo": unit_repo}
    out = raw.format(**fill)
    if command.endswith("--json") or command.endswith("--png"):
        expected = expected if where != "a file" else "is not a folder"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"model": {"name_or_path": str(tiny_model)},
                                      "trainer": {"accelerator": "cpu", "devices": 1}}))
    run_config = tmp_path / "run.yaml"
    run_config.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()), "run_dir": out,
                                          "repos": [{"path": str(unit_repo)}]}))
    before = sorted(os.listdir(tmp_path))
    argv = [a.format(**fill, out=out, config=config, run_config=run_config) for a in COMMANDS[command]]
    with pytest.raises(SystemExit) as info:
        cli_main(argv)
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert info.value.code == 1, captured
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in captured.out + err, err
    assert expected.format(**fill) in err, err
    assert sorted(os.listdir(tmp_path)) == before and notes.read_text() == "a user's file"  # nothing written
    if where == "unwritable":
        assert not any(Path(unwritable).iterdir())
