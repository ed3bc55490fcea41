"""ByT5 tokenization built with numpy: the same tensors as ``ByT5Tokenizer``, without its Python loop per byte.

ByT5's ids are a text's UTF-8 bytes plus 3, then ``</s>`` (1); padding is 0. With ``truncation=True``
and ``max_length=L`` the tokenizer keeps the first L-1 bytes, then ``</s>``; ``padding="longest"``
pads every row to the batch's longest. So a batch is one ``b"".join`` of the (truncated) byte
strings, scattered into a zero array under a mask of row lengths: ~1 microsecond per text instead
of ~0.4 ms through ``transformers``.

The tokenizer maps a few literals to single ids (``<pad>``, ``</s>``, ``<unk>``, ``<extra_id_N>``
and any added token), strips whitespace next to some of them, and does not add ``</s>`` after one
that ends the text. Every text containing such a literal is therefore encoded by the tokenizer
itself, as is every batch when the tokenizer is not ByT5 or is configured unusually (left padding or
truncation, extra added tokens): `byt5_spec` checks the tokenizer once against probe texts and
answers None for anything else.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

BYT5_OFFSET = 3
PAD_ID, EOS_ID = 0, 1
BYT5_VOCAB = 256 + BYT5_OFFSET + 125  # bytes, three specials, 125 sentinels: len(ByT5Tokenizer())
_PROBES = ("", "a", "abc def\tghi\n", "é ∀ x ∈ ℕ, 🙂 e\u0301", "<a>Nat.add</a> ≤ «x»", "x" * 40, "λ" * 20)
_PROBE_LEN = 16

# tokenizer -> (its signature when checked, its spec or None); weak, so a dropped tokenizer is not kept alive.
_specs: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], ByT5Spec | None]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class ByT5Spec:
    """What the fast path needs to know about a ByT5 tokenizer: the literals it does not encode byte by byte."""

    special: re.Pattern[bytes]

    def needs_tokenizer(self, data: bytes) -> bool:
        return self.special.search(data) is not None


def _signature(tokenizer: Any) -> tuple[Any, ...]:
    """Cheap to read on every call; a tokenizer changed after its check (tokens added, sides flipped) is re-checked."""
    try:
        size = len(tokenizer)
    except TypeError:
        size = None
    return (size, getattr(tokenizer, "padding_side", None), getattr(tokenizer, "truncation_side", None),
            getattr(tokenizer, "split_special_tokens", None), getattr(tokenizer, "pad_token_id", None),
            getattr(tokenizer, "eos_token_id", None))


def _special_literals(tokenizer: Any) -> set[str]:
    literals: set[str] = set(getattr(tokenizer, "all_special_tokens", None) or [])
    literals |= set(getattr(tokenizer, "added_tokens_encoder", None) or {})
    trie = getattr(tokenizer, "tokens_trie", None)
    literals |= set(getattr(trie, "_tokens", None) or [])
    return {str(t) for t in literals if str(t)}


def byt5_spec(tokenizer: Any) -> ByT5Spec | None:
    """The fast-path description of `tokenizer`, or None when only the tokenizer itself can encode for it."""
    signature = _signature(tokenizer)
    try:
        cached = _specs.get(tokenizer)
    except TypeError:  # not weak-referenceable or not hashable: check every time
        cached = None
    if cached is not None and cached[0] == signature:
        return cached[1]
    spec = _build_spec(tokenizer, signature)
    try:
        _specs[tokenizer] = (signature, spec)
    except TypeError:
        pass
    return spec


def _build_spec(tokenizer: Any, signature: tuple[Any, ...]) -> ByT5Spec | None:
    size, padding_side, truncation_side, _, pad_id, eos_id = signature
    if size != BYT5_VOCAB or pad_id != PAD_ID or eos_id != EOS_ID:
        return None
    if padding_side not in (None, "right") or truncation_side not in (None, "right"):
        return None
    literals = sorted(_special_literals(tokenizer), key=lambda t: (-len(t), t))
    pattern = re.compile(b"|".join(re.escape(t.encode("utf-8")) for t in literals)) if literals else re.compile(b"(?!)")
    spec = ByT5Spec(pattern)
    try:
        ref = tokenizer(list(_PROBES), padding="longest", truncation=True, max_length=_PROBE_LEN, return_tensors="pt")
        ids, mask = encode_bytes([p.encode("utf-8") for p in _PROBES], _PROBE_LEN)
        same = torch.equal(ref["input_ids"], ids) and torch.equal(ref["attention_mask"], mask)
    except Exception:  # a tokenizer that cannot even do this is not one we imitate
        return None
    return spec if same else None


def encode_bytes(data: Sequence[bytes], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ByT5 ids and attention mask of UTF-8 byte strings, truncated to `max_len` tokens and padded to the longest."""
    keep = max_len - 1
    cut = [d if len(d) <= keep else d[:keep] for d in data]
    lengths = np.fromiter(map(len, cut), dtype=np.int64, count=len(cut))
    width = int(lengths.max()) + 1
    flat = np.frombuffer(b"".join(cut), dtype=np.uint8)
    columns = np.arange(width)
    ids = np.zeros((len(cut), width), dtype=np.int64)
    ids[columns < lengths[:, None]] = flat + BYT5_OFFSET  # row-major order of the mask is the join's order
    ids[np.arange(len(cut)), lengths] = EOS_ID
    mask = (columns <= lengths[:, None]).astype(np.int64)
    return torch.from_numpy(ids), torch.from_numpy(mask)


def _pad_rows(rows: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    width = int(lengths.max())
    columns = np.arange(width)
    filled = columns < lengths[:, None]
    ids = np.zeros((len(rows), width), dtype=np.int64)
    ids[filled] = np.concatenate(rows)
    return torch.from_numpy(ids), torch.from_numpy(filled.astype(np.int64))


def _reference(tokenizer: Any, texts: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tokenizer(texts, padding="longest", truncation=True, max_length=max_len, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def tokenize_encoded(
    tokenizer: Any, spec: ByT5Spec, data: Sequence[bytes], texts: Sequence[str] | None, max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode UTF-8 `data` (the bytes of `texts`) for a ByT5 `tokenizer`; rows with a special literal go through it.

    `texts` may be None: the strings are then decoded from `data` for the rare rows that need them.
    """
    slow = [k for k, d in enumerate(data) if spec.needs_tokenizer(d)]
    if not slow:
        return encode_bytes(data, max_len)
    originals = [texts[k] if texts is not None else data[k].decode("utf-8") for k in slow]
    encoded = tokenizer(originals, truncation=True, max_length=max_len)["input_ids"]
    by_row = dict(zip(slow, encoded, strict=True))
    keep = max_len - 1
    rows = []
    for k, d in enumerate(data):
        if k in by_row:
            rows.append(np.asarray(by_row[k], dtype=np.int64))
        else:
            row = np.empty(min(len(d), keep) + 1, dtype=np.int64)
            row[:-1] = np.frombuffer(d[:keep], dtype=np.uint8)
            row[:-1] += BYT5_OFFSET
            row[-1] = EOS_ID
            rows.append(row)
    return _pad_rows(rows)


def tokenize(tokenizer: Any, texts: Sequence[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids and mask of ``tokenizer(texts, padding="longest", truncation=True, max_length=max_len)``, as tensors."""
    texts = list(texts)
    spec = byt5_spec(tokenizer) if texts and max_len >= 2 else None
    if spec is None:
        return _reference(tokenizer, texts, max_len)
    try:
        data = [t.encode("utf-8") for t in texts]
    except UnicodeEncodeError:  # a lone surrogate: let the tokenizer raise (or cope) as it always did
        return _reference(tokenizer, texts, max_len)
    return tokenize_encoded(tokenizer, spec, data, texts, max_len)
