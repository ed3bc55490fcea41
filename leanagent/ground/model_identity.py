"""Which weights an index was embedded with, so that a retrained model cannot silently serve stale embeddings.

Training rewrites `last.ckpt` in place; an index built from it before would go on answering with the old
model's corpus embeddings against the new model's state embeddings, a mismatch nothing else reveals. So
`leanagent index` records the model's identity: the path it was loaded from and, per file that holds
weights or architecture, its size, modification time and SHA-256.

`mismatch` compares sizes and modification times first (a stat per file). Only when they differ are the
files hashed again: a model that was copied, moved or touched but holds the same bytes is accepted, and
one with new bytes is refused. (A file rewritten with the same size within one timestamp tick of its
filesystem would pass the stat; training writes checkpoints minutes apart.) Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

from leanagent.ground.file_digest import sha256_file

# The files of a model folder that decide its embeddings: weights in any of the layouts we load (an HF
# folder, a DeepSpeed folder consolidated by zero_to_fp32.py) and the architecture. Tokenizer files, model
# cards and logs are left out, so that rewriting them (an export with --force) does not count as a change.
WEIGHT_SUFFIXES = (".ckpt", ".safetensors", ".bin", ".pt", ".pth")
ARCHITECTURE_FILES = ("config.json",)


def model_files(path: Path) -> list[tuple[str, Path]]:
    """(name, file) of what identifies the model at `path`: the file itself, or a folder's weight and config
    files (names relative to the folder, sorted)."""
    path = Path(path)
    if path.is_file():
        return [(path.name, path)]
    if not path.is_dir():
        return []
    found = [p for p in path.rglob("*") if p.is_file()
             and (p.suffix in WEIGHT_SUFFIXES or p.name in ARCHITECTURE_FILES)]
    return sorted((str(p.relative_to(path)), p) for p in found)


def _stamps(path: Path, hashed: bool) -> list[dict[str, Any]]:
    out = []
    for name, file in model_files(path):
        st = file.stat()
        stamp: dict[str, Any] = {"name": name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        if hashed:
            stamp["sha256"] = sha256_file(file)
        out.append(stamp)
    return out


def identify(path: str | Path) -> dict[str, Any]:
    """The identity `leanagent index` records: {"path", "files": [{"name", "size", "mtime_ns", "sha256"}]}."""
    path = Path(path).resolve()
    return {"path": str(path), "files": _stamps(path, hashed=True)}


def digest(identity: dict[str, Any] | None) -> str | None:
    """One SHA-256 for the model's files (the file's own for one file), or None when the identity has none: what a
    server may show of its model, which names no path."""
    files = (identity or {}).get("files") or []
    if not files or not all("sha256" in f for f in files):
        return None
    if len(files) == 1:
        return str(files[0]["sha256"])
    return hashlib.sha256("".join(f"{f['name']}:{f['sha256']}" for f in files).encode()).hexdigest()


def describe(identity: dict[str, Any]) -> str:
    """`PATH (N bytes, modified T, sha256 XXXXXXXXXXXX)`, summed over a folder's files; a missing model says so."""
    files = identity.get("files") or []
    if not files:
        return f"{identity.get('path')} (missing)"
    size = sum(int(f["size"]) for f in files)
    newest = max(int(f["mtime_ns"]) for f in files) / 1e9
    modified = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(newest))
    parts = [f"{size:,} bytes", f"modified {modified}"]
    combined = digest(identity)
    if combined is not None:
        parts.append(f"sha256 {combined[:12]}")
    count = f"{len(files)} files, " if len(files) > 1 else ""
    return f"{identity.get('path')} ({count}{', '.join(parts)})"


def _same_stat(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    return [(f["name"], f["size"], f["mtime_ns"]) for f in a] == [(f["name"], f["size"], f["mtime_ns"]) for f in b]


def _same_bytes(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    return [(f["name"], f.get("sha256")) for f in a] == [(f["name"], f.get("sha256")) for f in b]


def mismatch(recorded: dict[str, Any], path: str | Path) -> str | None:
    """None when `path` holds the weights `recorded` describes; otherwise `describe` of what is there now."""
    path = Path(path).resolve()
    expected = recorded.get("files") or []
    now = _stamps(path, hashed=False)
    if now and str(path) == recorded.get("path") and _same_stat(now, expected):
        return None
    current = {"path": str(path), "files": _stamps(path, hashed=True)}
    if current["files"] and _same_bytes(current["files"], expected):
        return None  # copied, moved or touched: the same bytes
    return describe(current)
