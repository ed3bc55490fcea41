"""An index is checked as it is loaded, by `serve` and `retrieve` alike: its embeddings are the bytes index.json
names, finite, of unit length and what its model gives; every file it cannot read is one line naming it."""

from __future__ import annotations

import hashlib
import json
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


def test_unreadable_lines_are_named_with_the_file_and_line(index, indexes, tmp_path) -> None:
    premises = (index / PREMISES_FILE).read_bytes().splitlines(keepends=True)
    premises[4] = premises[4].replace(b'"full_name": "', b'"full_name": "\xff')
    (index / PREMISES_FILE).write_bytes(b"".join(premises))
    _refused(index, "premises.jsonl:5: not UTF-8 (byte")
    files = shutil.copytree(indexes["index"], tmp_path / "files")
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
