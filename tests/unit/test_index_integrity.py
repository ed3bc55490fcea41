"""An index is checked as it is loaded, by `serve` and `retrieve` alike: its embeddings are the bytes index.json
names, finite, of unit length and what its model gives; every file it cannot read is one line naming it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from leanagent.index.build import build_index
from leanagent.index.files import EMBEDDINGS_FILE, FILES_FILE, INDEX_FILE, PREMISES_FILE, PremiseIndexError
from leanagent.index.query import PremiseIndex
from leanagent.model.presets import write_random_encoder

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def indexes(tiny_model: Path, unit_repo: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("integrity")
    other = write_random_encoder(root / "other_model", "tiny", seed=5)
    build_index(tiny_model, unit_repo, root / "index")
    build_index(other, unit_repo, root / "other")
    return {"index": root / "index", "other": root / "other"}


@pytest.fixture
def index(indexes, tmp_path) -> Path:
    return shutil.copytree(indexes["index"], tmp_path / "index")


def _refused(folder: Path, match: str) -> str:
    with pytest.raises(PremiseIndexError) as refused:
        PremiseIndex.load(folder)
    message = str(refused.value)
    assert match in message and "\n" not in message, message
    return message


def _rewrite(folder: Path, edit) -> None:
    """Change the embeddings as `edit` says, and index.json's digest with them (a file that passes the digest)."""
    emb = load_file(str(folder / EMBEDDINGS_FILE))["embeddings"]
    save_file({"embeddings": edit(emb.clone())}, str(folder / EMBEDDINGS_FILE), metadata={"format": "2"})
    meta = json.loads((folder / INDEX_FILE).read_text())
    meta["embeddings_sha256"] = hashlib.sha256((folder / EMBEDDINGS_FILE).read_bytes()).hexdigest()
    (folder / INDEX_FILE).write_text(json.dumps(meta))


def test_a_flipped_byte_is_refused(index) -> None:
    data = bytearray((index / EMBEDDINGS_FILE).read_bytes())
    data[-7] ^= 0x40  # an exponent bit of the last rows: a NaN, or a cosine of 1.41, served silently before
    (index / EMBEDDINGS_FILE).write_bytes(bytes(data))
    _refused(index, "embeddings.safetensors: its bytes are not those index.json records")


def test_another_models_embeddings_are_refused(index, indexes) -> None:
    shutil.copyfile(indexes["other"] / EMBEDDINGS_FILE, index / EMBEDDINGS_FILE)
    _refused(index, "its bytes are not those index.json records")
    # Even with index.json made to agree, the model does not give these embeddings.
    _rewrite(index, lambda emb: load_file(str(indexes["other"] / EMBEDDINGS_FILE))["embeddings"])
    _refused(index, "these embeddings come from another model")


@pytest.mark.parametrize("edit, match", [
    (lambda emb: emb.index_fill_(0, torch.tensor([3]), float("nan")), "row 3 (and 0 more) is not finite"),
    (lambda emb: emb.index_put_((torch.tensor([5]),), emb[5] * 1.41), "row 5 has length 1.41"),
])
def test_rows_not_finite_or_not_unit_are_refused(index, edit, match) -> None:
    _rewrite(index, edit)
    _refused(index, match)


def _without_sizes(folder: Path) -> Path:
    """index.json as written before it recorded its files' sizes (the line checks are then the first to see)."""
    meta = json.loads((folder / INDEX_FILE).read_text())
    meta.pop("file_sizes")
    (folder / INDEX_FILE).write_text(json.dumps(meta))
    return folder


def test_unreadable_lines_are_named_with_the_file_and_line(index, indexes, tmp_path) -> None:
    _without_sizes(index)
    premises = (index / PREMISES_FILE).read_bytes().splitlines(keepends=True)
    premises[4] = premises[4].replace(b'"full_name": "', b'"full_name": "\xff')
    (index / PREMISES_FILE).write_bytes(b"".join(premises))
    _refused(index, "premises.jsonl:5: not UTF-8 (byte")
    files = _without_sizes(shutil.copytree(indexes["index"], tmp_path / "files"))
    lines = (files / FILES_FILE).read_text().splitlines()
    record = json.loads(lines[1])
    del record["imports"]
    lines[1] = json.dumps(record)
    (files / FILES_FILE).write_text("\n".join(lines) + "\n")
    _refused(files, "files.jsonl:2: imports: Field required")
    # The command: one line, exit 1 (serve refuses alike, through the same load).
    proc = subprocess.run([sys.executable, "-m", "leanagent.cli", "retrieve", str(files), "--state", "x"],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert proc.returncode == 1 and proc.stderr.startswith("error: ") and len(proc.stderr.splitlines()) == 1
    assert "files.jsonl:2: imports: Field required" in proc.stderr


def test_an_index_from_before_digests_loads_with_a_warning(index) -> None:
    meta = json.loads((index / INDEX_FILE).read_text())
    meta.pop("embeddings_sha256")
    meta["format"] = 1
    (index / INDEX_FILE).write_text(json.dumps(meta))
    loaded = PremiseIndex.load(index)
    assert any("records no digest of its embeddings" in w for w in loaded.warnings)


def test_a_file_of_another_size_a_pipe_or_a_device_is_refused_before_it_is_read(index, indexes, tmp_path) -> None:
    """Each file is a regular one of the size index.json records, checked before any is read: a pipe blocked the
    loader for ever, /dev/zero filled its memory (2 GB, then a bare MemoryError)."""
    with open(index / PREMISES_FILE, "ab") as f:
        f.write(b"\n")
    _refused(index, f"{PREMISES_FILE}: ")
    assert "bytes, but index.json records" in _refused(index, PREMISES_FILE)
    (index / PREMISES_FILE).unlink()
    os.mkfifo(index / PREMISES_FILE)
    _refused(index, f"{PREMISES_FILE}: not a regular file")
    (index / EMBEDDINGS_FILE).unlink()
    (index / EMBEDDINGS_FILE).symlink_to("/dev/zero")
    _refused(index, f"{EMBEDDINGS_FILE}: not a regular file")
    old = _without_sizes(shutil.copytree(indexes["index"], tmp_path / "old"))
    (old / EMBEDDINGS_FILE).unlink()
    (old / EMBEDDINGS_FILE).symlink_to("/dev/zero")
    _refused(old, f"{EMBEDDINGS_FILE}: not a regular file")  # without recorded sizes, the same refusal


@pytest.mark.parametrize("key, value, match", [
    ("checkpoint", 5, "checkpoint: must be a valid string"),
    ("context_max_len", "abc", "context_max_len: must be a valid integer"),
    ("model_identity", {"files": "x"}, "model_identity.files: must be a valid list"),
    ("max_seq_len", 0, "max_seq_len: must be greater than or equal to 1"),
    ("max_seq_len", 10**12, "max_seq_len: must be less than or equal to 65536"),
    ("num_premises", -1, "num_premises: must be greater than or equal to 0"),
    ("embeddings_sha256", "xyz", "embeddings_sha256: String should match pattern"),
    ("file_sizes", {"premises.jsonl": -3}, "file_sizes.premises.jsonl: must be greater than or equal to 0"),
    ("format", "2", "not a format-2 leanagent index"),
])
def test_every_key_of_index_json_is_checked_in_one_line(index, key, value, match) -> None:
    meta = json.loads((index / INDEX_FILE).read_text())
    meta[key] = value
    (index / INDEX_FILE).write_text(json.dumps(meta))
    message = _refused(index, match)
    assert message.startswith(str(index / INDEX_FILE)), message
