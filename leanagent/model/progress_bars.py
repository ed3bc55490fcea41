"""Transformers' own progress bars, switched off where they are noise.

Its "Loading weights" and "Writing model shards" bars show on every load and save of a model that
takes well under a second: on every retrieve, export and `init-model`, and in every rank of every job.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from transformers.utils import logging as hf_logging


@contextmanager
def no_progress_bars() -> Iterator[None]:
    """Transformers' bars off inside the block, restored after it as they were."""
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()
