"""One FLOP model of the retriever's encoder and one table of accelerator peaks, for MFU figures.

`leanagent bench` and `scripts/gpu_check.py` both report model FLOP utilisation; they take the FLOPs
from here and the peak from here, so the two can be compared and neither carries its own copy.

The FLOP model is the usual dense count for a T5 encoder (no embedding FLOPs: a lookup), per sequence
of L tokens, forward: 2 x L x (the weights a token meets in every layer: q, k, v, o and the feed-forward
wi_0, wi_1, wo, or wi, wo without gating) plus the two attention products (QK^T and AV) over every
layer and head, 2 x 2 x L^2 x heads x d_kv per layer. A training step is three times its forward
(backward = twice the forward's matmuls). MFU is counted on *real* tokens: a padding token's FLOPs
are spent but are not useful work, so padding lowers MFU instead of inflating it.
For byt5-small that is 434.1M FLOPs x L + 18,432 x L^2 per forward.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s, from the vendors' data sheets (SXM parts).
# Matched against torch.cuda.get_device_name(), first match wins.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0),
    ("H100", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("A10G", 70.0),
    ("L4", 121.0),
)


def peak_bf16_tflops(device_name: str | None) -> float | None:
    """The dense bf16 peak of a GPU by its name, or None when the table does not know it (no MFU then)."""
    if not device_name:
        return None
    for key, tflops in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops
    return None


def _get(config: Any, key: str) -> Any:
    return config[key] if isinstance(config, dict) else getattr(config, key)


def flops_per_token(config: Any) -> float:
    """Forward FLOPs per token of the weights' matmuls (the part linear in L)."""
    d_model, d_ff = _get(config, "d_model"), _get(config, "d_ff")
    inner = _get(config, "num_heads") * _get(config, "d_kv")
    gated = str(_get(config, "feed_forward_proj")).startswith("gated")
    per_layer = 4 * d_model * inner + (3 if gated else 2) * d_model * d_ff
    return 2.0 * _get(config, "num_layers") * per_layer


def flops_per_token_squared(config: Any) -> float:
    """Forward FLOPs per L^2 of the attention products."""
    return 4.0 * _get(config, "num_layers") * _get(config, "num_heads") * _get(config, "d_kv")


def forward_flops(config: Any, lengths: Iterable[int]) -> float:
    """Forward FLOPs of encoding sequences of these lengths, each on its own (no padding counted)."""
    linear, square = flops_per_token(config), flops_per_token_squared(config)
    return float(sum(linear * n + square * n * n for n in lengths))


def training_flops(config: Any, lengths: Iterable[int]) -> float:
    """Forward and backward of a training step over sequences of these lengths: 3 x the forward."""
    return 3.0 * forward_flops(config, lengths)


def mfu(flops_per_s: float, peak_tflops: float | None) -> float | None:
    return None if not peak_tflops else flops_per_s / (peak_tflops * 1e12)
