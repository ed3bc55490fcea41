"""The CPU a bench figure was measured on: its model name and flags, read once (Linux's /proc/cpuinfo), for every
section that records them beside its CPU figures (the project's machines differ in bf16 matmuls: some have AMX,
some AVX2 only)."""

from __future__ import annotations

import functools
import platform
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# The flags (Linux's names, as lscpu prints them) that decide how fast bf16 matmuls run.
BF16_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


@dataclass(frozen=True)
class Cpu:
    name: str
    flags: frozenset[str]

    def having(self, names: Iterable[str]) -> list[str]:
        """Those of `names` this CPU has, in their order."""
        return [f for f in names if f in self.flags]

    def describe(self, names: Iterable[str]) -> str:
        """Those of `names` this CPU has, space-separated, or "none of" them."""
        names = tuple(names)
        return " ".join(self.having(names)) or "none of " + " ".join(names)


@functools.cache
def this_cpu() -> Cpu:
    """This machine's CPU: the first processor's model name and flags (x86's `flags`, Arm's `Features`); elsewhere
    than Linux the platform's name and no flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return Cpu(platform.processor() or platform.machine(), frozenset())
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    flags = fields.get("flags") or fields.get("Features") or ""
    return Cpu(fields.get("model name") or platform.processor() or platform.machine(), frozenset(flags.split()))
