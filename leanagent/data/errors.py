"""The one exception type the data layer raises for bad input."""

from __future__ import annotations


class DatasetError(ValueError):
    """A dataset that cannot be used.

    The message always names the file and line (``corpus.jsonl:17``) or the theorem, because the
    person who reads it has to find the bad record in a multi-gigabyte file without a debugger.
    """
