"""`--dtype`'s one meaning (`leanagent.model.dtypes`): what each name resolves to per device, and what is refused."""

from __future__ import annotations

import pytest

from leanagent.model.dtypes import AUTO_CPU, DtypeError, cpu_has_bf16, resolve


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
