"""`leanagent.retrieve`, the prover's entry point: an index loaded on first use and kept for the process."""

from __future__ import annotations

import threading
from pathlib import Path

from leanagent.index.query import Hit, PremiseIndex

_LOADED: dict[tuple[str, str], PremiseIndex] = {}
_LOCK = threading.Lock()


def retrieve(index: str | Path | PremiseIndex, state: str, k: int = 10, file: str | None = None,
             line: int | None = None, column: int = 0, device: str = "cpu") -> list[Hit]:
    """`leanagent.retrieve`: the k best premises for a proof state. A path is loaded on first use and kept,
    so calling this in a loop costs one encoder pass per call, not a model load."""
    if not isinstance(index, PremiseIndex):
        key = (str(Path(index).resolve()), device)
        with _LOCK:
            if key not in _LOADED:
                _LOADED[key] = PremiseIndex.load(index, device=device)
            index = _LOADED[key]
    return index.retrieve(state, k=k, file=file, line=line, column=column)
