"""The SHA-256 of a file, read in 1 MiB chunks so that a multi-GB corpus or weight file is never held in memory.

Used wherever a record must later tell whether a file on disk is still the one it saw: the merged datasets'
sources (`data/merge.py`) and the served model's weights (`model_identity.py`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

_CHUNK = 1 << 20


def sha256_file(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
