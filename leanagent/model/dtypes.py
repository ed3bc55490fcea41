"""The precision a served or indexing encoder runs at: `--dtype auto|fp32|bf16|int8`, owned here.

Why: on a CPU the state's encoder pass is what a `suggest_premises` call waits for, and at byt5-small's shape it
takes seconds in fp32 (see docs/performance.md). bf16 autocast uses the CPU's bf16 matmuls (AVX-512 BF16, AMX;
Apple's M-series on `mps`); int8 dynamic quantization of the `Linear` layers uses its int8 ones.

- `fp32`: what evaluation computes on a CPU; the reference.
- `bf16`: `torch.autocast` in bfloat16 (the weights stay fp32; matmuls run in bf16, pooling and the norm in fp32).
- `int8`: `torch.ao.quantization.quantize_dynamic` on the encoder's `Linear` layers (CPU only). Not torchao:
  torchao 0.18 installs from pip for torch 2.13 and runs on a CPU, but its int8 dynamic path ran a byt5-small
  feed-forward pair (1,024 tokens) in 161 ms against `quantize_dynamic`'s 55 ms and bf16's 146 ms on this
  machine kind, and it logs a failed CUDA-kernel load at import; so the deprecated API, its warning silenced.
- `auto`: bf16 on `cuda` (as evaluation runs under bf16-mixed; what `index` and `serve` did there before) and on
  `mps`; on a CPU the entry of `AUTO_CPU`: the fastest dtype that agreed with fp32 (top-10 overlap >= 0.9, R@10
  within 0.5 points on the trained model, tests/unit/test_export_index_retrieve.py) in a recorded measurement.
  Recorded on 2026-12-02 (this machine kind, the test's trained tiny model, 32 validation states, fp32 R@10
  73.44): bf16 top-10 overlap 0.997, R@10 +0.00 (agrees); int8 overlap 0.981, R@10 -1.56 (does not). So a bf16
  CPU takes bf16, and a CPU without bf16 matmuls fp32 (autocast there emulates bf16, slower than fp32). The
  suite asserts the choice agrees on every run (that test), and compares batched with unbatched answers in fp32.

An index's stored rows are bf16 whatever the dtype they were embedded at, and a query at any dtype is scored
against them: a dtype changes a state's embedding by its rounding, so scores move by about that much (bf16:
around 1e-3 on a unit vector), and near-ties can swap.
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from leanagent.model.engines import AUTO, ENGINES

DTYPES = (AUTO, *ENGINES["torch"].dtypes)
# The CPU's choice, keyed by whether it has bf16 matmuls: the fastest dtype whose agreement is recorded in the module
# docstring (speed: `leanagent bench dtypes`; agreement: the trained-model test named there).
AUTO_CPU = {True: "bf16", False: "fp32"}

class DtypeError(ValueError):
    """A dtype this device cannot run."""


def cpu_has_bf16() -> bool:
    """Whether this CPU runs bf16 matmuls natively (oneDNN's own check: AVX-512 BF16, AMX, or Arm's bf16), asked of
    torch rather than read from the OS, so that it means the same on Linux and macOS."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return False


def resolve(dtype: str, device: torch.device | str) -> str:
    """The concrete dtype (`fp32`, `bf16` or `int8`) `dtype` means on `device`; refuses one it cannot run."""
    kind = torch.device(device).type
    if dtype not in DTYPES:
        raise DtypeError(f"--dtype {dtype}: one of {', '.join(DTYPES)}")
    if dtype == "auto":
        return AUTO_CPU[cpu_has_bf16()] if kind == "cpu" else "bf16"
    if dtype == "int8" and kind != "cpu":
        raise DtypeError(f"--dtype int8: dynamic int8 quantization runs on a CPU only, not on {kind}")
    return dtype


def precision(dtype: str, device: torch.device) -> AbstractContextManager:
    """The context an encoder pass runs in at a resolved `dtype`."""
    if dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def prepare(encoder: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """The encoder to run at a resolved `dtype`: for int8, its `Linear` layers quantized (a copy); else itself."""
    if dtype != "int8":
        return encoder
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantize_dynamic's deprecation: see the module docstring for why
        return torch.ao.quantization.quantize_dynamic(encoder, {torch.nn.Linear}, dtype=torch.qint8)


def apply_dtype(retriever: Any, dtype: str) -> str:
    """Resolve `dtype` on the retriever's device and prepare its encoder for it (int8: quantized, and run through
    transformers' own forward, which the quantized layers fit); the resolved name."""
    resolved = resolve(dtype, retriever.device)
    if resolved == "int8":
        retriever.encoder = prepare(retriever.encoder, resolved)
        retriever._stock = True
    return resolved
