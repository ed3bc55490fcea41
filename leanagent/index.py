"""A premise index: a dataset's corpus embedded once, queried many times by a prover.

`build_index` embeds the corpus with the retriever's own sorted, token-budget `embed_corpus` and writes
an INDEX folder:

- `embeddings.safetensors`: one bf16 row per premise, in corpus order (tensor `embeddings`);
- `premises.jsonl`: per premise its path, full_name, start, end, kind and the serialized text the
  retriever encoded, line k for row k;
- `files.jsonl`: per corpus file its direct imports, its premises' row range and the last line a
  premise of it reaches: what accessibility needs, in the corpus's own terms, so the import closure
  is computed by the same `Corpus` code evaluation uses (exactly the same premises count);
- `names.json`: the premise names (as Lean writes them) and the module names a server lists, each once, in the
  order a client caches them; an index written after another (the next stage of a lifelong run) keeps the other's
  lists as they were and appends its new names, so a client's cached positions keep their meaning;
- `index.json`, written last (a folder without it is an unfinished index): the model and its identity
  (path, and per weights file its size, modification time and SHA-256; `leanagent.model_identity`),
  the SHA-256 of `embeddings.safetensors`, the datasets, the embedding width and count, and the lengths states
  and premises are cut at.

`PremiseIndex.load` reads it, refuses it when the model is no longer the one that embedded the corpus
(a retrained `last.ckpt` at the same path would otherwise answer with stale embeddings), when the embeddings are
not the bytes index.json names (a flipped byte, another index's file), not finite or not unit length, or not what
the model gives for a few of the premises, and every file it cannot read, in one line naming the file (and line)
and the problem; then it loads the encoder once. `PremiseIndex.retrieve` formats a proof state as training did,
encodes it and ranks premises with `top_k_accessible`, restricted to those accessible at a file and line when
given: the premises of the files it imports (transitively) and those of the same file ending at or before that
position. Any line from 1 on is a position: past a file's last premise, all of its premises count.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError

from leanagent import model_identity
from leanagent.atomic import refuse_non_empty, write_atomic, write_bytes_atomic
from leanagent.config import DataConfig, format_validation_error
from leanagent.data.corpus import Corpus, FileRecord, Premise
from leanagent.data.dataset import tokenize_texts
from leanagent.data.lean_names import lean_name, module_name
from leanagent.data.premise_table import PremiseTable, newest_union
from leanagent.data.theorems import strip_goal_count
from leanagent.model.dtypes import DtypeError, apply_dtype, precision, resolve
from leanagent.model.loading import ModelSourceError, load_model
from leanagent.model.topk import top_k_accessible

INDEX_FILE = "index.json"
EMBEDDINGS_FILE = "embeddings.safetensors"
PREMISES_FILE = "premises.jsonl"
FILES_FILE = "files.jsonl"
NAMES_FILE = "names.json"
INDEX_FILES = (INDEX_FILE, EMBEDDINGS_FILE, PREMISES_FILE, FILES_FILE, NAMES_FILE)
# 2: index.json records the embeddings' SHA-256, and names.json the served lists; format 1 indexes still load.
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
NORM_TOLERANCE = 0.05  # a stored row is a unit vector rounded to bf16
PROBE_PREMISES = 4  # re-embedded at load: the model must give what the index holds
PROBE_MIN_COSINE = 0.95
# data.max_seq_len's default: states are cut there in training and evaluation
CONTEXT_MAX_LEN: int = DataConfig.model_fields["max_seq_len"].default


FILE_WITHOUT_LINE = "--file and --line go together: accessibility is a position in a file"


class PremiseIndexError(ValueError):
    """An index, a query or its arguments that cannot be used; the message is one line naming what is wrong."""


# ---- building ---------------------------------------------------------------------------------

def build_index(model: str | Path, dataset: str | Path, out: str | Path, device: str = "cpu",
                batch_tokens: int | None = None, force: bool = False,
                context_max_len: int = CONTEXT_MAX_LEN, base_model: str | None = None,
                dtype: str = "auto") -> dict[str, Any]:
    """Embed `dataset`'s corpus with `model` (a .ckpt or an HF folder) into the INDEX folder `out`; its index.json.

    `batch_tokens` is the padded-token budget of one embedding batch (default: the model's
    eval_batch_size x max_seq_len, as at evaluation); it is rounded down to whole premises of max_seq_len.
    `dtype`: the encoder's precision (`leanagent.model.dtypes`); the rows are stored in bf16 whatever it is.
    """
    dataset, out = Path(dataset), Path(out)
    corpus_file = dataset / "corpus.jsonl"
    if not corpus_file.is_file():
        raise PremiseIndexError(f"--dataset {dataset}: no corpus.jsonl in it")
    _check_out(out, force)
    identity = model_identity.identify(model)  # before loading: the bytes the embeddings come from
    loaded = load_model(model, device, base_model=base_model)
    retriever = loaded.retriever
    dtype = _set_dtype(retriever, dtype)
    max_len = retriever.options.max_seq_len
    if batch_tokens is not None:
        if batch_tokens < max_len:
            raise PremiseIndexError(f"--batch-tokens {batch_tokens}: below the model's premise length {max_len}")
        batch_tokens = batch_tokens // max_len * max_len
    corpus = Corpus.from_jsonl(corpus_file)
    start = time.perf_counter()
    with torch.inference_mode(), precision(dtype, retriever.device):
        embeddings = retriever.embed_corpus(corpus, batch_tokens)
    seconds = time.perf_counter() - start
    meta = {
        "checkpoint": str(loaded.checkpoint) if loaded.checkpoint else None,
        "model": str(loaded.model_dir) if loaded.model_dir else None,
        "model_identity": identity,
        "base_model": base_model,  # the architecture of a LeanAgent/ReProver checkpoint, if given
        "dataset": str(dataset.resolve()),
        "corpus": str(corpus_file.resolve()),
        "max_seq_len": max_len,
        "context_max_len": context_max_len,
        "model_metrics": loaded.metrics,
        "embed_seconds": round(seconds, 3),
        "device": device,
        "embedded_at": dtype,
    }
    # Only now: a model or corpus that fails to load leaves an earlier index as it was.
    return write_index(out, corpus, embeddings, meta)


def served_names(corpus: Corpus, before: dict[str, list[str]] | None = None) -> dict[str, list[str]]:
    """The premise names and module names a server lists for `corpus`, each once: `before`'s lists as they are
    (names no longer indexed stay, with no premise), then this corpus's new names in corpus order."""
    lists = {"premises": [lean_name(p.full_name) for p in corpus.premises],
             "modules": [module_name(path) for path in corpus.paths]}
    out = {}
    for key, names in lists.items():
        kept = list((before or {}).get(key) or [])
        out[key] = list(dict.fromkeys([*kept, *names]))
    return out


def write_index(out: Path, corpus: Corpus, embeddings: torch.Tensor, meta: dict[str, Any],
                names_before: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """Write an INDEX folder of `corpus` and its `embeddings` (one row per premise, in corpus order): the files,
    then index.json (`meta` and what this adds: the format, the counts, the embeddings' SHA-256) last, so that a
    folder without index.json reads as unfinished. An earlier index's files there are replaced; anything else kept.
    `names_before`: the lists of the index this one follows (`served_names`). Returns index.json's content."""
    from safetensors.torch import save

    out = Path(out)
    rows = embeddings.to(torch.bfloat16).cpu().contiguous()
    if rows.shape[0] != len(corpus):
        raise ValueError(f"{len(rows)} embeddings for {len(corpus)} premises")
    blob = save({"embeddings": rows}, metadata={"format": str(FORMAT_VERSION)})
    _clear_out(out)
    write_bytes_atomic(out / EMBEDDINGS_FILE, blob)
    write_atomic(out / PREMISES_FILE, lambda f: _write_premises(f, corpus))
    write_atomic(out / FILES_FILE, lambda f: _write_files(f, corpus))
    names = served_names(corpus, names_before)
    write_atomic(out / NAMES_FILE, lambda f: json.dump(names, f, ensure_ascii=False))
    meta = {**meta, "format": FORMAT_VERSION, "embeddings_sha256": hashlib.sha256(blob).hexdigest(),
            "num_premises": int(rows.shape[0]), "num_files": len(corpus.paths), "embedding_dim": int(rows.shape[1]),
            "dtype": "bfloat16", "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_atomic(out / INDEX_FILE, lambda f: json.dump(meta, f, indent=2, sort_keys=True))
    return meta


class StageIndex:
    """A premise index over several datasets' corpora, as a lifelong run's stage serves them: each file at the
    version of the last dataset that carries it (`newest_union`), embedded in a job's premise table (the table an
    evaluation job embeds for its tests, with these premises added: each premise embedded once)."""

    def __init__(self, datasets: Sequence[Path], known: Sequence[Corpus] = ()) -> None:
        """`known`: corpora already loaded (an evaluation's datasets'), reused for the datasets that are theirs."""
        loaded = {c.source: c for c in known if c.source is not None}
        self.corpora = [loaded.get((Path(d) / "corpus.jsonl").resolve()) or Corpus.from_jsonl(Path(d) / "corpus.jsonl")
                        for d in datasets]
        self.corpus, self.source_corpus, self.source_index = newest_union(self.corpora)
        self._table: PremiseTable | None = None

    def served(self) -> list[tuple[Corpus, np.ndarray]]:
        """Per corpus, the mask of its premises the index holds."""
        out = []
        for k, corpus in enumerate(self.corpora):
            mask = np.zeros(len(corpus), dtype=bool)
            mask[self.source_index[self.source_corpus == k]] = True
            out.append((corpus, mask))
        return out

    def table(self) -> PremiseTable:
        """A table of the served premises alone (when the tests embed their own)."""
        if self._table is None:
            self._table = PremiseTable(self.corpora, [mask for _, mask in self.served()])
        return self._table

    def write(self, out: Path, embedding: torch.Tensor, table: PremiseTable, meta: dict[str, Any],
              names_before: dict[str, list[str]] | None = None) -> dict[str, Any]:
        """The served premises' rows of `table`'s `embedding`, written as an INDEX folder (`write_index`)."""
        number = {id(c): k for k, c in enumerate(table.corpora)}
        rows = np.empty(len(self.corpus), dtype=np.int64)
        for k, corpus in enumerate(self.corpora):
            chosen = self.source_corpus == k
            rows[chosen] = table.row_of(number[id(corpus)])[self.source_index[chosen]]
        if (rows < 0).any():
            raise ValueError("a served premise has no row in the table")
        datasets = {"datasets": [str(c.source.parent) for c in self.corpora if c.source is not None]}
        return write_index(out, self.corpus, embedding[torch.from_numpy(rows).to(embedding.device)],
                           {**meta, **datasets}, names_before)


def read_names(folder: Path) -> dict[str, list[str]] | None:
    """An index's served lists (None for an index without names.json, or no index)."""
    try:
        names = json.loads((Path(folder) / NAMES_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = isinstance(names, dict) and all(isinstance(names.get(k), list) and all(isinstance(n, str) for n in names[k])
                                         for k in ("premises", "modules"))
    return names if ok else None


def _set_dtype(retriever: Any, dtype: str) -> str:
    try:
        return apply_dtype(retriever, dtype)
    except DtypeError as exc:
        raise PremiseIndexError(str(exc)) from None


def _check_out(out: Path, force: bool) -> None:
    """A non-empty folder is refused unless `force`, before any time is spent embedding."""
    if out.exists() and not out.is_dir():
        raise PremiseIndexError(f"--out {out}: exists and is not a folder; nothing was overwritten")
    if not force:
        try:
            refuse_non_empty(out)
        except FileExistsError as exc:
            raise PremiseIndexError(f"--out {exc} (pass --force to replace an index there)") from None


def _clear_out(out: Path) -> None:
    """With --force only an earlier index's own files go (index.json first: the folder reads as unfinished
    until the new one is written); anything else a user keeps there stays."""
    out.mkdir(parents=True, exist_ok=True)
    for name in INDEX_FILES:
        (out / name).unlink(missing_ok=True)


def _write_premises(f, corpus: Corpus) -> None:
    for p in corpus.premises:
        f.write(json.dumps({"path": p.path, "full_name": p.full_name, "start": list(p.start), "end": list(p.end),
                            "kind": p.kind, "text": p.text}, ensure_ascii=False) + "\n")


def _write_files(f, corpus: Corpus) -> None:
    for path in corpus.paths:
        rows = corpus.file_range(path)
        last = max((corpus.premises[i].end[0] for i in rows), default=None)
        f.write(json.dumps({"path": path, "imports": corpus.imports[path], "premises": [rows.start, rows.stop],
                            "last_line": last}, ensure_ascii=False) + "\n")


# ---- loading and querying ---------------------------------------------------------------------

@dataclass(frozen=True)
class Hit:
    """One retrieved premise: its rank (1 = best), cosine score and where it is declared."""

    rank: int
    score: float
    index: int
    full_name: str
    path: str
    start: tuple[int, int]
    end: tuple[int, int]
    text: str

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["start"], out["end"] = list(self.start), list(self.end)
        return out


@dataclass(frozen=True)
class _FileInfo:
    imports: list[str]
    rows: tuple[int, int]
    last_line: int | None


class PremiseIndex:
    """A loaded index and its encoder: load once, query many times (each query is one encoder pass)."""

    def __init__(self, folder: Path, meta: dict[str, Any], embeddings: torch.Tensor, premises: list[dict[str, Any]],
                 files: dict[str, _FileInfo], retriever: Any, warnings: list[str] | None = None) -> None:
        self.folder = folder
        self.meta = meta
        self.embeddings = embeddings
        self.premises = premises
        self.files = files
        self.retriever = retriever
        self.device = retriever.device
        self.corpus = _accessibility_corpus(premises, files)
        # What `load` let through with `force` (a changed model) or could not check: for the caller to show.
        self.warnings: list[str] = list(warnings or [])
        self.dtype = resolve("auto", self.device)  # what `load` then resolves `--dtype` to
        # Where states and premise texts are cut, as the corpus was embedded (a state as evaluation cuts contexts).
        self.state_max_len = int(meta.get("context_max_len", CONTEXT_MAX_LEN))
        self.premise_max_len = int(meta["max_seq_len"])
        # The lists a server gives (`names.json`; None: built from the premises and files, as before it existed).
        self.names: dict[str, list[str]] | None = None

    @classmethod
    def load(cls, folder: str | Path, device: str = "cpu", model: str | Path | None = None,
             force: bool = False, dtype: str = "auto") -> PremiseIndex:
        """Load an index and its encoder. `model` (a checkpoint or HF folder) replaces the one index.json names,
        e.g. after moving both to another machine. Either way the model must hold the weights the corpus was
        embedded with; otherwise this refuses in one line naming both, unless `force` (then `warnings` says so).
        `dtype`: the precision states and new premises are encoded at (`leanagent.model.dtypes`), whatever the
        index was embedded at. Every file is checked as it is read (module docstring); a problem is one line."""
        folder = Path(folder)
        meta = _read_meta(folder)
        named = meta.get("checkpoint") or meta.get("model")
        if not named and model is None:
            raise PremiseIndexError(f"{folder / INDEX_FILE}: names no checkpoint or model")
        model = str(model) if model is not None else named
        warnings = _check_model(folder, meta, Path(model), force)
        embeddings = _read_embeddings(folder, meta, warnings)
        premises = [line.model_dump() for line in _read_jsonl(folder / PREMISES_FILE, _PremiseLine)]
        files = {r.path: _FileInfo(list(r.imports), (r.premises[0], r.premises[1]), r.last_line)
                 for r in _read_jsonl(folder / FILES_FILE, _FileLine)}
        if embeddings.shape[0] != len(premises) or len(premises) != meta.get("num_premises"):
            raise PremiseIndexError(f"{folder}: {embeddings.shape[0]} embeddings, {len(premises)} premises and "
                                    f"num_premises {meta.get('num_premises')} disagree; rebuild the index")
        try:
            loaded = load_model(model, device, base_model=meta.get("base_model"))
        except (ModelSourceError, FileNotFoundError, ValueError) as exc:
            raise PremiseIndexError(f"{folder / INDEX_FILE}: its model cannot be loaded: {exc}") from None
        width = loaded.retriever.encoder.config.d_model
        if width != embeddings.shape[1]:
            raise PremiseIndexError(f"{folder}: embeddings are {embeddings.shape[1]} wide, the model {model} gives "
                                    f"{width}; rebuild the index")
        # bf16 on disk; on a GPU the product runs in bf16, on a CPU in float32 (exact products of the stored
        # values; one state against 76k premises took 32 ms there against 12.8 ms in bf16 on an AVX-512-BF16 CPU).
        embeddings = embeddings.to(loaded.retriever.device,
                                   torch.bfloat16 if loaded.retriever.device.type == "cuda" else torch.float32)
        index = cls(folder, meta, embeddings, premises, files, loaded.retriever, warnings)
        if not force:  # before --dtype changes the model (int8 quantizes it): the weights as they embedded
            index.check_probe()
        index.dtype = _set_dtype(loaded.retriever, dtype)
        index.names = read_names(folder)
        return index

    def check_probe(self, count: int = PROBE_PREMISES) -> None:
        """Re-embed the index's `count` shortest premises and a state with its model: finite, and the premises close
        to their stored rows, or the index's embeddings are not this model's (another model's, a corrupt model)."""
        state = self.encode_state("⊢ True")
        if not torch.isfinite(state).all():
            raise PremiseIndexError(f"{self.folder}: its model gives a non-finite embedding; its weights are "
                                    f"damaged")
        if not self.premises:
            return
        rows = sorted(range(len(self.premises)), key=lambda r: len(self.premises[r]["text"]))[:count]
        fresh = self.encode_premises([self.premises[r]["text"] for r in rows]).float()
        stored = self.embeddings[torch.tensor(rows, device=self.device)].float()
        cosine = torch.nn.functional.cosine_similarity(fresh, stored, dim=1)
        if not torch.isfinite(cosine).all() or float(cosine.min()) < PROBE_MIN_COSINE:
            worst = int(cosine.nan_to_num(-2.0).argmin())
            raise PremiseIndexError(
                f"{self.folder / EMBEDDINGS_FILE}: premise {self.premises[rows[worst]]['full_name']} is stored with "
                f"an embedding its model does not give (cosine {float(cosine[worst]):.3f}); these embeddings come "
                f"from another model: rebuild the index")

    def __len__(self) -> int:
        return len(self.premises)

    # -- accessibility --
    def resolve_file(self, file: str) -> str:
        """The corpus path of `file` (exact, or a unique suffix such as Mathlib/X.lean of a lake package's path)."""
        resolved = self.corpus.resolve_path(file[2:] if file.startswith("./") else file)
        if resolved is None:
            raise PremiseIndexError(f"--file {file}: not a file of the indexed corpus ({self.meta.get('corpus')})")
        return resolved

    def accessible_mask(self, file: str, line: int, column: int = 0) -> torch.Tensor:
        """Premises accessible at (line, column) of `file`, exactly as at evaluation (`Corpus.accessible_mask`):
        those of the files it imports, transitively, and those of `file` ending at or before that position.

        Any line from 1 on is a position: a theorem being written after a file's last indexed premise (the main
        use of a retriever) sees all of that file's premises. Only a line below 1 names no position."""
        path = self.resolve_file(file)
        if line < 1:
            raise PremiseIndexError(f"--line {line}: lines start at 1")
        return self.corpus.accessible_mask(path, (line, column))

    # -- querying --
    @torch.inference_mode()
    def encode_state(self, state: str) -> torch.Tensor:
        """A proof state's embedding, the state formatted as training and evaluation format it."""

        ids, mask = tokenize_texts(self.retriever.tokenizer, [strip_goal_count(state)], self.state_max_len)
        with precision(self.dtype, self.device):
            return self.retriever.encode(ids.to(self.device), mask.to(self.device))

    @torch.inference_mode()
    def encode_premises(self, texts: list[str], batch_size: int = 32) -> torch.Tensor:
        """Embeddings of premise texts (serialized as the corpus's, name tagged), cut at the index's premise length,
        in length-sorted batches, and rounded to bf16 as the stored rows were: ranked together with those rows,
        a text equal to an indexed premise's scores as that premise does (up to the rounding of padded batches)."""
        out = torch.empty(len(texts), self.embeddings.shape[1], dtype=self.embeddings.dtype, device=self.device)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        for lo in range(0, len(order), batch_size):
            rows = order[lo:lo + batch_size]
            ids, mask = tokenize_texts(self.retriever.tokenizer, [texts[i] for i in rows], self.premise_max_len)
            with precision(self.dtype, self.device):
                emb = self.retriever.encode(ids.to(self.device), mask.to(self.device))
            out[torch.tensor(rows, device=self.device)] = self._as_stored(emb)
        return out

    @torch.inference_mode()
    def encode_together(self, states: list[str], texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """States (as `encode_state` formats and cuts them) and premise texts (as `encode_premises` cuts and
        rounds them) in one encoder pass: sorted by length into token-budget sub-batches, each padded to its own
        longest, so 32 states cost about one pass of their total length, not 32 passes. Padding is masked: each
        row is its own pass's up to float rounding."""
        tokenizer = self.retriever.tokenizer
        parts = [tokenize_texts(tokenizer, [strip_goal_count(s) for s in states], self.state_max_len)]
        if texts:
            parts.append(tokenize_texts(tokenizer, texts, self.premise_max_len))
        width = max(ids.shape[1] for ids, _ in parts)
        ids = torch.cat([torch.nn.functional.pad(i, (0, width - i.shape[1])) for i, _ in parts])
        mask = torch.cat([torch.nn.functional.pad(m, (0, width - m.shape[1])) for _, m in parts])
        with precision(self.dtype, self.device):
            emb, _ = self.retriever.encode_pool(ids.to(self.device), mask.to(self.device),
                                                mask.sum(dim=1).tolist(), sort=True)
        return emb[:len(states)], self._as_stored(emb[len(states):])

    def _as_stored(self, emb: torch.Tensor) -> torch.Tensor:
        """New premises' embeddings rounded to bf16 as the stored rows were, in the rows' dtype: ranked with them."""
        return emb.to(torch.bfloat16).to(self.embeddings.dtype)

    def retrieve(self, state: str, k: int = 10, file: str | None = None, line: int | None = None,
                 column: int = 0) -> list[Hit]:
        """The k best premises for `state`, best first; only those accessible at `file`:`line` when given."""

        if k < 1:
            raise PremiseIndexError(f"-k {k}: must be at least 1")
        if (file is None) != (line is None):
            raise PremiseIndexError(FILE_WITHOUT_LINE)
        if file is not None:
            mask = self.accessible_mask(file, int(line), column)  # type: ignore[arg-type]
        else:
            mask = torch.ones(len(self.premises), dtype=torch.bool)
        scores, rows = top_k_accessible(self.encode_state(state), self.embeddings, mask[None], k)
        hits = []
        for score, row in zip(scores[0].tolist(), rows[0].tolist(), strict=True):
            if score == float("-inf"):
                break  # fewer accessible premises than k
            p = self.premises[row]
            hits.append(Hit(len(hits) + 1, float(score), row, p["full_name"], p["path"], tuple(p["start"]),
                            tuple(p["end"]), p["text"]))
        return hits


def _check_model(folder: Path, meta: dict[str, Any], model: Path, force: bool) -> list[str]:
    """Refuse (or, with `force`, warn about) a model that is not the one the corpus was embedded with."""
    recorded = meta.get("model_identity")
    if not isinstance(recorded, dict):
        return [f"{folder / INDEX_FILE}: records no model identity (built before leanagent recorded one), so a "
                f"changed model cannot be detected; rebuild it with `leanagent index` to have that checked"]
    now = model_identity.mismatch(recorded, model)
    if now is None:
        return []
    problem = (f"{folder}: its corpus was embedded with {model_identity.describe(recorded)}, but the model is now "
               f"{now}; its embeddings would be stale")
    if not force:
        raise PremiseIndexError(f"{problem}. Rebuild it with `leanagent index`, or pass --force to use it anyway")
    return [f"{problem}; used anyway (--force)"]


def _accessibility_corpus(premises: list[dict[str, Any]], files: dict[str, _FileInfo]) -> Corpus:
    """A `Corpus` with the index's files, imports and premise positions (no code): its import closure and
    in-file cut-off are the ones evaluation computes, so accessibility cannot drift from evaluation's."""
    records = []
    for path, info in files.items():
        lo, hi = info.rows
        records.append(FileRecord(path, info.imports, [
            Premise(p["full_name"], path, "", tuple(p["start"]), tuple(p["end"]), p.get("kind"))
            for p in premises[lo:hi]]))
    corpus = Corpus(records)
    if len(corpus) != len(premises):
        raise PremiseIndexError(f"{FILES_FILE}: its premise ranges cover {len(corpus)} of {len(premises)} premises; "
                                f"rebuild the index")
    return corpus


def _read_meta(folder: Path) -> dict[str, Any]:
    file = folder / INDEX_FILE
    if not folder.is_dir():
        raise PremiseIndexError(f"{folder}: no such index folder (build one with `leanagent index`)")
    if not file.is_file():
        raise PremiseIndexError(f"{folder}: not a finished index (no {INDEX_FILE}); build it with `leanagent index`")
    try:
        meta = json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise PremiseIndexError(f"{file}: not UTF-8 (byte {exc.start})") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise PremiseIndexError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") not in READABLE_FORMATS:
        raise PremiseIndexError(f"{file}: not a format-{FORMAT_VERSION} leanagent index")
    missing = [key for key in ("num_premises", "max_seq_len") if not isinstance(meta.get(key), int)]
    if missing:
        raise PremiseIndexError(f"{file}: {', '.join(missing)} missing or not an integer; rebuild the index")
    return meta


def _read_embeddings(folder: Path, meta: dict[str, Any], warnings: list[str]) -> torch.Tensor:
    """The embeddings, after their bytes are checked against index.json's SHA-256, each row finite and of unit
    length."""
    from safetensors.torch import load

    file = folder / EMBEDDINGS_FILE
    try:
        blob = file.read_bytes()
    except OSError as exc:
        raise PremiseIndexError(f"{file}: cannot be read ({exc.strerror or exc}); rebuild the index") from None
    recorded = meta.get("embeddings_sha256")
    if recorded is None:
        warnings.append(f"{folder / INDEX_FILE}: records no digest of its embeddings (written before leanagent "
                        f"recorded one), so a changed file cannot be detected; rebuild it with `leanagent index`")
    elif hashlib.sha256(blob).hexdigest() != recorded:
        raise PremiseIndexError(f"{file}: its bytes are not those index.json records (SHA-256 "
                                f"{hashlib.sha256(blob).hexdigest()[:12]}, recorded {str(recorded)[:12]}): changed or "
                                f"damaged since the index was written; rebuild the index")
    try:
        embeddings = load(blob)["embeddings"]
    except Exception as exc:  # safetensors raises its own SafetensorError; a wrong file, KeyError
        raise PremiseIndexError(f"{file}: not a readable index embedding "
                                f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    if embeddings.dim() != 2:
        raise PremiseIndexError(f"{file}: embeddings of shape {tuple(embeddings.shape)}, not rows; rebuild the index")
    values = embeddings.float()
    bad = (~torch.isfinite(values).all(dim=1)).nonzero().flatten()
    if len(bad):
        raise PremiseIndexError(f"{file}: row {int(bad[0])} (and {len(bad) - 1} more) is not finite; rebuild the "
                                f"index")
    norms = values.norm(dim=1)
    off = ((norms - 1).abs() > NORM_TOLERANCE).nonzero().flatten()
    if len(off):
        raise PremiseIndexError(f"{file}: row {int(off[0])} has length {float(norms[off[0]]):.3f}, not 1 (and "
                                f"{len(off) - 1} more): not an index's unit embeddings; rebuild the index")
    return embeddings


class _PremiseLine(BaseModel):
    model_config = ConfigDict(extra="ignore")

    full_name: StrictStr
    path: StrictStr
    start: tuple[StrictInt, StrictInt]
    end: tuple[StrictInt, StrictInt]
    kind: StrictStr | None = None
    text: StrictStr


class _FileLine(BaseModel):
    model_config = ConfigDict(extra="ignore")

    path: StrictStr
    imports: list[StrictStr]
    premises: tuple[StrictInt, StrictInt]
    last_line: StrictInt | None = None


def _read_jsonl(file: Path, model: type[BaseModel]) -> list[Any]:
    """Each line of `file` as `model`; the first line that is not one refused as `file:line: problem`."""
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise PremiseIndexError(f"{file}: missing from the index; rebuild it") from None
    except OSError as exc:
        raise PremiseIndexError(f"{file}: cannot be read ({exc.strerror or exc}); rebuild the index") from None
    out = []
    for lineno, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            out.append(model.model_validate(json.loads(raw.decode("utf-8"))))
        except UnicodeDecodeError as exc:
            raise PremiseIndexError(f"{file}:{lineno}: not UTF-8 (byte {exc.start} of the line); rebuild the "
                                    f"index") from None
        except json.JSONDecodeError as exc:
            raise PremiseIndexError(f"{file}:{lineno}: not valid JSON ({exc.msg}); rebuild the index") from None
        except ValidationError as exc:
            raise PremiseIndexError(f"{file}:{lineno}: {format_validation_error(exc)}; rebuild the index") from None
    return out


# ---- the prover's entry point -----------------------------------------------------------------

_LOADED: dict[tuple[str, str], PremiseIndex] = {}
_LOCK = threading.Lock()


def retrieve(index: str | Path | PremiseIndex, state: str, k: int = 10, file: str | None = None,
             line: int | None = None, column: int = 0, device: str = "cpu") -> list[Hit]:
    """`leanagent.retrieve`: the k best premises for a proof state. A path is loaded on first use and kept,
    so calling this in a loop costs one encoder pass per call, not a model load."""
    if not isinstance(index, PremiseIndex):
        key = (str(Path(index).resolve()), device)
        with _LOCK:
            if key not in _LOADED:
                _LOADED[key] = PremiseIndex.load(index, device=device)
            index = _LOADED[key]
    return index.retrieve(state, k=k, file=file, line=line, column=column)
