"""`leanagent serve`: the trained retriever behind Lean's premise-selection API.

Lean 4's premise-selection API (`Lean.PremiseSelection` from v4.18, `Lean.LibrarySuggestions` from v4.26) has
a cloud client, the `premise-selection` package LeanHammer uses, that asks whatever HTTP server
`set_option premiseSelection.apiBaseUrl "http://host:port"` names. `suggest_premises`, `grind +suggestions`
and `simp? +suggestions` then use it. This module answers that protocol over an index `leanagent index` built,
with the model and the embeddings loaded once per process:

- `GET /indexed-modules`, `GET /indexed-premises`: module names (a corpus path without `.lean`, `/` -> `.`,
  a lake package's prefix dropped) and premise names (as Lean writes them, `«»` where needed), each once, in
  corpus order. The client caches both for its whole process and refers to them by position.
- `GET /max-new-premises`: a bare integer, the most unindexed premises one request may carry.
- `POST /retrieve`: `{"state", "local_premises", "imported_modules", "new_premises", "k", ...}`; the reply is
  `[{"name", "score"}, ...]`, best first, at most `k` long. The indexed premises considered are those of the
  `imported_modules` and the `local_premises` given (everything when neither is), and the `new_premises`
  (`{"name", "decl"}`, printed by Lean) are embedded on the fly, ranked with them, and replace an indexed
  premise of the same name.
- `GET /health`.

Why errors look as they do: the client gives up on any body that is not the result array, and shows it to the
user. So every refusal is a JSON object `{"error": "<one line: what is wrong and where>"}` with a 4xx status
(413 for what is over a limit), never an array, never a traceback; an unexpected failure is a 500 of the same
shape, its traceback in the server's log only.

Why one encoder lock: concurrent requests are parsed, checked and merged in parallel, but the encoder runs
one batch at a time. On a CPU, torch already spreads one pass over every core, so parallel passes would only
compete for them; on a GPU they would queue anyway. The new-premise cache lives under the same lock.

`create_app(index)` returns a FastAPI app, so a user can mount it in their own (`app.mount("/lean", ...)`).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from leanagent.data.corpus import serialize_premise
from leanagent.index import PremiseIndex
from leanagent.model.topk import top_k_accessible

LOG = logging.getLogger("leanagent.serve")
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 23337
ENDPOINTS = "GET /indexed-modules, GET /indexed-premises, GET /max-new-premises, POST /retrieve, GET /health"


class ServeLimits(BaseModel):
    """What one request may ask; the defaults fit the Lean client's own (it sends up to 2048 new premises)."""

    model_config = ConfigDict(extra="forbid")

    max_k: int = Field(1024, gt=0, description="a larger k is answered with this many premises")
    max_new_premises: int = Field(2048, ge=0, description="also what GET /max-new-premises returns")
    max_state_chars: int = Field(1_000_000, gt=0, description="the model reads the first 1024 bytes of it anyway")
    max_decl_chars: int = Field(100_000, gt=0, description="per new premise; the model reads its first 512 bytes")
    max_body_bytes: int = Field(64 << 20, gt=0, description="a request body beyond this is refused unread")
    cache_size: int = Field(16_384, ge=0, description="new-premise embeddings kept (least recently used go first)")


class NewPremise(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr
    decl: StrictStr


class RetrieveRequest(BaseModel):
    """A `/retrieve` body. Unknown keys are ignored, so a newer client's additions do not break it."""

    model_config = ConfigDict(extra="ignore")

    state: StrictStr
    local_premises: list[StrictInt] | None = None  # indices into GET /indexed-premises
    imported_modules: list[StrictInt] | None = None  # indices into GET /indexed-modules
    new_premises: list[NewPremise] | None = None
    k: StrictInt = 32  # the reference server's default; the Lean client always sends it
    # Sent by clients of Lean's module system; its modules are accessible like `imported_modules`' (an index does
    # not tell private declarations apart), and whether the caller is a module changes nothing here.
    caller_in_module_system: StrictBool | None = None
    imported_all_modules: list[StrictInt] | None = None


class RequestError(Exception):
    """A request refused: its HTTP status and the one line the client shows."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# ---- names --------------------------------------------------------------------------------------

LAKE_PACKAGES = ".lake/packages/"
# Lean core's files in a LeanDojo corpus: .lake/packages/lean4/src/lean/Init/Prelude.lean is module Init.Prelude,
# .lake/packages/lean4/src/lean/lake/Lake.lean is module Lake.
CORE_ROOTS = ("src/lean/lake/", "src/lean/")


def module_name(path: str) -> str:
    """The Lean module of a corpus file: `Mathlib/Algebra/Group/Defs.lean` and
    `.lake/packages/mathlib/Mathlib/Algebra/Group/Defs.lean` are both `Mathlib.Algebra.Group.Defs`."""
    p = path[2:] if path.startswith("./") else path
    if p.startswith(LAKE_PACKAGES) and "/" in p[len(LAKE_PACKAGES):]:
        package, p = p[len(LAKE_PACKAGES):].split("/", 1)
        if package == "lean4":
            p = next((p[len(root):] for root in CORE_ROOTS if p.startswith(root)), p)
    if p.endswith(".lean"):
        p = p[: -len(".lean")]
    return p.replace("/", ".")


def _letter_like(c: str) -> bool:
    o = ord(c)
    return ((0x3B1 <= o <= 0x3C9 and o != 0x3BB) or (0x391 <= o <= 0x3A9 and o not in (0x3A0, 0x3A3))
            or 0x3CA <= o <= 0x3FB or 0x1F00 <= o <= 0x1FFE or 0x2100 <= o <= 0x214F or 0x1D49C <= o <= 0x1D59F)


def _subscript(c: str) -> bool:
    o = ord(c)
    return 0x2080 <= o <= 0x2089 or 0x2090 <= o <= 0x209C or 0x1D62 <= o <= 0x1D6A


def _id_first(c: str) -> bool:
    return (c.isascii() and c.isalpha()) or c == "_" or _letter_like(c)


def _id_rest(c: str) -> bool:
    return (c.isascii() and c.isalnum()) or c in "_'!?" or _letter_like(c) or _subscript(c)


def name_parts(name: str) -> list[str]:
    """The components of a dotted name, a `«...»` component (which may hold dots) kept whole."""
    parts, current, quoted = [], [], False
    for c in name:
        if c == "«":
            quoted = True
        elif c == "»":
            quoted = False
        if c == "." and not quoted:
            parts.append("".join(current))
            current = []
        else:
            current.append(c)
    parts.append("".join(current))
    return parts


def lean_name(full_name: str) -> str:
    """`full_name` as Lean's `Name.toString` writes it, so that the client's `FromJson Name` reads it: a component
    that is not an identifier (a number, a space, a symbol) is put in `«»`. One bad name would make the client
    reject the whole reply. Components already in `«»` are kept."""
    out = []
    for part in name_parts(full_name):
        plain = part and _id_first(part[0]) and all(_id_rest(c) for c in part[1:])
        quoted = part.startswith("«") and part.endswith("»")
        out.append(part if plain or quoted or "»" in part else f"«{part}»")
    return ".".join(out)


def name_key(name: str) -> tuple[str, ...]:
    """A name's components without `«»`: how a new premise's name is matched to an indexed one's."""
    return tuple(p[1:-1] if p.startswith("«") and p.endswith("»") else p for p in name_parts(name))


# ---- the tables a request is answered from --------------------------------------------------------

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


class _EmbeddingCache:
    """New-premise embeddings by serialized text, least recently used dropped beyond `capacity`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._rows: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._rows)

    def lookup(self, texts: Sequence[str]) -> tuple[dict[str, torch.Tensor], list[str]]:
        found, missing = {}, []
        for text in dict.fromkeys(texts):
            row = self._rows.get(text)
            if row is None:
                missing.append(text)
            else:
                self._rows.move_to_end(text)
                found[text] = row
        self.hits += len(found)
        self.misses += len(missing)
        return found, missing

    def store(self, texts: Sequence[str], rows: torch.Tensor) -> None:
        if not self.capacity:
            return
        for text, row in zip(texts, rows, strict=True):
            self._rows[text] = row
            self._rows.move_to_end(text)
        while len(self._rows) > self.capacity:
            self._rows.popitem(last=False)


class PremiseServer:
    """The protocol over one loaded `PremiseIndex`; `retrieve` is safe to call from many threads at once."""

    def __init__(self, index: PremiseIndex, limits: ServeLimits | None = None) -> None:
        self.index = index
        self.limits = limits or ServeLimits()
        self._encoder = threading.Lock()
        self._cache = _EmbeddingCache(self.limits.cache_size)
        premises = index.premises
        self.row_names = [lean_name(p["full_name"]) for p in premises]
        # Premise names, each once (the client maps name -> position), with every row that bears it.
        by_name: dict[str, list[int]] = {}
        for row, name in enumerate(self.row_names):
            by_name.setdefault(name, []).append(row)
        self.premise_names = list(by_name)
        self._names = _Groups(list(by_name.values()))
        self._key_rows = {name_key(name): rows for name, rows in by_name.items()}
        self._duplicates = len(premises) - len(by_name)
        by_module: dict[str, list[int]] = {}
        for path, info in index.files.items():
            by_module.setdefault(module_name(path), []).extend(range(*info.rows))
        self.module_names = list(by_module)
        self._modules = _Groups(list(by_module.values()))
        self.indexed_premises_json = _json_bytes(self.premise_names)
        self.indexed_modules_json = _json_bytes(self.module_names)
        self.requests = 0

    # -- one request --
    def retrieve(self, request: RetrieveRequest) -> list[dict[str, Any]]:
        """The reply to a validated `/retrieve` body; raises RequestError for what the limits or tables refuse."""
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
        for i, p in enumerate(new):
            if len(p.decl) > limits.max_decl_chars:
                raise RequestError(413, f"new_premises[{i}] ({p.name}): decl of {len(p.decl):,} characters, more "
                                        f"than this server's {limits.max_decl_chars:,}")
        mask = self._accessible(request)
        latest = {name_key(p.name): p for p in new}  # a name sent twice: its last decl counts
        uploaded = list(latest.values())
        replaced = [row for key in latest for row in self._key_rows.get(key, ())]
        if replaced:
            if mask is None:
                mask = np.ones(len(self.row_names), dtype=bool)
            mask[replaced] = False
        texts = [serialize_premise(p.name, p.decl) for p in uploaded]
        with self._encoder:
            self.requests += 1
            state = self.index.encode_state(request.state)
            new_rows = self._embed(texts)
            indexed = self._top_indexed(state, mask, k)
            new_scores = (state.to(new_rows.dtype) @ new_rows.t())[0].tolist() if uploaded else []
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
                mask[self._modules.rows(_indices(ids, self._modules.count, field_name, "/indexed-modules"))] = True
        if request.local_premises:
            ids = _indices(request.local_premises, self._names.count, "local_premises", "/indexed-premises")
            mask[self._names.rows(ids)] = True
        return mask

    def _embed(self, texts: list[str]) -> torch.Tensor:
        """Rows for `texts`, from the cache or encoded now (then cached); the caller holds the encoder lock."""
        emb = self.index.embeddings
        if not texts:
            return emb.new_empty((0, emb.shape[1]))
        found, missing = self._cache.lookup(texts)
        if missing:
            rows = self.index.encode_premises(missing)
            self._cache.store(missing, rows)
            found.update(zip(missing, rows, strict=True))
        return torch.stack([found[t] for t in texts])

    def _top_indexed(self, state: torch.Tensor, mask: np.ndarray | None, k: int) -> list[tuple[float, str]]:
        """The k best accessible indexed premises as (score, name), each name once (its best row)."""
        n = len(self.row_names)
        if not n:
            return []
        accessible = torch.ones(1, n, dtype=torch.bool) if mask is None else torch.from_numpy(mask)[None]
        scores, rows = top_k_accessible(state, self.index.embeddings, accessible, min(n, k + self._duplicates))
        out, seen = [], set()
        for score, row in zip(scores[0].tolist(), rows[0].tolist(), strict=True):
            name = self.row_names[row]
            if score == float("-inf") or len(out) == k:
                break
            if name not in seen:
                seen.add(name)
                out.append((float(score), name))
        return out

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "index": str(self.index.folder), "premises": len(self.premise_names),
                "modules": len(self.module_names), "max_new_premises": self.limits.max_new_premises,
                "requests": self.requests, "cached_new_premises": len(self._cache), "warnings": self.index.warnings}


def _indices(values: list[int], count: int, field_name: str, endpoint: str) -> np.ndarray:
    ids = np.asarray(values, dtype=np.int64)
    bad = np.flatnonzero((ids < 0) | (ids >= count))
    if len(bad):
        i = int(bad[0])
        known = f"0-{count - 1}" if count else "none: it is empty"
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise RequestError(422, f"{field_name}[{i}]: {values[i]} is not a position in GET {endpoint} "
                                f"({known}){more}; a client caches that list, so restart Lean after the server's "
                                f"index changed")
    return ids


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


# ---- HTTP ---------------------------------------------------------------------------------------

def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": " ".join(message.split())}, status_code=status)


def _validation_message(exc: ValidationError) -> str:
    errors = exc.errors()
    first = errors[0]
    where = ".".join(str(x) for x in first["loc"]) or "body"
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return f"{where}: {first['msg']}{more}"


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused as soon as it passes `limit` bytes (declared or streamed), so a huge one is never held."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"body of {int(declared):,} bytes, more than this server's {limit:,}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"body of more than {limit:,} bytes, this server's limit")
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(body: bytes) -> RetrieveRequest:
    try:
        payload = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise RequestError(400, f"body is not UTF-8 JSON (byte {exc.start} cannot be decoded)") from None
    except json.JSONDecodeError as exc:
        raise RequestError(400, f"body is not JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    if not isinstance(payload, dict):
        raise RequestError(422, f"body must be a JSON object with a state, found a JSON {type(payload).__name__}")
    try:
        return RetrieveRequest.model_validate(payload)
    except ValidationError as exc:
        raise RequestError(422, _validation_message(exc)) from None


def create_app(index: PremiseIndex | PremiseServer, limits: ServeLimits | None = None) -> FastAPI:
    """The premise-selection API over a loaded index (see the module docstring); run it with uvicorn or mount it."""
    server = index if isinstance(index, PremiseServer) else PremiseServer(index, limits)
    app = FastAPI(title="leanagent premise selection", docs_url=None, redoc_url=None,
                  description=f"Lean's premise-selection protocol over {server.index.folder}")
    app.state.premise_server = server

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError) -> JSONResponse:
        return _error(exc.status, exc.message)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}; this server answers "
                                       f"{ENDPOINTS}")

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        where = ".".join(str(x) for x in errors[0]["loc"]) if errors else "request"
        return _error(422, f"{where}: {errors[0]['msg'] if errors else 'invalid'}")

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> JSONResponse:
        LOG.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        first = str(exc).splitlines()[0] if str(exc) else ""
        return _error(500, f"internal error ({type(exc).__name__}{': ' + first if first else ''}); the server's "
                           f"log has the traceback")

    @app.get("/indexed-modules")
    def indexed_modules() -> Response:
        return Response(server.indexed_modules_json, media_type="application/json")

    @app.get("/indexed-premises")
    def indexed_premises() -> Response:
        return Response(server.indexed_premises_json, media_type="application/json")

    @app.get("/max-new-premises")
    def max_new_premises() -> int:
        return server.limits.max_new_premises

    @app.get("/health")
    def health() -> dict[str, Any]:
        return server.health()

    @app.post("/retrieve")
    async def retrieve(request: Request) -> JSONResponse:
        body = await _read_body(request, server.limits.max_body_bytes)
        return JSONResponse(await run_in_threadpool(server.retrieve, _parse(body)))

    return app


def listen(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> socket.socket:
    """A listening TCP socket for uvicorn's `sockets=` (bound by us, so that port 0 can be reported).

    Made with proto IPPROTO_TCP, and with TCP_NODELAY, which accepted connections inherit: asyncio sets NODELAY
    only on sockets whose proto says TCP, and `socket.create_server` leaves it 0. Without it every response
    (headers, then body: two writes) waited for the client's delayed ACK, 40 ms a request on Linux."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP,
                               flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


def load_app(folder: str, device: str = "cpu", model: str | None = None, force: bool = False,
             limits: ServeLimits | None = None) -> FastAPI:
    """`create_app` over the index in `folder` (loaded once; refused if its model changed, unless `force`)."""
    return create_app(PremiseIndex.load(folder, device=device, model=model, force=force), limits)
