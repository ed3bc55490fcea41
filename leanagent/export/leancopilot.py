"""`leanagent export SOURCE --format leancopilot OUT`: an index (a run's newest stage) as LeanCopilot's two model
folders, so that its `select_premises` tactic answers with this retriever, natively, with no server.

LeanCopilot (lean-dojo/LeanCopilot) reads, from its model cache (`leanagent.export.leancopilot_cache`):

- the encoder of `Builtin.encoder`'s URL: a CTranslate2 model folder. Written from the index's model by
  `leanagent.model.ct2` (CTranslate2's converter API), float32 weights, with the vocabulary of tokens its ByT5
  tokenizer emits; the conversion cached next to the index is reused;
- the premises of `Builtin.premisesUrl`: `embeddings.npy`, float64 `[N, d]` (its C++ reads it with
  `npy::read_npy<double>`), the index's own rows (bf16 on disk, exact in float64), and `dictionary.json`,
  `{"i": {"full_name", "path", "code"}}` for row i. No premise is embedded again.

`code` is the premise's source as its corpus holds it (LeanCopilot shows it for a premise the file does not
import), read from the datasets index.json names and checked against the text the index embedded
(`serialize_premise(full_name, code)` must give it back); where a corpus is gone or disagrees, the embedded text
with its name tags removed stands in, and the summary counts those.

Before anything is written the export is checked as LeanCopilot will use it: the converted encoder, fed the
string tokens LeanCopilot's tokenizer emits, must give the index's own rows for a few premises.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from leanagent.data.corpus import Corpus
from leanagent.data.premise_text import MARK_END, MARK_START, serialize_premise
from leanagent.export.leancopilot_cache import (
    ENCODER,
    LEANCOPILOT_FOLDERS,
    PREMISES,
    install,
    make_git_ready,
    readme,
)
from leanagent.ground.atomic import refuse_non_empty
from leanagent.ground.names import CORPUS_FILE
from leanagent.index.encoders import EncoderSource, ct2_conversion
from leanagent.index.files import INDEX_FILE, PREMISES_FILE, PremiseIndexError
from leanagent.index.read import IndexMeta, PremiseLine, check_model, read_embeddings, read_jsonl, read_meta
from leanagent.model.ct2 import META_FILE, Ct2Encoder, leancopilot_tokens

MODEL_FILES = ("model.bin", "config.json", "vocabulary.json")
PROBE_PREMISES = 4
PROBE_MIN_COSINE = 0.95  # as the index's own probe: another model, or a broken conversion, gives far less


@dataclass
class LeanCopilotExport:
    """What an export wrote and found: for the command's summary."""

    out: Path
    premises: int
    width: int
    code_from_corpus: int
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
    model = meta.named_model
    if not model:
        raise PremiseIndexError(f"{index / INDEX_FILE}: names no checkpoint or model")
    # A changed model would pair stale rows with a new encoder in LeanCopilot: refused, whatever --force says.
    warnings = check_model(index, meta, Path(model), force=False,
                           advice="Rebuild the index (`leanagent index`), then export it")
    rows = read_embeddings(index, meta, warnings)
    premises = read_jsonl(index / PREMISES_FILE, PremiseLine)
    if len(premises) != rows.shape[0]:
        raise PremiseIndexError(f"{index}: {rows.shape[0]} embeddings for {len(premises)} premises; rebuild the index")
    codes, from_corpus = premise_codes(meta, premises)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        source = EncoderSource(index, meta, str(model), "cpu", matches=not warnings, warnings=warnings)
        with ct2_conversion(source) as (converted, width):
            if width != rows.shape[1]:
                raise PremiseIndexError(f"{index}: embeddings are {rows.shape[1]} wide, the model {model} gives "
                                        f"{width}; rebuild the index")
            _write_encoder(converted, work / ENCODER.folder, meta)
        _write_premises(work / PREMISES.folder, rows, premises, codes)
        check_export(work, rows, premises)
        for folder in LEANCOPILOT_FOLDERS:
            if not make_git_ready(work / folder.folder):
                warnings.append("git was not found: LeanCopilot runs git in its premise folder, so make each folder "
                                "a git repository as README.md says before using it")
                break
        (work / "README.md").write_text(readme(index, meta, stage, len(premises), rows.shape[1]), encoding="utf-8")
        _move_into(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    done = LeanCopilotExport(out, len(premises), int(rows.shape[1]), from_corpus, warnings)
    if do_install:
        done.moved_aside, done.installed = install(out)
    return done


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a folder; nothing was overwritten")
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


def _write_encoder(converted: Path, folder: Path, meta: IndexMeta) -> None:
    folder.mkdir(parents=True)
    for name in MODEL_FILES:
        shutil.copyfile(converted / name, folder / name)
    provenance = {"from": "leanagent", "model_identity": meta.identity(), "embeddings_sha256": meta.embeddings_sha256}
    (folder / META_FILE).write_text(json.dumps(provenance, indent=2, sort_keys=True), encoding="utf-8")


def _write_premises(folder: Path, rows: torch.Tensor, premises: list[PremiseLine], codes: list[str]) -> None:
    folder.mkdir(parents=True)
    np.save(folder / "embeddings.npy", rows.to(torch.float64).numpy(), allow_pickle=False)
    dictionary = {str(i): {"full_name": p.full_name, "path": p.path, "code": code}
                  for i, (p, code) in enumerate(zip(premises, codes, strict=True))}
    (folder / "dictionary.json").write_text(json.dumps(dictionary, ensure_ascii=False, indent=1), encoding="utf-8")


def premise_codes(meta: IndexMeta, premises: list[PremiseLine]) -> tuple[list[str], int]:
    """Each premise's code (module docstring) and how many came from a corpus."""
    named = meta.datasets or ([meta.dataset] if meta.dataset else [])
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


def check_export(folder: Path, rows: torch.Tensor, premises: list[PremiseLine]) -> None:
    """LeanCopilot's path on a few premises: the encoder folder loaded by CTranslate2 at its default compute type
    (LeanCopilot's `.default`: the float32 it was saved in), the string tokens LeanCopilot emits, the mean of the
    last hidden state; each must point where the index's row does. And the files must read back as written."""
    encoder = Ct2Encoder(folder / ENCODER.folder, "fp32")
    shortest = sorted(range(len(premises)), key=lambda r: len(premises[r].text))[:PROBE_PREMISES]
    for r in shortest:
        out = encoder.model.forward_batch([leancopilot_tokens(premises[r].text)])
        mean = torch.from_numpy(np.asarray(out.last_hidden_state, dtype=np.float32)).mean(dim=1)[0]
        cosine = float(torch.nn.functional.cosine_similarity(mean, rows[r].float(), dim=0))
        if not cosine >= PROBE_MIN_COSINE:
            raise PremiseIndexError(f"{folder / ENCODER.folder}: premise {premises[r].full_name} encodes to cosine "
                                    f"{cosine:.4f} with its index row: the conversion does not give the index's "
                                    f"embeddings; nothing was exported")
    back = np.load(folder / PREMISES.folder / "embeddings.npy", allow_pickle=False)
    if back.dtype != np.float64 or back.shape != tuple(rows.shape) or not np.array_equal(back, rows.double().numpy()):
        raise PremiseIndexError(f"{folder / PREMISES.folder / 'embeddings.npy'}: does not read back as written")

