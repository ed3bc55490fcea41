"""A `/retrieve` body to a `RetrieveRequest`, with bounded work whatever the bytes.

The limits are checked while the JSON is decoded, not after: the decoder calls back for every object and, in a
body large enough to hold more positions than the limit, every integer, and the first one over a limit stops it.
So a body of millions of tiny new premises, or of tens of millions of positions, is refused after the first few
over the limit, in the memory those took, not after building all of them and validating them. A name or a
declaration is checked for length as its object is built, before anything is done with it. Nesting too deep for
the decoder, an integer no field takes, a string that is not Unicode (a lone surrogate) are each a 4xx with one
line; every message quotes at most a short prefix of what it refuses (`excerpt`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import ValidationError

from leanagent.ground.config import format_validation_error
from leanagent.serve.schemas import RequestError, RetrieveRequest, ServeLimits

EXCERPT_CHARS = 40
MAX_DIGITS = 18  # no field takes an integer beyond int64 (positions, k)
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def excerpt(value: Any, chars: int = EXCERPT_CHARS) -> str:
    """`value` as JSON, cut to `chars` characters: what an error message may quote of a client's input."""
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else json.dumps(value[: chars + 1],
                                                                                              ensure_ascii=False)
    return text if len(text) <= chars else text[: chars - 3] + "..."


class _Budget:
    """The decoder's callbacks: count objects and integers, check names and declarations as they are built."""

    def __init__(self, limits: ServeLimits) -> None:
        self.limits = limits
        self.objects = 0
        self.integers = 0

    def object_pairs(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        self.objects += 1
        if self.objects > self.limits.max_new_premises + 1:  # the body itself, then one per new premise
            raise RequestError(413, f"new_premises: more than this server's {self.limits.max_new_premises:,} (GET "
                                    f"/max-new-premises); set premiseSelection.maxUnindexedPremises to at most that, "
                                    f"or restart the server with a larger --max-new-premises")
        obj = dict(pairs)
        name, decl = obj.get("name"), obj.get("decl")
        if isinstance(name, str) and len(name) > self.limits.max_name_chars:
            raise RequestError(413, f"a new premise's name of {len(name):,} characters ({excerpt(name)}), more "
                                    f"than this server's {self.limits.max_name_chars:,}")
        if isinstance(decl, str) and len(decl) > self.limits.max_decl_chars:
            raise RequestError(413, f"new premise {excerpt(name)}: decl of {len(decl):,} characters, more than "
                                    f"this server's {self.limits.max_decl_chars:,}")
        return obj

    def integer(self, digits: str) -> int:
        self.integers += 1
        if self.integers > self.limits.max_positions:
            raise RequestError(413, f"more than {self.limits.max_positions:,} positions in one request, this "
                                    f"server's limit")
        if len(digits.lstrip("-")) > MAX_DIGITS:
            raise RequestError(422, f"an integer of {len(digits.lstrip('-')):,} digits ({excerpt(digits)}): no "
                                    f"field takes one that large")
        return int(digits)

    @staticmethod
    def constant(name: str) -> Any:
        raise RequestError(400, f"body is not JSON: {name} is not a JSON value")


def _check_unicode(payload: dict[str, Any]) -> None:
    """Every string a tokenizer would read must be Unicode text: JSON's `\\ud800` decodes to a lone surrogate,
    which UTF-8 cannot hold. Refused naming the field."""
    places: list[tuple[str, Any]] = [("state", payload.get("state"))]
    for key in ("local_premises", "imported_modules", "imported_all_modules"):
        if isinstance(payload.get(key), list):
            places += [(f"{key}[{i}]", v) for i, v in enumerate(payload[key])]
    if isinstance(payload.get("new_premises"), list):
        for i, p in enumerate(payload["new_premises"]):
            if isinstance(p, dict):
                places += [(f"new_premises[{i}].{k}", p.get(k)) for k in ("name", "decl")]
    for where, value in places:
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise RequestError(422, f"{where}: not Unicode text (a lone surrogate at character {exc.start})") \
                    from None


def parse_request(body: bytes, limits: ServeLimits) -> RetrieveRequest:
    """The request a body holds, or a `RequestError` (a 4xx with one line)."""
    budget = _Budget(limits)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(400, f"body is not UTF-8 JSON (byte {exc.start} cannot be decoded)") from None
    # Integers are counted one callback each, which costs a 76,000-position body (an old client's) a third of its
    # time: only where the body is large enough to hold more than the limit (each takes at least 2 bytes).
    integers = budget.integer if len(text) > 2 * limits.max_positions else None
    try:
        payload = json.loads(text, object_pairs_hook=budget.object_pairs, parse_int=integers,
                             parse_constant=budget.constant)
    except json.JSONDecodeError as exc:
        raise RequestError(400, f"body is not JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    except RecursionError:
        raise RequestError(400, "body nests arrays or objects deeper than this server decodes") from None
    if not isinstance(payload, dict):
        raise RequestError(422, f"body must be a JSON object with a state, found a JSON {type(payload).__name__}")
    if SURROGATE_ESCAPE.search(text):  # only then can a string hold a lone surrogate (raw ones are not UTF-8)
        _check_unicode(payload)
    try:
        return RetrieveRequest.model_validate(payload)
    except ValidationError as exc:
        raise RequestError(422, format_validation_error(exc)) from None
