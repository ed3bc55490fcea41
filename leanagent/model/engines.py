"""The engines a query side can run its encoder on (`--engine`), each one entry of `ENGINES`, and what `auto` picks.

- `torch`: the retriever's own encoder (`--dtype` fp32, bf16 autocast, int8 dynamic quantization:
  `leanagent.model.dtypes`); every device.
- `ct2`: the same weights converted to CTranslate2 (`leanagent.model.ct2`), the engine LeanCopilot links; a CPU
  only, at CTranslate2's compute types fp32, int8 and int8_float32 (int8 weights, float32 elsewhere).

`auto` picks the fastest engine and dtype whose agreement with torch fp32 is recorded as exact: ct2 fp32 on a CPU
where CTranslate2 is installed (its mean-pooled embedding against torch fp32: cosine >= 0.9999998, top-10 overlap
1.00; measured and checked by tests/unit/test_engines.py on every run; speed: `leanagent bench engines`, recorded in
docs/performance.md), else torch at its own `auto` dtype. It never picks int8: an int8 dtype is asked for by name.
A dtype given by name with `--engine auto` runs on torch where torch has it (as `--dtype` meant before engines
existed) and on ct2 otherwise (int8_float32).

Nothing here imports torch or CTranslate2 (the command line's parsers read these names); `installed` asks for the
package without importing it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from leanagent.ground.names import (
    AUTO,
    CT2,
    DTYPE_CHOICES,
    ENGINE_CHOICES,
    ENGINE_NAMES,
    FP32,
    INT8,
    INT8_FLOAT32,
    TORCH,
    TORCH_DTYPES,
    check_table,
)


@dataclass(frozen=True)
class Engine:
    name: str
    dtypes: tuple[str, ...]  # the --dtype values it runs, its default first
    exact: tuple[str, ...]  # those whose agreement with torch fp32 is recorded as exact
    devices: tuple[str, ...]
    package: str  # what must be installed
    build: str  # "module:function" of the query-side encoder: (index's loaded parts, dtype) -> encoder
    help: str


ENGINES: dict[str, Engine] = {e.name: e for e in (
    Engine(TORCH, TORCH_DTYPES, (FP32,), ("cpu", "cuda", "mps"), "torch",
           "leanagent.index.encoders:torch_encoder", "the retriever's own encoder"),
    Engine(CT2, (FP32, INT8, INT8_FLOAT32), (FP32,), ("cpu",), "ctranslate2",
           "leanagent.index.encoders:ct2_encoder", "CTranslate2 (LeanCopilot's engine), CPU only"),
)}
check_table("leanagent.model.engines.ENGINES", ENGINE_NAMES, ENGINES)
check_table("the engines' dtypes", DTYPE_CHOICES[1:], (d for e in ENGINES.values() for d in e.dtypes))
# CTranslate2's compute type for each of ct2's dtypes.
CT2_COMPUTE_TYPES = {FP32: "float32", INT8: "int8", INT8_FLOAT32: "int8_float32"}
CT2_INSTALL = "pip install ctranslate2 (wheels for Linux x86_64 and aarch64, macOS arm64, Windows)"


class EngineError(ValueError):
    """An engine, dtype and device that cannot go together, or an engine that is not installed: one line."""


def installed(engine: str) -> bool:
    return importlib.util.find_spec(ENGINES[engine].package) is not None


def choose(engine: str, dtype: str, device: str) -> tuple[str, str]:
    """(engine, dtype) that `--engine ENGINE --dtype DTYPE` run on `device` (a device kind: cpu, cuda, mps); the
    dtype stays `auto` for torch, whose own rule (`leanagent.model.dtypes.resolve`) decides it on the device."""
    if engine not in ENGINE_CHOICES:
        raise EngineError(f"--engine {engine}: one of {', '.join(ENGINE_CHOICES)}")
    if dtype not in DTYPE_CHOICES:
        raise EngineError(f"--dtype {dtype}: one of {', '.join(DTYPE_CHOICES)}")
    if engine == AUTO:
        engine = _auto(dtype, device)
    spec = ENGINES[engine]
    if device not in spec.devices:
        raise EngineError(f"--engine {engine} runs on {', '.join(spec.devices)}, not --device {device}")
    if dtype != AUTO and dtype not in spec.dtypes:
        raise EngineError(f"--dtype {dtype}: --engine {engine} runs {', '.join(spec.dtypes)}")
    if not installed(engine):
        hint = CT2_INSTALL if engine == CT2 else f"pip install {spec.package}"
        raise EngineError(f"--engine {engine} needs {spec.package}, which is not installed: {hint}")
    if dtype == AUTO and engine != TORCH:
        dtype = spec.exact[0]
    return engine, dtype


def _auto(dtype: str, device: str) -> str:
    if dtype == AUTO:
        exact = [e.name for e in ENGINES.values() if e.name != TORCH and device in e.devices and installed(e.name)]
        return exact[0] if exact else TORCH
    return TORCH if dtype in ENGINES[TORCH].dtypes else next(
        e.name for e in ENGINES.values() if dtype in e.dtypes)
