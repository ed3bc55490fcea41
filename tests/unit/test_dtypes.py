"""`--dtype`'s one meaning (`leanagent.model.dtypes`): what each name resolves to per device, and what is refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from leanagent.model.dtypes import AUTO_CPU, AUTO_PRECISION_CPU, DtypeError, cpu_has_bf16, resolve, resolve_precision


def test_auto_is_bf16_on_a_gpu_and_the_recorded_choice_on_a_cpu() -> None:
    assert resolve("auto", "cuda") == "bf16" and resolve("auto", "mps") == "bf16"
    assert resolve("auto", "cpu") == AUTO_CPU[cpu_has_bf16()] == ("bf16" if cpu_has_bf16() else "fp32")
    assert [resolve(d, "cpu") for d in ("fp32", "bf16", "int8")] == ["fp32", "bf16", "int8"]


REFUSED = [("int8", "cuda", "--dtype int8: dynamic int8 quantization runs on a CPU only, not on cuda"),
           ("fp16", "cpu", "--dtype fp16: one of auto, fp32, bf16, int8")]


@pytest.mark.parametrize(("dtype", "device", "message"), REFUSED)
def test_a_dtype_the_device_cannot_run_is_refused_in_one_line(dtype: str, device: str, message: str) -> None:
    with pytest.raises(DtypeError, match="^" + message.replace(".", r"\.") + "$"):
        resolve(dtype, device)


def test_trainer_precision_auto_is_leanagents_on_a_gpu_and_the_cpus_own_on_a_cpu() -> None:
    assert resolve_precision("auto", "gpu") == resolve_precision("auto", "cuda") == "bf16-mixed"
    assert resolve_precision("auto", "cpu", cpu_bf16=True) == "bf16-mixed"
    assert resolve_precision("auto", "cpu", cpu_bf16=False) == "32-true"
    assert resolve_precision("auto", "cpu") == AUTO_PRECISION_CPU[cpu_has_bf16()]
    for given in ("bf16-mixed", "32-true", "64-true", "32"):  # a precision the config names is kept, on any device
        assert resolve_precision(given, "cpu", cpu_bf16=False) == resolve_precision(given, "gpu") == given


def test_onednns_isa_limit_makes_this_cpu_one_without_bf16_matmuls() -> None:
    """ONEDNN_MAX_CPU_ISA=AVX2 (oneDNN's own variable, read once per process) turns the detection and oneDNN's
    kernels to those of an AVX2-only CPU: `trainer.precision: auto` takes 32-true and `--dtype auto` fp32."""
    code = ("from leanagent.model.dtypes import cpu_has_bf16, resolve, resolve_precision; "
            "print(cpu_has_bf16(), resolve_precision('auto', 'cpu'), resolve('auto', 'cpu'))")
    for limit, expected in (("AVX2", "False 32-true fp32"), ("AVX512_CORE_BF16", "False 32-true fp32")):
        env = {**os.environ, "ONEDNN_MAX_CPU_ISA": limit}
        ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert ran.returncode == 0 and ran.stdout.split() == expected.split(), ran.stderr
