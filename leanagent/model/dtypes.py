"""The precision a served or indexing encoder runs at: `--dtype auto|fp32|bf16|int8`, owned here.

Why: on a CPU the state's encoder pass is what a `suggest_premises` call waits for, and at byt5-small's shape it
takes seconds in fp32 (see docs/performance.md). bf16 autocast uses the CPU's bf16 matmuls (AVX-512 BF16, AMX;
Apple's M-series on `mps`); int8 dynamic quantization of the `Linear` layers uses its int8 ones.

- `fp32`: what evaluation computes on a CPU; the reference.
- `bf16`: `torch.autocast` in bfloat16 (the weights stay fp32; matmuls run in bf16, pooling and the norm in fp32).
- `int8`: `torch.ao.quantization.quantize_dynamic` on the encoder's `Linear` layers (CPU only). Not torchao:
  torchao 0.18 installs from pip for torch 2.13 and runs on a CPU, but its int8 dynamic path ran a byt5-small
  feed-forward pair slower than `quantize_dynamic` and than bf16 on this machine kind (docs/performance.md), and it
  logs a failed CUDA-kernel load at import; so the deprecated API, its warning silenced.
- `auto`: bf16 on `cuda` (as evaluation runs under bf16-mixed; what `index` and `serve` did there before) and on
  `mps`; on a CPU the entry of `AUTO_CPU`: the fastest dtype that agreed with fp32 (top-10 overlap >= 0.9, R@10
  within 0.5 points on the trained model, tests/unit/test_export_index_retrieve.py) in a recorded measurement
  (docs/performance.md): bf16 agreed, int8 did not. So a bf16 CPU takes bf16, and a CPU without bf16 matmuls fp32
  (autocast there emulates bf16, slower than fp32). The suite asserts the choice agrees on every run (that test),
  and compares batched with unbatched answers in fp32.

An index's stored rows are bf16 whatever the dtype they were embedded at, and a query at any dtype is scored
against them: a dtype changes a state's embedding by its rounding, so scores move by about that much (bf16:
around 1e-3 on a unit vector), and near-ties can swap.
"""

from __future__ import annotations

import os
import platform
import warnings
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from leanagent.ground.names import AUTO, TORCH_DTYPE_CHOICES

DTYPES = TORCH_DTYPE_CHOICES  # torch's `--dtype` values: leanagent.ground.names (`leanagent.model.engines` checks them)
# The CPU's choice, keyed by whether it has bf16 matmuls: the fastest dtype whose agreement is recorded in the module
# docstring (speed: `leanagent bench dtypes`; agreement: the trained-model test named there).
AUTO_CPU = {True: "bf16", False: "fp32"}

class DtypeError(ValueError):
    """A dtype this device cannot run."""


# oneDNN's own variables limiting the instructions it uses (`ONEDNN_MAX_CPU_ISA=AVX2` makes this CPU run as an
# AVX2-only one), and the values that still allow AMX.
ONEDNN_ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def cpu_has_bf16() -> bool:
    """Whether this CPU's bf16 matmuls run faster than its fp32 ones, as torch reports it: oneDNN runs bf16 here
    (`torch.ops.mkldnn._is_mkldnn_bf16_supported()`: AVX-512 on x86, BF16 on Arm), and on x86 the CPU has AMX-BF16
    tiles (`torch.cpu.get_capabilities()["amx_bf16"]`, from cpuinfo) that oneDNN is not told to leave alone
    (ONEDNN_MAX_CPU_ISA below an AMX level). Asked of torch rather than read from the OS, so that it means the same
    on Linux and macOS.

    Why AMX, not AVX-512 BF16 alone: a byt5-small-shaped training step (`leanagent bench precision`, figures in
    docs/performance.md) ran faster in bf16 than in fp32 with AMX, but slower with oneDNN limited to AVX-512 BF16
    (as on CPUs with those instructions and no AMX), and slower still on AVX-512 or AVX2 alone, where bf16 is
    emulated. `ONEDNN_MAX_CPU_ISA=AVX2` (oneDNN's own variable) makes a CPU with AMX answer no here and run
    its kernels as an AVX2-only one does: how the tests see both kinds of CPU on one machine."""
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return False
    if platform.machine().lower() not in ("x86_64", "amd64", "x86", "i686"):
        return True  # Arm: oneDNN's check is the CPU's BF16 matrix instructions
    limit = next((os.environ[v] for v in ONEDNN_ISA_ENV if os.environ.get(v)), "ALL").strip().upper()
    if limit not in ("ALL", "DEFAULT") and "AMX" not in limit:
        return False
    try:
        return bool(torch.cpu.get_capabilities().get("amx_bf16", False))
    except (AttributeError, RuntimeError):
        return False


# trainer.precision: auto: LeanAgent's bf16-mixed on a GPU; on a CPU keyed by `cpu_has_bf16()` (speed: `leanagent
# bench precision`, figures in docs/performance.md).
GPU_PRECISION = "bf16-mixed"
AUTO_PRECISION_CPU = {True: "bf16-mixed", False: "32-true"}
# The autocast dtype of each precision `leanagent bench precision` measures (Lightning's CPU plugins: bf16-mixed
# runs the step under `torch.autocast("cpu", torch.bfloat16)`, 32-true under none).
LIGHTNING_AUTOCAST: dict[str, torch.dtype | None] = {"32-true": None, "bf16-mixed": torch.bfloat16}


def resolve_precision(precision: str, accelerator: str, cpu_bf16: bool | None = None) -> str:
    """The Lightning precision `trainer.precision` means on `accelerator` here: itself, unless it is `auto`, which
    is LeanAgent's bf16-mixed on a GPU (`gpu`, `cuda`, or `auto` where torch sees CUDA) and on a CPU bf16-mixed
    where it has bf16 matmuls, else 32-true (`cpu_bf16`: that answer given, instead of asked of this CPU)."""
    if precision != AUTO:
        return precision
    if accelerator in ("gpu", "cuda") or (accelerator == AUTO and torch.cuda.is_available()):
        return GPU_PRECISION
    return AUTO_PRECISION_CPU[cpu_has_bf16() if cpu_bf16 is None else cpu_bf16]


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
