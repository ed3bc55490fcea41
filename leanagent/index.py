"""A premise index: a dataset's corpus embedded once, queried many times by a prover.

`build_index` embeds the corpus with the retriever's own sorted, token-budget `embed_corpus` and writes
an INDEX folder:

- `embeddings.safetensors`: one bf16 row per premise, in corpus order (tensor `embeddings`);
- `premises.jsonl`: per premise its path, full_name, start, end, kind and the serialized text the
  retriever encoded, line k for row k;
- `files.jsonl`: per corpus file its direct imports, its premises' row range and the last line a
  premise of it reaches: what accessibility needs, in the corpus's own terms, so the import closure
  is computed by the same `Corpus` code evaluation uses (exactly the same premises count);
- `index.json`, written last (a folder without it is an unfinished index): the model and its identity
  (path, and per weights file its size, modification time and SHA-256; `leanagent.model_identity`),
  the dataset, the embedding width and count, and the lengths states and premises are cut at.

`PremiseIndex.load` reads it, refuses it when the model is no longer the one that embedded the corpus
(a retrained `last.ckpt` at the same path would otherwise answer with stale embeddings), and loads the
encoder once; `PremiseIndex.retrieve` then formats a proof state as training did, encodes it and ranks
premises with `top_k_accessible`, restricted to those accessible at a file and line when given: the
premises of the files it imports (transitively) and those of the same file ending at or before that
position. Any line from 1 on is a position: past a file's last premise, all of its premises count.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from leanagent import model_identity
from leanagent.atomic import refuse_non_empty, write_atomic, write_bytes_atomic
from leanagent.config import DataConfig
from leanagent.data.corpus import Corpus, FileRecord, Premise
from leanagent.data.dataset import tokenize_texts
from leanagent.data.theorems import strip_goal_count
from leanagent.model.dtypes import DtypeError, apply_dtype, precision, resolve
from leanagent.model.loading import ModelSourceError, load_model
from leanagent.model.topk import top_k_accessible

INDEX_FILE = "index.json"
EMBEDDINGS_FILE = "embeddings.safetensors"
PREMISES_FILE = "premises.jsonl"
FILES_FILE = "files.jsonl"
INDEX_FILES = (INDEX_FILE, EMBEDDINGS_FILE, PREMISES_FILE, FILES_FILE)
FORMAT_VERSION = 1
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
    from safetensors.torch import save


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
        embeddings = retriever.embed_corpus(corpus, batch_tokens).to(torch.bfloat16).cpu().contiguous()
    seconds = time.perf_counter() - start
    _clear_out(out)  # only now: a model or corpus that fails to load leaves an earlier index as it was
    blob = save({"embeddings": embeddings}, metadata={"format": str(FORMAT_VERSION)})
    write_bytes_atomic(out / EMBEDDINGS_FILE, blob)
    write_atomic(out / PREMISES_FILE, lambda f: _write_premises(f, corpus))
    write_atomic(out / FILES_FILE, lambda f: _write_files(f, corpus))
    meta = {
        "format": FORMAT_VERSION,
        "checkpoint": str(loaded.checkpoint) if loaded.checkpoint else None,
        "model": str(loaded.model_dir) if loaded.model_dir else None,
        "model_identity": identity,
        "base_model": base_model,  # the architecture of a LeanAgent/ReProver checkpoint, if given
        "dataset": str(dataset.resolve()),
        "corpus": str(corpus_file.resolve()),
        "num_premises": int(embeddings.shape[0]),
        "num_files": len(corpus.paths),
        "embedding_dim": int(embeddings.shape[1]),
        "dtype": "bfloat16",
        "max_seq_len": max_len,
        "context_max_len": context_max_len,
        "model_metrics": loaded.metrics,
        "embed_seconds": round(seconds, 3),
        "device": device,
        "embedded_at": dtype,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_atomic(out / INDEX_FILE, lambda f: json.dump(meta, f, indent=2, sort_keys=True))
    return meta


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

    @classmethod
    def load(cls, folder: str | Path, device: str = "cpu", model: str | Path | None = None,
             force: bool = False, dtype: str = "auto") -> PremiseIndex:
        """Load an index and its encoder. `model` (a checkpoint or HF folder) replaces the one index.json names,
        e.g. after moving both to another machine. Either way the model must hold the weights the corpus was
        embedded with; otherwise this refuses in one line naming both, unless `force` (then `warnings` says so).
        `dtype`: the precision states and new premises are encoded at (`leanagent.model.dtypes`), whatever the
        index was embedded at."""
        from safetensors.torch import load_file


        folder = Path(folder)
        meta = _read_meta(folder)
        named = meta.get("checkpoint") or meta.get("model")
        if not named and model is None:
            raise PremiseIndexError(f"{folder / INDEX_FILE}: names no checkpoint or model")
        model = str(model) if model is not None else named
        warnings = _check_model(folder, meta, Path(model), force)
        try:
            embeddings = load_file(str(folder / EMBEDDINGS_FILE))["embeddings"]
        except Exception as exc:  # safetensors raises its own SafetensorError; a wrong file, KeyError
            raise PremiseIndexError(f"{folder / EMBEDDINGS_FILE}: not a readable index embedding "
                                    f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
        premises = _read_jsonl(folder / PREMISES_FILE)
        files = {r["path"]: _FileInfo(list(r["imports"]), (int(r["premises"][0]), int(r["premises"][1])),
                                      r.get("last_line")) for r in _read_jsonl(folder / FILES_FILE)}
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
        index.dtype = _set_dtype(loaded.retriever, dtype)
        return index

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
        meta = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PremiseIndexError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise PremiseIndexError(f"{file}: not a format-{FORMAT_VERSION} leanagent index")
    return meta


def _read_jsonl(file: Path) -> list[dict[str, Any]]:
    try:
        with open(file, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        raise PremiseIndexError(f"{file}: missing from the index; rebuild it") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise PremiseIndexError(f"{file}: unreadable ({exc})") from None


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
