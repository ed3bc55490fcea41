"""`PremiseServer`: the premise-selection protocol over one loaded `PremiseIndex`, without HTTP.

It builds, once, the tables a request is answered from (names and modules by position, as the client caches
them) and answers a validated request: the accessible indexed premises and the uploaded new ones, ranked
together by the same encoder. One encoder lock: see the package docstring.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from leanagent.data.corpus import serialize_premise
from leanagent.data.lean_names import lean_name, module_name, name_key
from leanagent.ground import model_identity
from leanagent.index.query import PremiseIndex
from leanagent.model.topk import top_k_accessible
from leanagent.serve.batching import PART_TOKENS, Arrival, EncoderBatcher, token_parts
from leanagent.serve.cache import EmbeddingCache
from leanagent.serve.parse import excerpt
from leanagent.serve.schemas import RequestError, RetrieveRequest, ServeLimits, ServerStopping


class _Groups:
    """Items (premise rows) grouped under ids (names, modules) in CSR form: `rows(ids)` in one vectorised step."""

    def __init__(self, members: list[list[int]]) -> None:
        self.count = len(members)
        self.offsets = np.zeros(len(members) + 1, dtype=np.int64)
        np.cumsum([len(m) for m in members], out=self.offsets[1:])
        self.flat = np.fromiter((r for m in members for r in m), dtype=np.int64, count=int(self.offsets[-1]))

    def rows(self, ids: np.ndarray) -> np.ndarray:
        starts, lengths = self.offsets[ids], self.offsets[ids + 1] - self.offsets[ids]
        if not len(ids) or not lengths.sum():
            return np.empty(0, dtype=np.int64)
        shift = np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
        return self.flat[shift + np.arange(int(lengths.sum()))]


@dataclass(frozen=True)
class StageInfo:
    """What a server tells of the lifelong stage it serves: the repository trained through and its position."""

    name: str
    position: int


class PremiseServer:
    """The protocol over one loaded `PremiseIndex`; `retrieve` is safe to call from many threads at once.

    The lists it gives (GET /indexed-premises, /indexed-modules) are the index's `names.json` when it has one (a
    stage's lists extend the previous stage's, `leanagent.serve.follow`), with any name it lacks appended; a listed
    name the index no longer holds stands for no premise."""

    def __init__(self, index: PremiseIndex, limits: ServeLimits | None = None, stage: StageInfo | None = None) -> None:
        self.index = index
        self.stage = stage
        self.limits = limits or ServeLimits()
        self._encoder = threading.Lock()
        self._stopping = threading.Event()
        self._cache = EmbeddingCache(int(self.limits.cache_mb * 2**20))
        self._stats = threading.Lock()
        # Batched (the default): one thread runs the encoder for every request (see batching.py); unbatched:
        # each request's own passes, one request at a time under the encoder lock.
        self.batcher = EncoderBatcher(index, self._cache, self.limits.batch_tokens, self.limits.batch_wait_ms / 1000,
                                      self._top_indexed) if self.limits.batching else None
        premises = index.premises
        listed = index.names or {}
        self.row_names = [lean_name(p["full_name"]) for p in premises]
        # Premise names, each once (the client maps name -> position), with every row that bears it.
        by_name: dict[str, list[int]] = {}
        for row, name in enumerate(self.row_names):
            by_name.setdefault(name, []).append(row)
        self.premise_names = list(dict.fromkeys([*listed.get("premises", ()), *by_name]))
        self._names = _Groups([by_name.get(name, []) for name in self.premise_names])
        # A request may name premises instead of giving positions: matched as a new premise's name is, by key.
        self._name_position = {name_key(name): i for i, name in enumerate(self.premise_names)}
        self._key_rows = {name_key(name): rows for name, rows in by_name.items()}
        self._duplicates = len(premises) - len(by_name)
        by_module: dict[str, list[int]] = {}
        for path, info in index.files.items():
            by_module.setdefault(module_name(path), []).extend(range(*info.rows))
        self.module_names = list(dict.fromkeys([*listed.get("modules", ()), *by_module]))
        self._modules = _Groups([by_module.get(name, []) for name in self.module_names])
        self._module_position = {name: i for i, name in enumerate(self.module_names)}
        self.indexed_premises_json = _json_bytes(self.premise_names)
        self.indexed_modules_json = _json_bytes(self.module_names)
        self.requests = 0

    # -- one request --
    def retrieve(self, request: RetrieveRequest, arrival: Arrival | None = None) -> list[dict[str, Any]]:
        """The reply to a validated `/retrieve` body; raises RequestError for what the limits or tables refuse.
        `arrival`: the batcher's count of this request since its body was read (`EncoderBatcher.arriving`)."""
        limits = self.limits
        if request.k <= 0:
            return []
        k = min(request.k, limits.max_k)
        if len(request.state) > limits.max_state_chars:
            raise RequestError(413, f"state: {len(request.state):,} characters, more than this server's "
                                    f"{limits.max_state_chars:,}")
        new = request.new_premises or []
        if len(new) > limits.max_new_premises:
            raise RequestError(413, f"new_premises: {len(new):,} premises, more than this server's "
                                    f"{limits.max_new_premises:,} (GET /max-new-premises); set "
                                    f"premiseSelection.maxUnindexedPremises to at most that, or restart the "
                                    f"server with a larger --max-new-premises")
        positions = sum(len(ids or ()) for ids in (request.local_premises, request.imported_modules,
                                                   request.imported_all_modules))
        if positions > limits.max_positions:
            raise RequestError(413, f"{positions:,} premises and modules named, more than this server's "
                                    f"{limits.max_positions:,}")
        for i, p in enumerate(new):  # before any work on a name: serializing it is linear in its length, not free
            if len(p.name) > limits.max_name_chars:
                raise RequestError(413, f"new_premises[{i}]: a name of {len(p.name):,} characters ({excerpt(p.name)}),"
                                        f" more than this server's {limits.max_name_chars:,}")
            if len(p.decl) > limits.max_decl_chars:
                raise RequestError(413, f"new_premises[{i}] ({excerpt(p.name)}): decl of {len(p.decl):,} "
                                        f"characters, more than this server's {limits.max_decl_chars:,}")
        mask = self._accessible(request)
        latest = {name_key(p.name): p for p in new}  # a name sent twice: its last decl counts
        uploaded = list(latest.values())
        replaced = [row for key in latest for row in self._key_rows.get(key, ())]
        if replaced:
            if mask is None:
                mask = np.ones(len(self.row_names), dtype=bool)
            mask[replaced] = False
        texts = [serialize_premise(p.name, p.decl) for p in uploaded]
        with self._stats:
            self.requests += 1
        if self.batcher is None:
            with self._encoder:
                if self._stopping.is_set():
                    raise ServerStopping()
                state = self.index.encode_state(request.state)
                new_rows = self._embed(texts)
                [indexed] = self._top_indexed(state, [(mask, k)])
                new_scores = self._scores(state, new_rows) if uploaded else []
        else:
            def finish(state: torch.Tensor, rows: list[torch.Tensor], top: list) -> tuple[list, list[float]]:
                return top, self._scores(state, torch.stack(rows)) if rows else []

            indexed, new_scores = self.batcher.encode(request.state, texts, (mask, k), finish, arrival)
        ranked = indexed + [(score, p.name) for score, p in zip(new_scores, uploaded, strict=True)]
        ranked.sort(key=lambda hit: -hit[0])  # stable: on a tie an indexed premise stays first
        return [{"name": name, "score": score} for score, name in ranked[:k]]

    def _accessible(self, request: RetrieveRequest) -> np.ndarray | None:
        """The indexed premises the request may see, as a mask over rows; None when it names neither list."""
        module_lists = [m for m in (request.imported_modules, request.imported_all_modules) if m is not None]
        if request.local_premises is None and not module_lists:
            return None
        mask = np.zeros(len(self.row_names), dtype=bool)
        for field_name, ids in (("imported_modules", request.imported_modules),
                                ("imported_all_modules", request.imported_all_modules)):
            if ids:
                positions = _positions(ids, self._modules.count, self._module_position.get, field_name,
                                       "/indexed-modules", "module")
                mask[self._modules.rows(positions)] = True
        if request.local_premises:
            positions = _positions(request.local_premises, self._names.count,
                                   lambda name: self._name_position.get(name_key(name)), "local_premises",
                                   "/indexed-premises", "premise")
            mask[self._names.rows(positions)] = True
        return mask

    def _embed(self, texts: list[str]) -> torch.Tensor:
        """Rows for `texts`, from the cache or encoded now (then cached); the caller holds the encoder lock."""
        emb = self.index.embeddings
        if not texts:
            return emb.new_empty((0, emb.shape[1]))
        found, missing = self._cache.lookup(texts)
        if missing:
            parts = []
            for part in token_parts(missing, PART_TOKENS, self.index.premise_max_len):
                if self._stopping.is_set():  # many new premises: a token budget at a time, the stop looked for
                    raise ServerStopping()
                parts.append(self.index.encode_premises(part))
            rows = torch.cat(parts) if len(parts) > 1 else parts[0]
            self._cache.store(missing, rows)
            found.update(zip(missing, rows, strict=True))
        return torch.stack([found[t] for t in texts])

    def _top_indexed(self, states: torch.Tensor,
                     queries: list[tuple[np.ndarray | None, int]]) -> list[list[tuple[float, str]]]:
        """Per state (a row each) and its (mask, k): the k best accessible indexed premises as (score, name), each
        name once (its best row). All states in one product with the embeddings, one top-k over them: a batched
        pass's requests read the embeddings once, not once each."""
        n = len(self.row_names)
        if not n:
            return [[] for _ in queries]
        everything = np.ones(n, dtype=bool)
        accessible = torch.from_numpy(np.stack([everything if mask is None else mask for mask, _ in queries]))
        most = max(k for _, k in queries)
        scores, rows = top_k_accessible(states, self.index.embeddings, accessible, min(n, most + self._duplicates),
                                        exact=True, path=self.index.scoring)
        return [self._names_of(s, r, k) for s, r, (_, k) in zip(scores.tolist(), rows.tolist(), queries, strict=True)]

    def _names_of(self, scores: list[float], rows: list[int], k: int) -> list[tuple[float, str]]:
        """The first k distinct names of one ranked row list, with their best scores."""
        out, seen = [], set()
        for score, row in zip(scores, rows, strict=True):
            name = self.row_names[row]
            if score == float("-inf") or len(out) == k:
                break
            if name not in seen:
                seen.add(name)
                out.append((float(score), name))
        return out

    def _scores(self, state: torch.Tensor, rows: torch.Tensor) -> list[float]:
        """A state's score against each new premise's embedding row, as the indexed rows are scored."""
        return self.index.score(state, rows)[0].tolist()

    def health(self) -> dict[str, Any]:
        """What GET /health says: the stage and model served, sizes and counts; no path of this machine's."""
        model = model_identity.digest(self.index.meta.get("model_identity"))
        return {"status": "ok", "stage": self.stage.name if self.stage else None,
                "stage_number": self.stage.position + 1 if self.stage else None,
                "model": {"sha256": model}, "premises": len(self.premise_names), "modules": len(self.module_names),
                "max_new_premises": self.limits.max_new_premises, "requests": self.requests,
                "cached_new_premises": len(self._cache), "batching": self.batcher is not None,
                "encoder_passes": self.batcher.passes if self.batcher else None,
                "engine": self.index.engine, "dtype": self.index.dtype, "scoring": self.index.scoring,
                "warnings": len(self.index.warnings)}

    def abort(self) -> None:
        """The process stops: requests waiting for the encoder, or in its pass, end with a 503 (`ServerStopping`)
        within one part of a pass (`token_parts`), and the encoder's thread ends."""
        self._stopping.set()
        if self.batcher is not None:
            self.batcher.abort()

    def close(self, wait_s: float = 0.0) -> None:
        """Stop the encoder's thread (waiting up to `wait_s` for it); what holds the index (the model, the
        embeddings) goes with this server."""
        if self.batcher is not None:
            self.batcher.close(wait_s)


def _positions(values: list[int | str], count: int, position_of: Callable[[str], int | None], field_name: str,
               endpoint: str, what: str) -> np.ndarray:
    """Positions in the list GET `endpoint` returns, each value given as a position or as a name (a premise's as
    Lean writes it, with or without `«»`): the first unknown name or bad position refused, naming it."""
    if any(isinstance(v, str) for v in values):
        resolved, known = [], {}  # each distinct name looked up once: a list may repeat one a million times
        for i, v in enumerate(values):
            if isinstance(v, str):
                position = known.get(v)
                if position is None:
                    position = known[v] = position_of(v)
                    if position is None:
                        raise RequestError(422, f"{field_name}[{i}]: {excerpt(v)} is not a {what} name in GET "
                                                f"{endpoint}")
                v = position
            resolved.append(v)
        values = resolved
    try:
        ids = np.asarray(values, dtype=np.int64)
    except OverflowError:  # an integer beyond int64 (a small body's integers are not checked as it is decoded)
        ids = np.asarray([v if -1 <= v <= count else -1 for v in values], dtype=np.int64)
    bad = np.flatnonzero((ids < 0) | (ids >= count))
    if len(bad):
        i = int(bad[0])
        known = f"0-{count - 1}" if count else "none: it is empty"
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise RequestError(422, f"{field_name}[{i}]: {excerpt(values[i])} is not a position in GET {endpoint} "
                                f"({known}){more}; a client caches that list, so restart Lean after the server's "
                                f"index changed")
    return ids


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
