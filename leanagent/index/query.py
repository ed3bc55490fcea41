"""A loaded INDEX and its encoder: load once (`PremiseIndex.load`, every file verified by `leanagent.index.read`),
then query many times, each query one encoder pass ranked by `top_k_accessible`, restricted to the premises
accessible at a file and line when given.

The encoder is the query side's (`leanagent.index.encoders`: `--engine` torch or ct2, at a `--dtype`); the stored
rows stay what evaluation embedded, bf16 in memory as on disk. Scores are products of those rows in fp32 on a CPU
(upcast a chunk at a time: `leanagent.model.topk`, path `fp32-chunks`, no fp32 copy of the whole index), as
LeanCopilot takes them in float64, and in bf16 on a GPU; `scoring` says which.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from leanagent.data.dataset import tokenize_texts
from leanagent.data.theorems import strip_goal_count
from leanagent.index.encoders import EncoderSource, QueryEncoder, build_encoder
from leanagent.index.files import (
    CONTEXT_MAX_LEN,
    EMBEDDINGS_FILE,
    FILE_WITHOUT_LINE,
    FILES_FILE,
    INDEX_FILE,
    PREMISES_FILE,
    PremiseIndexError,
    read_names,
)
from leanagent.index.read import (
    FileInfo,
    FileLine,
    PremiseLine,
    accessibility_corpus,
    check_model,
    index_file_sizes,
    read_embeddings,
    read_jsonl,
    read_meta,
)
from leanagent.model.engines import EngineError, choose
from leanagent.model.topk import score_matrix, scoring_path, top_k_accessible

PROBE_PREMISES = 4  # re-embedded at load: the model must give what the index holds
PROBE_MIN_COSINE = 0.95


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


class PremiseIndex:
    """A loaded index and its encoder: load once, query many times (each query is one encoder pass)."""

    def __init__(self, folder: Path, meta: dict[str, Any], embeddings: torch.Tensor, premises: list[dict[str, Any]],
                 files: dict[str, FileInfo], encoder: QueryEncoder, warnings: list[str] | None = None) -> None:
        self.folder = folder
        self.meta = meta
        self.embeddings = embeddings
        self.premises = premises
        self.files = files
        self.encoder = encoder
        self.engine, self.dtype = encoder.engine, encoder.dtype
        self.device = encoder.device
        self.corpus = accessibility_corpus(premises, files)
        # What `load` let through with `force` (a changed model) or could not check: for the caller to show.
        self.warnings: list[str] = list(warnings or [])
        # How a query's product with the rows runs (`leanagent.model.topk.SCORING`): exact products of the rows.
        self.scoring = scoring_path(embeddings, exact=True)
        # Where states and premise texts are cut, as the corpus was embedded (a state as evaluation cuts contexts).
        self.state_max_len = int(meta.get("context_max_len") or CONTEXT_MAX_LEN)
        self.premise_max_len = int(meta["max_seq_len"])
        # The lists a server gives (`names.json`; None: built from the premises and files, as before it existed).
        self.names: dict[str, list[str]] | None = None

    @classmethod
    def load(cls, folder: str | Path, device: str = "cpu", model: str | Path | None = None,
             force: bool = False, dtype: str = "auto", engine: str = "auto") -> PremiseIndex:
        """Load an index and its encoder. `model` (a checkpoint or HF folder) replaces the one index.json names,
        e.g. after moving both to another machine. Either way the model must hold the weights the corpus was
        embedded with; otherwise this refuses in one line naming both, unless `force` (then `warnings` says so).
        `engine` and `dtype`: how states and new premises are encoded (`leanagent.model.engines.choose`: `auto` is
        ct2 fp32 on a CPU where CTranslate2 is installed), whatever the index was embedded with. Every file is
        checked as it is read (module docstring); a problem is one line."""
        folder = Path(folder)
        meta = read_meta(folder)
        try:
            engine, dtype = choose(engine, dtype, torch.device(device).type)
        except EngineError as exc:
            raise PremiseIndexError(str(exc)) from None
        named = meta.get("checkpoint") or meta.get("model")
        if not named and model is None:
            raise PremiseIndexError(f"{folder / INDEX_FILE}: names no checkpoint or model")
        model = str(model) if model is not None else named
        sizes = index_file_sizes(folder, meta)  # every file a regular one of its recorded size, before any is read
        warnings = check_model(folder, meta, Path(model), force)
        embeddings = read_embeddings(folder, meta, warnings)
        premises = [line.model_dump() for line in read_jsonl(folder / PREMISES_FILE, PremiseLine,
                                                              sizes[PREMISES_FILE])]
        files = {r.path: FileInfo(list(r.imports), (r.premises[0], r.premises[1]), r.last_line)
                 for r in read_jsonl(folder / FILES_FILE, FileLine, sizes[FILES_FILE])}
        if embeddings.shape[0] != len(premises) or len(premises) != meta.get("num_premises"):
            raise PremiseIndexError(f"{folder}: {embeddings.shape[0]} embeddings, {len(premises)} premises and "
                                    f"num_premises {meta.get('num_premises')} disagree; rebuild the index")
        source = EncoderSource(folder, meta, model, device, matches=not warnings)
        encoder = build_encoder(engine, source, dtype)
        warnings += source.warnings
        if encoder.width != embeddings.shape[1]:
            raise PremiseIndexError(f"{folder}: embeddings are {embeddings.shape[1]} wide, the model {model} gives "
                                    f"{encoder.width}; rebuild the index")
        # bf16 as stored, on the encoder's device: a CPU multiplies them in fp32 a chunk at a time, a GPU in bf16.
        index = cls(folder, meta, embeddings.to(encoder.device), premises, files, encoder, warnings)
        if not force:
            index.check_probe()
        index.names = read_names(folder)
        return index

    def check_probe(self, count: int = PROBE_PREMISES) -> None:
        """Re-embed the index's `count` shortest premises and a state with its encoder: finite, and the premises
        close to their stored rows, or the index's embeddings are not this model's (another model's, a corrupt model
        or conversion). Any engine and dtype passes (int8's cosine with fp32 is about 0.998, far above the bar)."""
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
        ids, mask = tokenize_texts(self.encoder.tokenizer, [strip_goal_count(state)], self.state_max_len)
        return self.encoder.encode(ids, mask)

    @torch.inference_mode()
    def encode_premises(self, texts: list[str], batch_size: int = 32) -> torch.Tensor:
        """Embeddings of premise texts (serialized as the corpus's, name tagged), cut at the index's premise length,
        in length-sorted batches, and rounded to bf16 as the stored rows were: ranked together with those rows,
        a text equal to an indexed premise's scores as that premise does (up to the rounding of padded batches)."""
        out = torch.empty(len(texts), self.embeddings.shape[1], dtype=self.embeddings.dtype, device=self.device)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        for lo in range(0, len(order), batch_size):
            rows = order[lo:lo + batch_size]
            ids, mask = tokenize_texts(self.encoder.tokenizer, [texts[i] for i in rows], self.premise_max_len)
            out[torch.tensor(rows, device=self.device)] = self._as_stored(self.encoder.encode(ids, mask))
        return out

    @torch.inference_mode()
    def encode_together(self, states: list[str], texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """States (as `encode_state` formats and cuts them) and premise texts (as `encode_premises` cuts and
        rounds them) in one encoder pass: sorted by length into token-budget sub-batches, each padded to its own
        longest, so 32 states cost about one pass of their total length, not 32 passes. Padding is masked: each
        row is its own pass's up to float rounding."""
        tokenizer = self.encoder.tokenizer
        parts = []
        if states:
            parts.append(tokenize_texts(tokenizer, [strip_goal_count(s) for s in states], self.state_max_len))
        if texts:
            parts.append(tokenize_texts(tokenizer, texts, self.premise_max_len))
        if not parts:
            width = self.embeddings.shape[1]
            return self.embeddings.new_empty((0, width)), self.embeddings.new_empty((0, width))
        width = max(ids.shape[1] for ids, _ in parts)
        ids = torch.cat([torch.nn.functional.pad(i, (0, width - i.shape[1])) for i, _ in parts])
        mask = torch.cat([torch.nn.functional.pad(m, (0, width - m.shape[1])) for _, m in parts])
        emb = self.encoder.encode_many(ids, mask, mask.sum(dim=1).tolist())
        return emb[:len(states)], self._as_stored(emb[len(states):])

    def _as_stored(self, emb: torch.Tensor) -> torch.Tensor:
        """New premises' embeddings rounded to bf16 as the stored rows were, in the rows' dtype: ranked with them."""
        return emb.to(torch.bfloat16).to(self.embeddings.dtype)

    def score(self, states: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """States' scores against rows of this index's kind (stored, or `encode_premises`'), as `retrieve` scores."""
        return score_matrix(states, rows, scoring_path(rows, exact=True), exact=True)

    def describe_engine(self) -> str:
        """What answers a query here, for a log line: the engine, its dtype and the scoring path (`SCORING`)."""
        return f"{self.engine} {self.dtype}, scoring {self.scoring}"

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
        scores, rows = top_k_accessible(self.encode_state(state), self.embeddings, mask[None], k, exact=True,
                                        path=self.scoring)
        hits = []
        for score, row in zip(scores[0].tolist(), rows[0].tolist(), strict=True):
            if score == float("-inf"):
                break  # fewer accessible premises than k
            p = self.premises[row]
            hits.append(Hit(len(hits) + 1, float(score), row, p["full_name"], p["path"], tuple(p["start"]),
                            tuple(p["end"]), p["text"]))
        return hits
