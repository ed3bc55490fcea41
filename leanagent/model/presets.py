"""Randomly initialised ByT5-architecture encoders, for tests, the demo and benchmarks offline.

`byt5-small` has the shape of google/byt5-small's encoder, which
kaiyuy/leandojo-lean4-retriever-byt5-small fine-tunes; `tiny` trains in seconds on a CPU.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

from leanagent.ground.atomic import refuse_non_empty
from leanagent.ground.names import BYT5_SMALL, PRESET_NAMES, TINY, check_table
from leanagent.model.progress_bars import no_progress_bars

PRESETS: dict[str, dict] = {
    TINY: {"d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_heads": 4},
    BYT5_SMALL: {"d_model": 1472, "d_kv": 64, "d_ff": 3584, "num_layers": 12, "num_heads": 6},
}
check_table("leanagent.model.presets.PRESETS", PRESET_NAMES, PRESETS)


def encoder_config(preset: str) -> T5Config:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    return T5Config(vocab_size=384, feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False,
                    tie_word_embeddings=False, dropout_rate=0.1, **PRESETS[preset])


def write_random_encoder(out: Path, preset: str = TINY, seed: int = 0) -> Path:
    out = Path(out)
    refuse_non_empty(out)
    torch.manual_seed(seed)
    model = T5EncoderModel(encoder_config(preset))
    out.mkdir(parents=True, exist_ok=True)
    with no_progress_bars():
        model.save_pretrained(out)
    ByT5Tokenizer().save_pretrained(out)
    return out
