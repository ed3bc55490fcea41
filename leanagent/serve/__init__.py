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
  `[{"name", "score"}, ...]`, best first, at most `k` long (32 by default). The indexed premises considered are
  those of the `imported_modules` and the `local_premises` given (everything when neither is; each entry a
  position in the cached list or a name), and the `new_premises`
  (`{"name", "decl"}`, printed by Lean) are embedded on the fly, ranked with them, and replace an indexed
  premise of the same name.
- `GET /health`.

Why errors look as they do: the client gives up on any body that is not the result array, and shows it to the
user. So every refusal is a JSON object `{"error": "<one line: what is wrong and where>"}` with a 4xx status
(413 for what is over a limit), never an array, never a traceback; an unexpected failure is a 500 of the same
shape, its traceback in the server's log only.

Why one encoder thread: concurrent requests are parsed, checked and ranked in parallel, but the encoder runs
one pass at a time, and concurrent requests' states and uncached new premises share it (`batching.py`: one
pass of 32 states sorted by length costs far less than 32 passes). On a CPU torch already spreads one pass
over every core, so parallel passes would only compete for them; on a GPU they would queue anyway. The
new-premise cache belongs to that thread. It is the default (`ServeLimits.batching`); `--no-batching` keeps
one request's passes at a time under a lock instead (docs/serving.md has the measurements).

`create_app(index)` returns an ASGI app, so a user can mount it in their own (`app.mount("/lean", ...)`).

`leanagent serve RUN_DIR` serves a lifelong run's newest finished stage and follows the run (`follow.py`). On an
open network every request is bounded before its work: its connection's time to send it whole and the number of
open connections, with a few kept for `/health` (`protocol.py`), its body's size and the bytes all bodies hold at
once, counted as they arrive (`app.BodyBudget`: past it a 503), its JSON values counted before any is decoded, its
lists checked whole and its names' lengths as it is decoded (`parse.py`), the new-premise cache's real bytes
(`cache.py`). An access token
rides in the URL's path (`app.TokenGate`); beyond this machine one is required, and it is checked and kept out of
every log line, in any spelling (`access.py`). No response names a path of this machine, and nothing a client can
send is a traceback in the log. At a stop, requests running are answered or get a 503 before uvicorn's window ends
(`app.Stop`).

The package, one concern a module: `schemas.py` (what a request may hold, and the limits), `parse.py` (a body to a
request, under the limits), `cache.py` (new premises' embeddings), `batching.py` (shared encoder passes),
`server.py` (`PremiseServer`: the protocol over a loaded index), `follow.py` (a run's newest stage, swapped in as
the run goes on), `app.py` (the HTTP app and its refusals), `access.py` (the token's rules), `protocol.py`
(HTTP/1.1 with deadlines and a connection cap) and `process.py` (the socket, uvicorn and the signals that stop it:
what `leanagent serve` runs).
Lean's names for corpus paths and premises are `leanagent.data.lean_names`.
"""

from importlib import import_module
from typing import Any

# What this package names, and the module each comes from. Imported when first asked for, so that reading the
# limits (the command line builds `leanagent serve`'s flags from `ServeLimits`) does not import torch and FastAPI.
_EXPORTS = {
    "DEFAULT_HOST": "process", "DEFAULT_PORT": "process", "ServeError": "process", "listen": "process",
    "resolve_source": "process", "serve": "process", "create_app": "app", "ServerHolder": "follow",
    "StageFollower": "follow", "run_stages": "follow", "RequestError": "schemas", "RetrieveRequest": "schemas",
    "ServeLimits": "schemas", "PremiseServer": "server", "StageInfo": "server",
}
__all__ = [*sorted(_EXPORTS), "lean_name", "module_name"]


def __getattr__(name: str) -> Any:
    if name in ("lean_name", "module_name"):
        return getattr(import_module("leanagent.data.lean_names"), name)
    if name in _EXPORTS:
        return getattr(import_module(f"leanagent.serve.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'leanagent.serve' has no attribute {name!r}")
