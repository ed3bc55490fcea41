"""leanagent: lifelong training of a ByT5 premise retriever for Lean.

`leanagent.retrieve(INDEX, state, ...)` and `leanagent.PremiseIndex` are what a prover calls; they are
resolved on first use, so `import leanagent` stays light (no torch, no transformers).
"""

from __future__ import annotations

from typing import Any

_LAZY = {"retrieve": "leanagent.index.cache", "PremiseIndex": "leanagent.index.query", "Hit": "leanagent.index.query"}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'leanagent' has no attribute {name!r}")
