"""A T5 encoder in CTranslate2's format (the engine LeanCopilot links), and that engine run as the retriever runs.

Why: on a laptop's CPU the state's encoder pass is what a query waits for, and CTranslate2 runs it faster than
torch at the same float32 precision, and about twice as fast again in int8 (figures: docs/performance.md); and
LeanCopilot's `select_premises` loads exactly such a folder.

- **Conversion** goes through CTranslate2's own converter API: `T5EncoderConverter._load` builds a
  `TransformerEncoderModelSpec` from the encoder's weights (pre-norm, RMS norm, gated GELU, T5's relative attention
  bias, which only the first layer of a T5 stack holds and every layer uses; no scaling of the queries or of the
  embeddings), and `Converter.convert` validates and saves it. No binary format is written here. The weights are
  saved in float32; the compute type (`--dtype`) is chosen when the folder is loaded, so one conversion serves
  every type.
- **Vocabulary**: exactly the tokens LeanCopilot's ByT5 tokenizer (`LeanCopilot/Models/ByT5.lean`) emits, so that
  its string tokens map to the ids the model was trained on: `<pad>`, `</s>`, `<unk>` (ids 0-2), then one token per
  byte (id 3 + byte), then `<extra_id_N>` up to the model's vocabulary size. A byte's token is the character of that
  code point (a byte of 0x80 or more: U+0080-U+00FF), except bytes 8 and 12, whose tokens there are the two
  characters `\\b` and `\\f`; Hugging Face's ByT5 vocabulary has the control characters instead, which would read
  LeanCopilot's two tokens as `<unk>`.
- **Encoding** (`Ct2Encoder`): token ids in, the last hidden state out, mean-pooled over each sequence's own tokens
  and L2-normalised as `PremiseRetriever.encode` does. LeanCopilot (`cpp/ct2.cpp`) takes the same mean without the
  normalisation, which scales a query's scores by one positive factor and so ranks the same.

`ctranslate2` is imported when a conversion or an engine is built (its import loads OpenMP and its kernels);
without it, `Ct2Missing` says how to install it in one line.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from leanagent.ground.json_files import MIB, JsonFileError, read_json_file
from leanagent.model.engines import CT2_COMPUTE_TYPES, CT2_INSTALL

SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2: T5's pad (its decoder start), end of sequence, unknown
BYTE_OFFSET = len(SPECIAL_TOKENS)
# LeanCopilot/Models/ByT5.lean's `vocab` differs from chr(byte) at these two bytes only (a fact of that file).
LEANCOPILOT_BYTE_TOKENS = {8: "\\b", 12: "\\f"}
META_FILE = "leanagent.json"  # in a conversion: what it was converted from


class Ct2Missing(RuntimeError):
    """CTranslate2 is not installed in this environment."""


def import_ct2() -> Any:
    """The `ctranslate2` module, or one line saying how to install it."""
    try:
        import ctranslate2
    except ImportError:
        raise Ct2Missing(f"--engine ct2 needs ctranslate2, which is not installed: {CT2_INSTALL}") from None
    return ctranslate2


def byte_token(byte: int) -> str:
    """The token LeanCopilot's ByT5 tokenizer emits for one UTF-8 byte."""
    return LEANCOPILOT_BYTE_TOKENS.get(byte, chr(byte))


def vocabulary(vocab_size: int) -> list[str]:
    """The converted model's tokens, id by id (module docstring)."""
    tokens = [*SPECIAL_TOKENS, *(byte_token(b) for b in range(256))]
    if vocab_size < len(tokens):
        raise ValueError(f"a vocabulary of {vocab_size} tokens is not ByT5's (at least {len(tokens)})")
    return tokens + [f"<extra_id_{i}>" for i in range(vocab_size - len(tokens))]


def leancopilot_tokens(text: str) -> list[str]:
    """What LeanCopilot hands its encoder for `text`: one token per UTF-8 byte, then `</s>` (no cut)."""
    return [byte_token(b) for b in text.encode("utf-8")] + ["</s>"]


def _converter_base() -> type:
    return import_ct2().converters.Converter


def _array(weight: torch.Tensor) -> np.ndarray:
    return weight.detach().to("cpu", torch.float32).contiguous().numpy()


def build_spec(encoder: Any) -> Any:
    """CTranslate2's specification of a transformers `T5EncoderModel`, its weights in float32."""
    import_ct2()  # one line where it is missing, before its specs are imported
    from ctranslate2.specs import common_spec, transformer_spec

    config = encoder.config
    activations = {"gelu_new": common_spec.Activation.GELUTanh, "gelu": common_spec.Activation.GELU,
                   "relu": common_spec.Activation.RELU}
    if config.dense_act_fn not in activations:
        raise ValueError(f"a T5 encoder with activation {config.dense_act_fn!r} has no CTranslate2 equivalent here")
    stack_spec = transformer_spec.TransformerEncoderSpec(
        config.num_layers, config.num_heads, pre_norm=True, activation=activations[config.dense_act_fn],
        ffn_glu=bool(config.is_gated_act), relative_attention_bias=True, rms_norm=True)
    spec = transformer_spec.TransformerEncoderModelSpec(stack_spec)
    stack = encoder.encoder
    stack_spec.scale_embeddings = False
    stack_spec.embeddings[0].weight = _array(stack.embed_tokens.weight)
    stack_spec.layer_norm.gamma = _array(stack.final_layer_norm.weight)
    first = stack.block[0].layer[0].SelfAttention
    bias = _array(first.relative_attention_bias.weight)
    distance = np.dtype("int32").type(first.relative_attention_max_distance)
    for layer_spec, block in zip(stack_spec.layer, stack.block, strict=True):
        attention, ffn = block.layer[0], block.layer[-1]
        own = layer_spec.self_attention
        own.queries_scale = 1.0  # T5 folds the 1/sqrt(d) into its initialisation
        own.layer_norm.gamma = _array(attention.layer_norm.weight)
        qkv = attention.SelfAttention
        own.linear[0].weight = np.concatenate([_array(qkv.q.weight), _array(qkv.k.weight), _array(qkv.v.weight)])
        own.linear[1].weight = _array(qkv.o.weight)
        own.relative_attention_bias = bias
        own.relative_attention_max_distance = distance
        dense = ffn.DenseReluDense
        layer_spec.ffn.layer_norm.gamma = _array(ffn.layer_norm.weight)
        if config.is_gated_act:
            layer_spec.ffn.linear_0.weight = _array(dense.wi_0.weight)
            layer_spec.ffn.linear_0_noact.weight = _array(dense.wi_1.weight)
        else:
            layer_spec.ffn.linear_0.weight = _array(dense.wi.weight)
        layer_spec.ffn.linear_1.weight = _array(dense.wo.weight)
    spec.register_vocabulary(vocabulary(config.vocab_size))
    spec.config.layer_norm_epsilon = float(config.layer_norm_epsilon)
    spec.config.bos_token, spec.config.eos_token, spec.config.unk_token = SPECIAL_TOKENS
    return spec


def convert(encoder: Any, out: Path, meta: dict[str, Any] | None = None) -> Path:
    """Write `encoder` (a transformers `T5EncoderModel`) as a CTranslate2 model folder `out`, float32 weights.

    Written beside `out` and renamed into place, so a reader never sees half a folder, and an existing `out` is
    replaced only by a finished conversion (CTranslate2's own `force` would delete it first). `meta` is written
    into the folder as `leanagent.json` (what it was converted from)."""
    base = _converter_base()

    class T5EncoderConverter(base):  # type: ignore[misc, valid-type]
        """CTranslate2's converter API, its `_load` building the spec from the weights in memory."""

        def _load(self) -> Any:
            return build_spec(encoder)

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        T5EncoderConverter().convert(str(work / "model"), force=True)
        if meta is not None:
            (work / "model" / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True), encoding="utf-8")
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
        os.replace(work / "model", out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out



def read_meta(folder: Path) -> dict[str, Any] | None:
    """A conversion's `leanagent.json` (None: absent or unreadable)."""
    try:
        meta = read_json_file(Path(folder) / META_FILE, MIB)
    except JsonFileError:
        return None
    return meta if isinstance(meta, dict) else None


class Ct2Encoder:
    """A converted encoder loaded by CTranslate2 at one of ct2's dtypes (`CT2_COMPUTE_TYPES`), embedding token-id
    rows as the retriever does (module docstring)."""

    def __init__(self, folder: Path, dtype: str = "fp32", threads: int = 0) -> None:
        ct2 = import_ct2()
        if dtype not in CT2_COMPUTE_TYPES:
            raise ValueError(f"CTranslate2 runs {', '.join(CT2_COMPUTE_TYPES)} here, not {dtype}")
        self.folder = Path(folder)
        self.dtype = dtype
        # intra_threads 0: CTranslate2's default (the cores OpenMP sees); one batch at a time (inter_threads 1).
        self.model = ct2.Encoder(str(folder), device="cpu", compute_type=CT2_COMPUTE_TYPES[dtype],
                                 intra_threads=threads or torch.get_num_threads())

    def encode(self, ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """One row per sequence of token ids (each ending in `</s>`, unpadded): the mean of the last hidden state
        over its tokens, L2-normalised, float32."""
        if not ids:
            return torch.empty(0, 0)
        out = self.model.forward_batch([list(map(int, row)) for row in ids])
        hidden = torch.from_numpy(np.asarray(out.last_hidden_state, dtype=np.float32))
        lengths = torch.tensor([len(row) for row in ids])
        keep = (torch.arange(hidden.shape[1])[None, :] < lengths[:, None]).unsqueeze(-1)
        pooled = (hidden * keep).sum(dim=1) / lengths[:, None].clamp(min=1)
        return torch.nn.functional.normalize(pooled, dim=1)
