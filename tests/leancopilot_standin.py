"""LeanCopilot's premise selection as lean-dojo/LeanCopilot (commit 6073803) runs it, for the tests: an export's
folders read and ranked with no leanagent code, only `ctranslate2` (the engine its C++ links) and `numpy`.

Each step is LeanCopilot's (file, function):
- the folders: `LeanCopilot/Models/Builtin.lean`'s two URLs, their last path part;
- `embeddings.npy`: `cpp/ct2.cpp` `init_premise_embeddings` reads it with `npy::read_npy<double>` (`cpp/npy.hpp`):
  a format 1.0 or 2.0 file of little-endian float64 only; it ignores `fortran_order` (so a Fortran-ordered file
  would be scrambled: refused here) and does not check the data's length (refused here when it differs); the rows
  are cast to float32;
- the tokens: `LeanCopilot/Models/ByT5.lean`'s `vocab`, one per UTF-8 byte of the whole state (no cut), then
  `</s>` (`LeanCopilot/Models/FFI.lean`'s `NativeEncoder.encode`); `BYTE_TOKENS` is that table, copied;
- the query: `cpp/ct2.cpp` `encode`, the encoder's last hidden state summed over every token in double and divided
  by their count; Lean's FloatArray cast back to float32 in `retrieve`;
- the ranking: `retrieve`'s float32 MatMul, then CTranslate2's CPU `TopK` (`src/ops/topk_cpu.cc`):
  `std::max_element` for k = 1, else `std::partial_sort` of the indices with `input[i1] > input[i2]`, written out
  below as libstdc++ does it (`partial_sort`);
- `assert(0 < idx && idx < num_premises)` per returned index (live in its build): `Aborted`;
- `dictionary[str(idx)]["full_name" | "path" | "code"]`.
"""

from __future__ import annotations

import ast
import json
import struct
from pathlib import Path

import numpy as np

ENCODER_FOLDER = "ct2-leandojo-lean4-retriever-byt5-small"
PREMISES_FOLDER = "premise-embeddings-leandojo-lean4-retriever-byt5-small"
DEFAULT_K = 16  # LeanCopilot/Options.lean: select_premises.k
EOS = "</s>"

# LeanCopilot/Models/ByT5.lean, `def vocab : Array String`: entry b is the token of byte b.
BYTE_TOKENS = (
    '\x00', '\x01', '\x02', '\x03', '\x04', '\x05', '\x06', '\x07',
    '\\b', '\t', '\n', '\x0b', '\\f', '\r', '\x0e', '\x0f',
    '\x10', '\x11', '\x12', '\x13', '\x14', '\x15', '\x16', '\x17',
    '\x18', '\x19', '\x1a', '\x1b', '\x1c', '\x1d', '\x1e', '\x1f',
    ' ', '!', '"', '#', '$', '%', '&', "'",
    '(', ')', '*', '+', ',', '-', '.', '/',
    '0', '1', '2', '3', '4', '5', '6', '7',
    '8', '9', ':', ';', '<', '=', '>', '?',
    '@', 'A', 'B', 'C', 'D', 'E', 'F', 'G',
    'H', 'I', 'J', 'K', 'L', 'M', 'N', 'O',
    'P', 'Q', 'R', 'S', 'T', 'U', 'V', 'W',
    'X', 'Y', 'Z', '[', '\\', ']', '^', '_',
    '`', 'a', 'b', 'c', 'd', 'e', 'f', 'g',
    'h', 'i', 'j', 'k', 'l', 'm', 'n', 'o',
    'p', 'q', 'r', 's', 't', 'u', 'v', 'w',
    'x', 'y', 'z', '{', '|', '}', '~', '\x7f',
    '\x80', '\x81', '\x82', '\x83', '\x84', '\x85', '\x86', '\x87',
    '\x88', '\x89', '\x8a', '\x8b', '\x8c', '\x8d', '\x8e', '\x8f',
    '\x90', '\x91', '\x92', '\x93', '\x94', '\x95', '\x96', '\x97',
    '\x98', '\x99', '\x9a', '\x9b', '\x9c', '\x9d', '\x9e', '\x9f',
    '\xa0', '¡', '¢', '£', '¤', '¥', '¦', '§',
    '¨', '©', 'ª', '«', '¬', '\xad', '®', '¯',
    '°', '±', '²', '³', '´', 'µ', '¶', '·',
    '¸', '¹', 'º', '»', '¼', '½', '¾', '¿',
    'À', 'Á', 'Â', 'Ã', 'Ä', 'Å', 'Æ', 'Ç',
    'È', 'É', 'Ê', 'Ë', 'Ì', 'Í', 'Î', 'Ï',
    'Ð', 'Ñ', 'Ò', 'Ó', 'Ô', 'Õ', 'Ö', '×',
    'Ø', 'Ù', 'Ú', 'Û', 'Ü', 'Ý', 'Þ', 'ß',
    'à', 'á', 'â', 'ã', 'ä', 'å', 'æ', 'ç',
    'è', 'é', 'ê', 'ë', 'ì', 'í', 'î', 'ï',
    'ð', 'ñ', 'ò', 'ó', 'ô', 'õ', 'ö', '÷',
    'ø', 'ù', 'ú', 'û', 'ü', 'ý', 'þ', 'ÿ',
)


class Aborted(AssertionError):
    """What ends the Lean process: LeanCopilot's assert on a returned index, or its C++ throwing."""


def tokenize(state: str) -> list[str]:
    """`tokenizer.tokenize input |>.push tokenizer.eosToken`."""
    return [BYTE_TOKENS[b] for b in state.encode("utf-8")] + [EOS]


def read_npy_double(path: Path) -> np.ndarray:
    """`npy::read_npy<double>`, refusing what it would refuse or misread."""
    raw = Path(path).read_bytes()
    assert raw[:6] == b"\x93NUMPY", f"{path}: not a .npy file"
    major, minor = raw[6], raw[7]
    if (major, minor) == (1, 0):
        (length,), start = struct.unpack("<H", raw[8:10]), 10
    elif (major, minor) == (2, 0):
        (length,), start = struct.unpack("<I", raw[8:12]), 12
    else:
        raise AssertionError(f"{path}: .npy version {major}.{minor}: npy.hpp throws")
    header = ast.literal_eval(raw[start:start + length].decode("latin1"))
    assert header["descr"] == "<f8", f"{path}: descr {header['descr']}: npy.hpp throws (typestrings not matching)"
    assert header["fortran_order"] is False, f"{path}: Fortran order, which ct2.cpp ignores: the rows would be wrong"
    shape = header["shape"]
    assert len(shape) == 2, f"{path}: shape {shape}"
    data = raw[start + length:]
    assert len(data) == shape[0] * shape[1] * 8, f"{path}: {len(data)} bytes of data for shape {shape}"
    return np.frombuffer(data, dtype="<f8").reshape(shape)


def partial_sort(values: list[float], k: int) -> list[int]:
    """`std::partial_sort(ids, ids + k, ids + n, [&](i1, i2) { return input[i1] > input[i2]; })` on `iota` ids, as
    libstdc++ writes it (`__heap_select`, then `__sort_heap`), returning the first k ids."""
    n = len(values)
    assert k <= n, f"k = {k} > {n} rows: partial_sort past the end (a segfault)"
    ids = list(range(n))

    def comp(a: int, b: int) -> bool:
        return values[a] > values[b]

    def push_heap(first: int, hole: int, top: int, value: int) -> None:
        parent = (hole - 1) // 2
        while hole > top and comp(ids[first + parent], value):
            ids[first + hole] = ids[first + parent]
            hole = parent
            parent = (hole - 1) // 2
        ids[first + hole] = value

    def adjust_heap(first: int, hole: int, length: int, value: int) -> None:
        top = hole
        second = hole
        while second < (length - 1) // 2:
            second = 2 * (second + 1)
            if comp(ids[first + second], ids[first + second - 1]):
                second -= 1
            ids[first + hole] = ids[first + second]
            hole = second
        if (length & 1) == 0 and second == (length - 2) // 2:
            second = 2 * (second + 1)
            ids[first + hole] = ids[first + second - 1]
            hole = second - 1
        push_heap(first, hole, top, value)

    def pop_heap(first: int, last: int, result: int) -> None:
        value = ids[result]
        ids[result] = ids[first]
        adjust_heap(first, 0, last - first, value)

    def make_heap(first: int, last: int) -> None:
        length = last - first
        if length < 2:
            return
        parent = (length - 2) // 2
        while True:
            adjust_heap(first, parent, length, ids[first + parent])
            if parent == 0:
                return
            parent -= 1

    make_heap(0, k)  # __heap_select
    for i in range(k, n):
        if comp(ids[i], ids[0]):
            pop_heap(0, k, i)
    last = k  # __sort_heap
    while last > 1:
        last -= 1
        pop_heap(0, last, last)
    return ids[:k]


class LeanCopilot:
    """An export's two folders, loaded and queried as LeanCopilot's `select_premises` loads and queries them."""

    def __init__(self, out: Path) -> None:
        import ctranslate2

        out = Path(out)
        self.encoder = ctranslate2.Encoder(str(out / ENCODER_FOLDER), device="cpu")  # its compute type: default
        self.embeddings = read_npy_double(out / PREMISES_FOLDER / "embeddings.npy").astype(np.float32)
        self.dictionary = json.loads((out / PREMISES_FOLDER / "dictionary.json").read_text(encoding="utf-8"))

    def encode(self, state: str) -> np.ndarray:
        hidden = np.asarray(self.encoder.forward_batch([tokenize(state)]).last_hidden_state)[0]
        total = np.zeros(hidden.shape[1], dtype=np.float64)
        for row in hidden:
            total += row.astype(np.float64)
        return (total / hidden.shape[0]).astype(np.float32)

    def scores(self, state: str) -> np.ndarray:
        return self.embeddings @ self.encode(state)

    def retrieve(self, state: str, k: int = DEFAULT_K) -> list[tuple[int, str, str, str, float]]:
        """(index, full_name, path, code, score) for each of the k, in TopK's order; `Aborted` where LeanCopilot's
        process would end."""
        scores = self.scores(state)
        n = len(self.embeddings)
        if k == 1:
            top = [int(np.argmax(scores))]
        else:
            top = partial_sort(scores.tolist(), k)
        out = []
        for idx in top:
            if not (0 < idx and idx < n):
                raise Aborted(f"assert(0 < idx && idx < num_premises) fails: index {idx} of {n} for {state!r}")
            entry = self.dictionary.get(str(idx))
            if not isinstance(entry, dict) or not all(isinstance(entry.get(f), str) for f in ("full_name", "path",
                                                                                           "code")):
                raise Aborted(f"dictionary[{idx}] has no full_name, path and code strings: the C++ throws")
            out.append((idx, entry["full_name"], entry["path"], entry["code"], float(scores[idx])))
        return out

    def names(self, state: str, k: int = DEFAULT_K) -> list[str]:
        return [full_name for _, full_name, _, _, _ in self.retrieve(state, k)]


# States as LeanCopilot's `ppTacticState` prints them (LeanCopilot/Tactics.lean: one goal's `ppGoal`; several joined
# by a blank line), of the shapes a tokenizer gets wrong: ℕ and → (3-byte), 4-byte characters, tabs, two goals.
SPECIAL_STATES = (
    "n : ℕ\n⊢ n + 0 = n",
    "f : ℕ → ℕ → ℕ\nh : ∀ a b, f a b = f b a\n⊢ f 1 2 = f 2 1",
    "x : 𝕜\ns : Set 𝕜\n⊢ 𝓝 x ≤ 𝓝 x",
    "a\tb\t: Nat\n⊢\ta + b = b + a",
    "case inl\np q : Prop\nhp : p\n⊢ p ∨ q\n\ncase inr\np q : Prop\nhq : q\n⊢ p ∨ q",
    "x y n m : Nat\n⊢ frob 0 = 0",
    "no goals",
)
