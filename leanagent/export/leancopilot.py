"""`leanagent export SOURCE --format leancopilot OUT`: an index (a run's newest stage) as LeanCopilot's two model
folders, so that its `select_premises` tactic answers with this retriever, natively, with no server.

LeanCopilot (lean-dojo/LeanCopilot) reads, from its model cache (`leanagent.export.leancopilot_cache`):

- the encoder of `Builtin.encoder`'s URL: a CTranslate2 model folder. Written from the index's model by
  `leanagent.model.ct2` (CTranslate2's converter API), float32 weights, with the vocabulary of tokens its ByT5
  tokenizer emits; the conversion cached next to the index is reused;
- the premises of `Builtin.premisesUrl`: `embeddings.npy`, float64 `[N + 1, d]` in C order (its C++ reads it with
  `npy::read_npy<double>`), and `dictionary.json`, `{"i": {"full_name", "path", "code"}}` for row i. Rows 1..N are
  the index's own rows (bf16 on disk, exact in float64); no premise is embedded again.

**Row 0 is a placeholder, never a premise.** LeanCopilot's `retrieve` asserts `0 < idx` on each of the k premises
it returns (live in its build): whenever row 0 is among them, the Lean process aborts
(`leanagent.export.leancopilot_native`). No fixed vector scores below the k-th best for every query (whatever row 0
holds, some query scores it highest), and a NaN or infinite row gives NaN scores for queries of mixed sign, which
break `std::partial_sort`'s order instead of ranking last. So row 0 is the centroid of the premises' rows: for any
query it scores the premises' mean score, so it reaches the top k only if fewer than k premises score above their
own mean (and it ranks first only if all score the same). Shrinking it toward zero would rank it lower for queries
whose premises score positive on average, but higher for the others, which are half of all states on some trained
models (figures: docs/measurements.md); the centroid's bound holds whatever that sign. Its dictionary entry names no
premise (`PLACEHOLDER`). An index of no more premises than LeanCopilot's default k is refused: the placeholder
would be among the k, or the k would run past the rows.

`code` is the premise's source as its corpus holds it (LeanCopilot shows it for a premise the file does not
import), read from the datasets index.json names and checked against the text the index embedded
(`serialize_premise(full_name, code)` must give it back); where a corpus is gone or disagrees, the embedded text
with its name tags removed stands in, and the summary counts those.

Before anything is written the export is checked as LeanCopilot will use it: the converted encoder, fed the
string tokens LeanCopilot's tokenizer emits, must give the index's own rows for a few premises; and LeanCopilot's
retrieval, run as its C++ runs it (its file reader, its top-k, its index check, at its default k), must return k
real premises for every probe state: fixed ones (ℕ, →, 4-byte characters, tabs, two goals) and the test states of
the datasets the index names, up to `PROBE_STATES`.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from leanagent.data.corpus import Corpus
from leanagent.data.premise_text import MARK_END, MARK_START, serialize_premise
from leanagent.data.theorems import load_states
from leanagent.export.leancopilot_cache import (
    ENCODER,
    LEANCOPILOT_FOLDERS,
    PREMISES,
    install,
    make_git_ready,
    readme,
    write_export_id,
)
from leanagent.export.leancopilot_native import (
    DEFAULT_K,
    LeanCopilotCrash,
    LeanCopilotRetrieval,
    placeholder_rank,
    read_leancopilot_npy,
)
from leanagent.ground.atomic import out_folder_problem, refuse_non_empty
from leanagent.ground.names import CORPUS_FILE
from leanagent.index.encoders import EncoderSource, ct2_conversion
from leanagent.index.files import CONTEXT_MAX_LEN, INDEX_FILE, PREMISES_FILE, PremiseIndexError
from leanagent.index.read import PremiseLine, check_model, read_embeddings, read_jsonl, read_meta
from leanagent.model.ct2 import META_FILE, Ct2Encoder, leancopilot_tokens

MODEL_FILES = ("model.bin", "config.json", "vocabulary.json")
PROBE_PREMISES = 4
PROBE_MIN_COSINE = 0.95  # as the index's own probe: another model, or a broken conversion, gives far less
# Row 0's dictionary entry: no Lean name (spaces, parentheses), no module; LeanCopilot never returns the row.
PLACEHOLDER = {"full_name": "(no premise: row 0 is a placeholder that LeanCopilot never returns)", "path": "(none)",
               "code": "-- leanagent's export: LeanCopilot's retrieve asserts 0 < idx, so row 0 holds no premise, "
                       "only the mean of the premises' rows"}
# The states LeanCopilot's retrieval is checked on besides the datasets' tests: `LeanCopilot/Tactics.lean`'s
# `ppTacticState` prints these shapes (two goals joined by a blank line; `no goals`).
FIXED_STATES = (
    "⊢ True",
    "no goals",
    "x y n m : ℕ\n⊢ x + y = y + x",
    "f : ℕ → ℕ\nh : ∀ (n : ℕ), f n = n\n⊢ f 0 = 0",
    "s : Set 𝔽\nh : 𝓝 0 ≤ 𝓝 1\n⊢ s ⊆ s",  # 4-byte UTF-8 characters
    "a\tb : Nat\n⊢ a\t+ b = b + a",
    "case left\na b : ℕ\n⊢ a ≤ a + b\n\ncase right\na b : ℕ\n⊢ b ≤ a + b",
    "h : \b\f = \f\b\n⊢ True",  # the two bytes whose LeanCopilot tokens are not chr(byte)
)
TEST_SPLITS = ("random/test.json", "novel_premises/test.json")  # a LeanDojo dataset's test states
PROBE_STATES = 256  # test states checked at most, evenly spaced over them (each is one encoder pass)


@dataclass
class LeanCopilotExport:
    """What an export wrote and found: for the command's summary."""

    out: Path
    premises: int
    width: int
    code_from_corpus: int
    checked_states: int = 0
    placeholder_best_rank: int = 0  # the best rank row 0 took on the checked states (LeanCopilot's k below it)
    warnings: list[str] = field(default_factory=list)
    moved_aside: list[Path] = field(default_factory=list)
    installed: list[Path] = field(default_factory=list)


def export_leancopilot(index: Path, out: Path, force: bool = False, do_install: bool = False,
                       stage: str | None = None) -> LeanCopilotExport:
    """Write `index` (an INDEX folder) as LeanCopilot's folders in `out` (new or empty; with `force`, only the two
    folders and README.md an earlier export wrote there are replaced), then, with `do_install`, into LeanCopilot's
    cache, the folders found there moved aside with a dated suffix. `stage`: the run's stage, for the README."""
    index, out = Path(index), Path(out)
    _check_out(out, force)
    meta = read_meta(index)
    model = meta.get("checkpoint") or meta.get("model")
    if not model:
        raise PremiseIndexError(f"{index / INDEX_FILE}: names no checkpoint or model")
    # A changed model would pair stale rows with a new encoder in LeanCopilot: refused, whatever --force says.
    warnings = check_model(index, meta, Path(model), force=False,
                           advice="Rebuild the index (`leanagent index`), then export it")
    rows = read_embeddings(index, meta, warnings)
    premises = read_jsonl(index / PREMISES_FILE, PremiseLine)
    if len(premises) != rows.shape[0]:
        raise PremiseIndexError(f"{index}: {rows.shape[0]} embeddings for {len(premises)} premises; rebuild the index")
    if len(premises) <= DEFAULT_K:
        raise PremiseIndexError(
            f"{index}: {len(premises)} premises; LeanCopilot's select_premises asks for its {DEFAULT_K} best rows "
            f"and aborts Lean when one is row 0, which holds no premise: with {DEFAULT_K} premises or fewer it "
            f"would on nearly every state, or read past the rows; export an index of more than {DEFAULT_K}")
    codes, from_corpus = premise_codes(meta, premises)
    states = probe_states(meta)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        source = EncoderSource(index, meta, str(model), "cpu", matches=not warnings, warnings=warnings)
        with ct2_conversion(source) as (converted, width):
            if width != rows.shape[1]:
                raise PremiseIndexError(f"{index}: embeddings are {rows.shape[1]} wide, the model {model} gives "
                                        f"{width}; rebuild the index")
            _write_encoder(converted, work / ENCODER.folder, meta)
        matrix = leancopilot_rows(rows)
        _write_premises(work / PREMISES.folder, matrix, premises, codes)
        best_rank = check_export(work, matrix, premises, states)
        write_export_id(work)
        for folder in LEANCOPILOT_FOLDERS:
            if not make_git_ready(work / folder.folder):
                warnings.append("git was not found: LeanCopilot runs git in its premise folder, so make each folder "
                                "a git repository as README.md says before using it")
                break
        cut = int(meta.get("context_max_len") or CONTEXT_MAX_LEN)
        (work / "README.md").write_text(readme(index, meta, stage, len(premises), rows.shape[1], cut),
                                        encoding="utf-8")
        _move_into(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    done = LeanCopilotExport(out, len(premises), int(rows.shape[1]), from_corpus, len(states), best_rank, warnings)
    if do_install:
        done.moved_aside, done.installed = install(out)
    return done


def leancopilot_rows(rows: torch.Tensor) -> np.ndarray:
    """embeddings.npy's matrix: the placeholder row 0 (the centroid of the rows, module docstring), then the index's
    rows, float64, C order."""
    values = rows.to(torch.float64).numpy()
    return np.ascontiguousarray(np.concatenate([values.mean(axis=0, keepdims=True), values]))


def probe_states(meta: dict[str, Any]) -> list[str]:
    """The states LeanCopilot's retrieval is checked on: `FIXED_STATES`, then the test states of the datasets the
    index names (as LeanCopilot prints them: no `N goals` line), at most `PROBE_STATES`, evenly spaced."""
    named = meta.get("datasets") or ([meta["dataset"]] if meta.get("dataset") else [])
    tests: set[str] = set()
    for dataset in named:
        for split in TEST_SPLITS:
            if (Path(dataset) / split).is_file():
                try:
                    tests.update(load_states([Path(dataset) / split]))
                except Exception:  # a split changed or damaged since: the other states still check the export
                    continue
    ordered = sorted(tests - set(FIXED_STATES))
    if len(ordered) > PROBE_STATES:
        ordered = [ordered[i * len(ordered) // PROBE_STATES] for i in range(PROBE_STATES)]
    return [*FIXED_STATES, *ordered]


def _check_out(out: Path, force: bool) -> None:
    problem = out_folder_problem(out)
    if problem is not None:
        raise FileExistsError(problem)
    if not force:
        try:
            refuse_non_empty(out)
        except FileExistsError as exc:
            raise FileExistsError(f"{exc} (pass --force to replace an earlier export's folders there)") from None


def _move_into(work: Path, out: Path) -> None:
    """The finished folders into `out`; an earlier export's own (the two folders, README.md) are replaced, anything
    else a user keeps there stays."""
    out.mkdir(parents=True, exist_ok=True)
    for name in [f.folder for f in LEANCOPILOT_FOLDERS] + ["README.md"]:
        target = out / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        (work / name).replace(target)


def _write_encoder(converted: Path, folder: Path, meta: dict[str, Any]) -> None:
    folder.mkdir(parents=True)
    for name in MODEL_FILES:
        shutil.copyfile(converted / name, folder / name)
    provenance = {"from": "leanagent", "model_identity": meta.get("model_identity"),
                  "embeddings_sha256": meta.get("embeddings_sha256")}
    (folder / META_FILE).write_text(json.dumps(provenance, indent=2, sort_keys=True), encoding="utf-8")


def _write_premises(folder: Path, matrix: np.ndarray, premises: list[PremiseLine], codes: list[str]) -> None:
    """embeddings.npy (`leancopilot_rows`) and dictionary.json: row 0 the placeholder, row i + 1 premise i."""
    folder.mkdir(parents=True)
    np.save(folder / "embeddings.npy", matrix, allow_pickle=False)
    dictionary = {"0": PLACEHOLDER}
    dictionary.update({str(i + 1): {"full_name": p.full_name, "path": p.path, "code": code}
                       for i, (p, code) in enumerate(zip(premises, codes, strict=True))})
    (folder / "dictionary.json").write_text(json.dumps(dictionary, ensure_ascii=False, indent=1), encoding="utf-8")


def premise_codes(meta: dict[str, Any], premises: list[PremiseLine]) -> tuple[list[str], int]:
    """Each premise's code (module docstring) and how many came from a corpus."""
    named = meta.get("datasets") or ([meta["dataset"]] if meta.get("dataset") else [])
    known: dict[tuple[str, str, tuple[int, int]], str] = {}
    for dataset in named:
        corpus_file = Path(dataset) / CORPUS_FILE
        if not corpus_file.is_file():
            continue
        try:
            corpus = Corpus.from_jsonl(corpus_file)
        except Exception:  # a corpus changed since: its code is not needed, the embedded text stands in
            continue
        for p in corpus.premises:
            known.setdefault((p.path, p.full_name, tuple(p.start)), p.code)
    codes, found = [], 0
    for p in premises:
        code = known.get((p.path, p.full_name, tuple(p.start)))
        if code is not None and serialize_premise(p.full_name, code) == p.text:
            codes.append(code)
            found += 1
        else:
            codes.append(p.text.replace(f"{MARK_START}{p.full_name}{MARK_END}", p.full_name))
    return codes, found


def check_export(folder: Path, matrix: np.ndarray, premises: list[PremiseLine], states: list[str]) -> int:
    """LeanCopilot's path, before anything is written: the encoder folder loaded by CTranslate2 at its default compute
    type (LeanCopilot's `.default`: the float32 it was saved in), fed the string tokens LeanCopilot emits, must give
    the index's rows for a few premises; embeddings.npy must read, as LeanCopilot reads it, as written; and
    LeanCopilot's retrieval at its default k must return k real premises for every state. Returns the best rank the
    placeholder row took on them."""
    encoder = Ct2Encoder(folder / ENCODER.folder, "fp32")
    shortest = sorted(range(len(premises)), key=lambda r: len(premises[r].text))[:PROBE_PREMISES]
    for r in shortest:
        out = encoder.model.forward_batch([leancopilot_tokens(premises[r].text)])
        mean = torch.from_numpy(np.asarray(out.last_hidden_state, dtype=np.float32)).mean(dim=1)[0]
        row = torch.from_numpy(matrix[r + 1]).float()
        cosine = float(torch.nn.functional.cosine_similarity(mean, row, dim=0))
        if not cosine >= PROBE_MIN_COSINE:
            raise PremiseIndexError(f"{folder / ENCODER.folder}: premise {premises[r].full_name} encodes to cosine "
                                    f"{cosine:.4f} with its index row: the conversion does not give the index's "
                                    f"embeddings; nothing was exported")
    npy = folder / PREMISES.folder / "embeddings.npy"
    try:
        back = read_leancopilot_npy(npy)
    except LeanCopilotCrash as exc:
        raise PremiseIndexError(f"{exc}; nothing was exported") from None
    if back.shape != matrix.shape or not np.array_equal(back, matrix):
        raise PremiseIndexError(f"{npy}: does not read back as written; nothing was exported")
    del back  # LeanCopilot's own reading, next, holds its float32 copy
    leancopilot = LeanCopilotRetrieval(folder)
    best = len(matrix)
    for state in states:
        scores = leancopilot.scores(state)
        rank = placeholder_rank(scores)
        if rank <= DEFAULT_K:
            raise PremiseIndexError(
                f"LeanCopilot would abort Lean on the state {state!r}: the placeholder row 0 ranks {rank} of "
                f"{len(matrix)} there, among the {DEFAULT_K} it returns (fewer than {DEFAULT_K} premises score above "
                f"their mean), and its C++ asserts the index is above 0; nothing was exported")
        try:
            leancopilot.answer(scores, DEFAULT_K, state)
        except LeanCopilotCrash as exc:
            raise PremiseIndexError(f"LeanCopilot would crash: {exc}; nothing was exported") from None
        best = min(best, rank)
    return best
