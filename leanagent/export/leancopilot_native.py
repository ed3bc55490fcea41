"""LeanCopilot's retrieval as its C++ runs it, on an export's folders: the export's check, so that no export is
written that LeanCopilot's `select_premises` can crash on.

What LeanCopilot (lean-dojo/LeanCopilot, `cpp/ct2.cpp` and the Lean around it) does, and this follows:

- **Reading `embeddings.npy`** (`init_premise_embeddings`): its vendored `npy::read_npy<double>` (`cpp/npy.hpp`)
  takes a format 1.0 or 2.0 file of host-endian float64 only (any other dtype throws: no premise selection at
  all), reads `fortran_order` and then ignores it (a Fortran-ordered matrix is read as if it were C order:
  scrambled, with no error), and does not check that the file holds all its data. The rows are cast to float32.
  `read_leancopilot_npy` refuses each of those cases.
- **The query** (`NativeEncoder.encode`, then C++ `encode`): one token per UTF-8 byte of the whole state
  (`LeanCopilot/Models/ByT5.lean`, no cut), then `</s>`; the mean of the encoder's last hidden state over every
  token, summed in double; then cast to float32. Not normalised: a positive factor on every score.
- **The ranking** (`retrieve`): a float32 MatMul of the rows with the query, then CTranslate2's CPU `TopK`
  (`src/ops/topk_cpu.cc`): for k = 1 `std::max_element`, otherwise `std::partial_sort` of the row indices with
  the comparator `input[i1] > input[i2]`. With k greater than the rows, it sorts past the end (a crash).
- **The index check**: `assert(0 < idx && idx < num_premises)` on each of the k, live in the built library (its
  lakefile compiles with -O3 and no -DNDEBUG): when row 0 is among the k, the Lean process aborts. Then
  `dictionary[str(idx)]` gives `full_name`, `path` and `code`; a missing entry throws in C++, which also ends the
  process.
- `select_premises` asks for `LeanCopilot.select_premises.k` premises, 16 unless set (`LeanCopilot/Options.lean`).

`top_k_indices` is libstdc++'s `std::partial_sort` step for step (the heap of the first k, an element replacing
the heap's top only when strictly greater, then the heap sorted), so ties come out in its order; which rows are
returned (what the index check sees) is the same under any standard library: every row of the k best values.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from leanagent.export.leancopilot_cache import ENCODER, PREMISES
from leanagent.model.ct2 import import_ct2, leancopilot_tokens

DEFAULT_K = 16  # LeanCopilot.select_premises.k's default (LeanCopilot/Options.lean)
NPY_VERSIONS = ((1, 0), (2, 0))  # npy.hpp's read_header: any other version throws
NPY_DTYPE = np.dtype("<f8" if sys.byteorder == "little" else ">f8")  # npy.hpp: double, the host's byte order
SCAN_CHUNK = 1 << 14  # scores compared with the heap's top a chunk at a time (module docstring)


class LeanCopilotCrash(RuntimeError):
    """What would end the Lean process that runs LeanCopilot (an assert, a C++ exception, a read past the end)."""


@dataclass(frozen=True)
class Retrieved:
    """One premise LeanCopilot's `retrieve` returns: its row, the dictionary's entry, and its score."""

    row: int
    full_name: str
    path: str
    code: str
    score: float


def read_leancopilot_npy(path: Path) -> np.ndarray:
    """`embeddings.npy` as LeanCopilot reads it, its float64 rows (LeanCopilot then casts them to float32); a file
    it would refuse, or misread, raises `LeanCopilotCrash` naming why (module docstring)."""
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
        except ValueError as exc:
            raise LeanCopilotCrash(f"{path}: not a .npy file ({exc})") from None
        if version not in NPY_VERSIONS:
            raise LeanCopilotCrash(f"{path}: .npy format {version[0]}.{version[1]}; LeanCopilot reads 1.0 and 2.0")
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
            np.lib.format.read_array_header_2_0
        shape, fortran_order, dtype = read_header(f)
        if dtype.str != NPY_DTYPE.str:
            raise LeanCopilotCrash(f"{path}: dtype {dtype.str}; LeanCopilot reads {NPY_DTYPE.str} (float64) only")
        if fortran_order:
            raise LeanCopilotCrash(f"{path}: Fortran order; LeanCopilot ignores the flag and reads the matrix as C "
                                   f"order, scrambled")
        if len(shape) != 2:
            raise LeanCopilotCrash(f"{path}: shape {shape}; LeanCopilot needs rows (2 dimensions)")
        data = f.read()
    expected = shape[0] * shape[1] * NPY_DTYPE.itemsize
    if len(data) != expected:
        raise LeanCopilotCrash(f"{path}: {len(data):,} bytes of data for shape {shape} ({expected:,}); LeanCopilot "
                               f"would read past the end, or leave part unread")
    return np.frombuffer(data, dtype=NPY_DTYPE).reshape(shape)


def top_k_indices(scores: np.ndarray, k: int) -> list[int]:
    """CTranslate2's CPU `TopK` on one row of scores: the k indices it returns, in its order (module docstring)."""
    n = len(scores)
    if k < 1:
        return []
    if k > n:
        raise LeanCopilotCrash(f"k = {k} with {n} rows: CTranslate2's TopK sorts past the end of the scores")
    if k == 1:
        return [int(np.argmax(scores))]  # std::max_element: the first of the largest (the scores are finite)
    values = scores.tolist()

    def before(a: int, b: int) -> bool:  # the comparator: a is ranked before b
        return values[a] > values[b]

    def push(heap: list[int], hole: int, top: int, value: int) -> None:  # std::__push_heap
        parent = (hole - 1) // 2
        while hole > top and before(heap[parent], value):
            heap[hole] = heap[parent]
            hole, parent = parent, (parent - 1) // 2
        heap[hole] = value

    def adjust(heap: list[int], hole: int, length: int, value: int) -> None:  # std::__adjust_heap
        top, child = hole, hole
        while child < (length - 1) // 2:
            child = 2 * (child + 1)
            if before(heap[child], heap[child - 1]):
                child -= 1
            heap[hole], hole = heap[child], child
        if length % 2 == 0 and child == (length - 2) // 2:
            child = 2 * (child + 1)
            heap[hole], hole = heap[child - 1], child - 1
        push(heap, hole, top, value)

    heap = list(range(k))
    for parent in range((k - 2) // 2, -1, -1):  # std::__make_heap
        adjust(heap, parent, k, heap[parent])
    # std::__heap_select: a later index replaces the top only when strictly before it. The top's value only
    # rises, so a chunk's indices above the current top are a superset of those that will replace it.
    for lo in range(k, n, SCAN_CHUNK):
        for i in (np.flatnonzero(scores[lo:lo + SCAN_CHUNK] > values[heap[0]]) + lo).tolist():
            if before(i, heap[0]):
                adjust(heap, 0, k, i)
    for last in range(k - 1, 0, -1):  # std::__sort_heap
        value, heap[last] = heap[last], heap[0]
        adjust(heap, 0, last, value)
    return heap


class LeanCopilotRetrieval:
    """An export's two folders loaded as LeanCopilot loads them, answering as its `retrieve` answers."""

    def __init__(self, out: Path) -> None:
        out = Path(out)
        self.encoder = import_ct2().Encoder(str(out / ENCODER.folder), device="cpu")  # its compute type: default
        self.rows = read_leancopilot_npy(out / PREMISES.folder / "embeddings.npy").astype(np.float32)
        self.dictionary: dict[str, Any] = json.loads((out / PREMISES.folder / "dictionary.json").read_text(
            encoding="utf-8"))

    def encode(self, state: str) -> np.ndarray:
        """The query: the mean of the last hidden state over every token, summed in double, as float32."""
        hidden = np.asarray(self.encoder.forward_batch([leancopilot_tokens(state)]).last_hidden_state)[0]
        return (hidden.astype(np.float64).sum(axis=0) / hidden.shape[0]).astype(np.float32)

    def scores(self, state: str) -> np.ndarray:
        return self.rows @ self.encode(state)

    def retrieve(self, state: str, k: int = DEFAULT_K) -> list[Retrieved]:
        """`retrieve(encode(state), k)`, its index check and dictionary look-up included: `LeanCopilotCrash`
        where LeanCopilot would end the process."""
        return self.answer(self.scores(state), k, state)

    def answer(self, scores: np.ndarray, k: int, state: str) -> list[Retrieved]:
        """`retrieve`'s part after the MatMul, on a state's `scores`."""
        out = []
        for row in top_k_indices(scores, k):
            if not 0 < row < len(self.rows):
                raise LeanCopilotCrash(f"row {row} is among the {k} best for {state!r}: LeanCopilot's "
                                       f"assert(0 < idx && idx < num_premises) aborts the Lean process")
            entry = self.dictionary.get(str(row))
            fields = [entry.get(key) if isinstance(entry, dict) else None for key in ("full_name", "path", "code")]
            if not all(isinstance(v, str) for v in fields):
                raise LeanCopilotCrash(f"dictionary.json: no full_name, path and code strings for row {row}; "
                                       f"LeanCopilot's C++ throws")
            out.append(Retrieved(row, *fields, float(scores[row])))
        return out


def placeholder_rank(scores: np.ndarray) -> int:
    """The best rank row 0 can take among `scores` (ties counted in its favour): LeanCopilot returns it at no k
    below this."""
    return 1 + int((scores[1:] > scores[0]).sum())
