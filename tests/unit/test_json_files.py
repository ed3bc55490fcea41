"""Every JSON file read back goes through one capped reader: a file past its cap is refused from its size alone, in one
line naming it, before a byte is read; a pipe does not block it; anything else wrong is one line too."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import pytest
from pydantic import BaseModel, StrictInt

from leanagent.ground.json_files import JsonFileError, read_capped, read_json_file, read_model
from leanagent.ground.results import ResultUnreadableError, read_result
from leanagent.index.read import PremiseIndexError, read_meta
from leanagent.run.manifest import MAX_MANIFEST_BYTES, ManifestUnreadableError, read_manifest


class Small(BaseModel):
    n: StrictInt


def _sparse(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("reader, name, error", [
    (read_manifest, "manifest.json", ManifestUnreadableError),
    (read_result, "result.json", ResultUnreadableError),
    (lambda p: read_meta(p.parent), "index.json", PremiseIndexError),
])
def test_a_two_gigabyte_file_is_refused_from_its_size_in_one_line(tmp_path, reader, name, error):
    path = _sparse(tmp_path / name, 2 << 30)
    before, start = _peak_rss_mb(), time.monotonic()
    with pytest.raises(error) as caught:
        reader(path)
    assert time.monotonic() - start < 1.0
    assert _peak_rss_mb() - before < 100  # nothing of it was read
    message = str(caught.value)
    assert message.startswith(f"{path}: 2.1 GB, more than") and "\n" not in message, message


def test_a_file_at_its_cap_is_read_and_one_past_it_is_not(tmp_path):
    path = tmp_path / "f.json"
    path.write_bytes(b'{"n": 1}' + b" " * 8)
    assert read_model(path, Small, limit=16).n == 1
    with pytest.raises(JsonFileError, match="more than a file ever holds"):
        read_model(path, Small, limit=15)


def test_a_pipe_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "manifest.json"
    os.mkfifo(fifo)
    with pytest.raises(ManifestUnreadableError, match="not a regular file"):
        read_manifest(fifo)


@pytest.mark.parametrize("content, says", [
    (b'{"n": 1', "cut short"),
    (b"\xff{}", "not UTF-8 text (byte 0)"),
    (b"[1]", "a JSON list, not a small (an object)"),
    (b'{"n": "1"}', "n: must be a valid integer"),
    (b'{"n": ' + b"9" * 5000 + b"}", "Exceeds the limit"),
    (b"[" * 100_000 + b"]" * 100_000, "nests deeper"),
])
def test_what_is_wrong_inside_is_one_line_naming_the_file(tmp_path, content, says):
    path = tmp_path / "f.json"
    path.write_bytes(content)
    with pytest.raises(JsonFileError) as caught:
        read_model(path, Small, limit=1 << 20, what="small")
    assert str(caught.value).startswith(f"{path}: ") and says in str(caught.value), str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_missing_file_and_a_folder_are_one_line(tmp_path):
    with pytest.raises(JsonFileError, match="cannot be read"):
        read_json_file(tmp_path / "absent.json", 10)
    with pytest.raises(JsonFileError, match="not a regular file"):
        read_capped(tmp_path, 10)


def test_the_manifest_cap_leaves_room_for_a_long_run():
    # a stage's record is a few kB; a run of 100 repositories records about 5,000 stages
    assert MAX_MANIFEST_BYTES >= 5_000 * 4_000
