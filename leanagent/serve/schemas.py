"""What one `/retrieve` request may hold, and the limits a server puts on it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr


class ServeLimits(BaseModel):
    """What one request may ask and what the server holds. Each is a `leanagent serve` flag of the same name.

    Why 64 new premises: each costs an encoder pass over up to 512 bytes, whatever the rest of the request. At
    Lean's own 2,048 the heaviest legal request took 29 s of CPU with the demo's tiny encoder on a 2-core CPU
    without AMX (CTranslate2 fp32, a loaded machine), against the 2 s a request may cost; 128 took 1.7-2.1 s, 64
    about 1 s. Lean's client asks GET /max-new-premises and sends at most that many, so it needs no setting."""

    model_config = ConfigDict(extra="forbid")

    max_k: int = Field(1024, gt=0, description="a larger k is answered with this many premises")
    max_new_premises: int = Field(64, ge=0, description="new premises one request may send (each an encoder pass "
                                                        "of up to 512 bytes); what GET /max-new-premises returns, "
                                                        "and Lean's client sends at most that many")
    max_name_chars: int = Field(1024, gt=0, description="a new premise's name, checked before any work on it")
    max_decl_chars: int = Field(100_000, gt=0, description="a new premise's declaration (the model reads its first "
                                                           "512 bytes)")
    max_state_chars: int = Field(1_000_000, gt=0, description="a proof state (the model reads its first 1024 bytes)")
    max_positions: int = Field(1_000_000, gt=0, description="positions in one request's local_premises and module "
                                                            "lists together, counted as the body is read")
    max_body_bytes: int = Field(16 << 20, gt=0, description="a request body beyond this is refused unread (Lean's "
                                                            "client sends well under 2 MB)")
    bodies_mb: float = Field(256.0, gt=0, description="memory for the bodies of all requests being read and decoded "
                                                      "at once (4 bytes per body byte and 64 per JSON value, as "
                                                      "counted); past it a 503 with Retry-After")
    cache_mb: float = Field(256.0, ge=0, description="memory for new premises' embeddings kept between requests "
                                                     "(least recently used go first)")
    # On by default; on a CPU oversubscribed several times it measured slower over HTTP (docs/serving.md).
    batching: bool = Field(True, description="concurrent requests share encoder passes")
    batch_tokens: int = Field(32 * 1024, gt=0, description="tokens (bytes) one shared pass takes at most; a request "
                                                           "over it has a pass of its own")
    batch_wait_ms: float = Field(2.0, ge=0, description="how long a pass waits for requests still arriving (a lone "
                                                        "client never waits)")
    request_timeout_s: float = Field(10.0, gt=0, description="a connection's request must arrive whole within this "
                                                             "many seconds (else 408 and closed)")
    max_connections: int = Field(1024, gt=0, description="open connections at most; more are closed at once")
    health_connections: int = Field(8, ge=0, description="connections beyond --max-connections held for GET "
                                                         "/health alone, each closed unless it asks within 2 s")


DEFAULT_K = 32  # the reference server's default; the Lean client always sends k
# A premise or module as a position in the list the client cached, or by its name (a user's curl, LeanHammer).
NameOrPosition = StrictInt | StrictStr


class NewPremise(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr
    decl: StrictStr


class RetrieveRequest(BaseModel):
    """A `/retrieve` body. Unknown keys are ignored, so a newer client's additions do not break it."""

    model_config = ConfigDict(extra="ignore")

    state: StrictStr
    # Each entry a position in GET /indexed-premises (what the Lean client sends) or a premise's name, as
    # LeanHammer's server also takes them; one list may mix both.
    local_premises: list[NameOrPosition] | None = None
    imported_modules: list[NameOrPosition] | None = None  # positions in GET /indexed-modules, or module names
    new_premises: list[NewPremise] | None = None
    k: StrictInt = DEFAULT_K
    # Sent by clients of Lean's module system; its modules are accessible like `imported_modules`' (an index does
    # not tell private declarations apart), and whether the caller is a module changes nothing here.
    caller_in_module_system: StrictBool | None = None
    imported_all_modules: list[NameOrPosition] | None = None


class RequestError(Exception):
    """A request refused: its HTTP status and the one line the client shows."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class ServerStopping(RequestError):
    """The server was told to stop (a signal) while this request waited or ran past the time left to finish it: a
    503 to retry, never a 500."""

    def __init__(self) -> None:
        super().__init__(503, "the server is stopping (it was told to): retry in a moment, once it is back")
