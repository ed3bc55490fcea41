"""An INDEX folder's files: their names and format, and the one writer (`write_index`).

The folder (module docstring of `leanagent.index`): `embeddings.safetensors` (one bf16 row per premise, in corpus
order), `premises.jsonl`, `files.jsonl`, `names.json`, and `index.json` written last, so that a folder without it
reads as unfinished. Readers are `leanagent.index.read`; this module imports no model.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch

from leanagent.data.corpus import Corpus
from leanagent.data.lean_names import lean_name, module_name
from leanagent.ground.atomic import out_folder_problem, refuse_non_empty, write_atomic, write_bytes_atomic
from leanagent.ground.config import DataConfig
from leanagent.ground.json_files import MIB, JsonFileError, read_json_file
from leanagent.ground.names import INDEX_FILE, NAMES_FILE

EMBEDDINGS_FILE = "embeddings.safetensors"
PREMISES_FILE = "premises.jsonl"
FILES_FILE = "files.jsonl"
MAX_NAMES_BYTES = 256 * MIB  # the served lists: every premise's and module's name (about 5 MB for 76k premises)
INDEX_FILES = (INDEX_FILE, EMBEDDINGS_FILE, PREMISES_FILE, FILES_FILE, NAMES_FILE)
# 2: index.json records the embeddings' SHA-256, and names.json the served lists; format 1 indexes still load.
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
NORM_TOLERANCE = 0.05  # a stored row is a unit vector rounded to bf16
# data.max_seq_len's default: states are cut there in training and evaluation
CONTEXT_MAX_LEN: int = DataConfig.model_fields["max_seq_len"].default

FILE_WITHOUT_LINE = "--file and --line go together: accessibility is a position in a file"


class IndexNotWritten(OSError):
    """An index's files could not all be written (ENOSPC, EDQUOT, EROFS...); those written were removed. The message
    is one line naming the folder."""

    def __str__(self) -> str:
        return str(self.strerror)


class PremiseIndexError(ValueError):
    """An index, a query or its arguments that cannot be used; the message is one line naming what is wrong."""


def served_names(corpus: Corpus, before: dict[str, list[str]] | None = None) -> dict[str, list[str]]:
    """The premise names and module names a server lists for `corpus`, each once: `before`'s lists as they are
    (names no longer indexed stay, with no premise), then this corpus's new names in corpus order."""
    lists = {"premises": [lean_name(p.full_name) for p in corpus.premises],
             "modules": [module_name(path) for path in corpus.paths]}
    out = {}
    for key, names in lists.items():
        kept = list((before or {}).get(key) or [])
        out[key] = list(dict.fromkeys([*kept, *names]))
    return out


def write_index(out: Path, corpus: Corpus, embeddings: torch.Tensor, meta: dict[str, Any],
                names_before: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """Write an INDEX folder of `corpus` and its `embeddings` (one row per premise, in corpus order): the files,
    then index.json (`meta` and what this adds: the format, the counts, the embeddings' SHA-256) last, so that a
    folder without index.json reads as unfinished. An earlier index's files there are replaced; anything else kept.
    `names_before`: the lists of the index this one follows (`served_names`). Returns index.json's content."""
    from safetensors.torch import save

    out = Path(out)
    rows = embeddings.to(torch.bfloat16).cpu().contiguous()
    if rows.shape[0] != len(corpus):
        raise ValueError(f"{len(rows)} embeddings for {len(corpus)} premises")
    blob = save({"embeddings": rows}, metadata={"format": str(FORMAT_VERSION)})
    names = served_names(corpus, names_before)
    try:
        _clear_out(out)
        write_bytes_atomic(out / EMBEDDINGS_FILE, blob)
        write_atomic(out / PREMISES_FILE, lambda f: _write_premises(f, corpus))
        write_atomic(out / FILES_FILE, lambda f: _write_files(f, corpus))
        write_atomic(out / NAMES_FILE, lambda f: json.dump(names, f, ensure_ascii=False))
        # Each file's size: a reader checks them all before it reads any (a file swapped for a pipe or a device).
        sizes = {name: (out / name).stat().st_size for name in (EMBEDDINGS_FILE, PREMISES_FILE, FILES_FILE,
                                                                  NAMES_FILE)}
        meta = {**meta, "format": FORMAT_VERSION, "embeddings_sha256": hashlib.sha256(blob).hexdigest(),
                "file_sizes": sizes, "num_premises": int(rows.shape[0]), "num_files": len(corpus.paths),
                "embedding_dim": int(rows.shape[1]), "dtype": "bfloat16",
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        write_atomic(out / INDEX_FILE, lambda f: json.dump(meta, f, indent=2, sort_keys=True))
    except OSError as exc:  # a full disk, a quota, a folder gone read-only: none of the index's files stays
        for name in INDEX_FILES:
            with contextlib.suppress(OSError):
                (out / name).unlink(missing_ok=True)
        raise IndexNotWritten(exc.errno, f"{out}: the index cannot be written ({exc.strerror or exc}); none of "
                                         f"its files was left there") from None
    return meta


def read_names(folder: Path) -> dict[str, list[str]] | None:
    """An index's served lists (None for an index without names.json, or no index)."""
    try:
        names = read_json_file(Path(folder) / NAMES_FILE, MAX_NAMES_BYTES)
    except JsonFileError:
        return None
    ok = isinstance(names, dict) and all(isinstance(names.get(k), list) and all(isinstance(n, str) for n in names[k])
                                         for k in ("premises", "modules"))
    return names if ok else None


def check_out(out: Path, force: bool) -> None:
    """A folder that cannot be written is refused, and a non-empty one unless `force`, before any time is spent
    embedding."""
    problem = out_folder_problem(out)
    if problem is not None:
        raise PremiseIndexError(f"--out {problem}")
    if not force:
        try:
            refuse_non_empty(out)
        except FileExistsError as exc:
            raise PremiseIndexError(f"--out {exc} (pass --force to replace an index there)") from None


def _clear_out(out: Path) -> None:
    """With --force only an earlier index's own files go (index.json first: the folder reads as unfinished
    until the new one is written); anything else a user keeps there stays."""
    out.mkdir(parents=True, exist_ok=True)
    for name in INDEX_FILES:
        (out / name).unlink(missing_ok=True)


def _write_premises(f, corpus: Corpus) -> None:
    for p in corpus.premises:
        f.write(json.dumps({"path": p.path, "full_name": p.full_name, "start": list(p.start), "end": list(p.end),
                            "kind": p.kind, "text": p.text}, ensure_ascii=False) + "\n")


def _write_files(f, corpus: Corpus) -> None:
    for path in corpus.paths:
        rows = corpus.file_range(path)
        last = max((corpus.premises[i].end[0] for i in rows), default=None)
        f.write(json.dumps({"path": path, "imports": corpus.imports[path], "premises": [rows.start, rows.stop],
                            "last_line": last}, ensure_ascii=False) + "\n")
