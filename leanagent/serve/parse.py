"""A `/retrieve` body to a `RetrieveRequest`, with bounded work whatever the bytes.

Every limit is checked before the work it bounds, in the order of what each step costs:

1. the body's JSON values are counted in C before anything is decoded (`count_values`: commas and brackets, the
   strings taken out only when the quick count is over), so a body of twelve million positions or names is
   refused in the time of a few scans of its bytes, never built as twelve million objects;
2. while it is decoded, new premises are counted and each name and declaration checked for length as its object
   is built (the decoder calls back per object), and an integer of more than 4,300 digits (which Python refuses
   to read) is a 422;
3. the list fields are checked whole (`check_lists`): their sizes, then their entries, one error per field with
   a sample of the bad entries, before the model validates them (a million wrong entries validated one by one
   built a million errors);
4. the model (`RetrieveRequest`), each field's first error only.

Nesting too deep for the decoder, a string that is not Unicode (a lone surrogate), are each a 4xx with one line;
every message quotes at most a short prefix of what it refuses (`excerpt`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from leanagent.serve.schemas import RequestError, RetrieveRequest, ServeLimits

EXCERPT_CHARS = 40
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def excerpt(value: Any, chars: int = EXCERPT_CHARS) -> str:
    """`value` as JSON, cut to `chars` characters: what an error message may quote of a client's input."""
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else json.dumps(value[: chars + 1],
                                                                                              ensure_ascii=False)
    return text if len(text) <= chars else text[: chars - 3] + "..."


class _Budget:
    """The decoder's callbacks: count objects, check names and declarations as they are built."""

    def __init__(self, limits: ServeLimits) -> None:
        self.limits = limits
        self.objects = 0

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

    @staticmethod
    def constant(name: str) -> Any:
        raise RequestError(400, f"body is not JSON: {name} is not a JSON value")


# A JSON string, possessive (3.11+): no backtracking state per character, so a 60 MB string is one step.
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"')
VALUE_SLACK = 64  # the body's own keys, a newer client's additions
# The fields that hold positions or names, each entry counted against max_positions.
POSITION_FIELDS = ("local_premises", "imported_modules", "imported_all_modules")
SAMPLE = 3  # bad entries quoted in a field's error


def max_values(limits: ServeLimits) -> int:
    """The JSON values a body may hold: its positions and names, its new premises (an object, a name and a
    declaration each, and a spare key), and a few of its own."""
    return limits.max_positions + 4 * limits.max_new_premises + VALUE_SLACK


def count_values(text: str, limits: ServeLimits) -> int:
    """An upper bound of the JSON values in `text` (every value but the outermost is an array's element or an
    object's member, and a container of n of them holds n - 1 commas), counted in C before anything is decoded:
    over the limit, the strings are taken out and the count made exact, so commas in declarations cannot refuse a
    body that is within it. Refused with a 413 when over `max_values`."""
    limit = max_values(limits)
    bound = text.count(",") + text.count("[") + text.count("{") + 1
    if bound <= limit:
        return bound
    # At least this many: every string is a value or a key (a key's member is a value), so the values are at least
    # a quarter of the quotes that are not escaped. Refuses a body of millions of names without taking it apart
    # (one regex pass over a body at its cap holds the interpreter's lock for a large part of a second, and /health
    # waits for it).
    if (text.count('"') - text.count('\\"')) // 4 <= limit:
        bare = _STRING.sub('""', text)
        bound = bare.count(",") + bare.count("[") + bare.count("{") + 1
        if bound <= limit:
            return bound
    raise RequestError(413, f"a body of more than {limit:,} JSON values: this server takes at most "
                            f"{limits.max_positions:,} positions and names in local_premises and the module lists "
                            f"together (--max-positions) and {limits.max_new_premises:,} new premises "
                            f"(--max-new-premises)")


def _kind(value: Any) -> str:
    return "null" if value is None else {dict: "object", list: "array", str: "string", bool: "boolean",
                                         int: "integer", float: "number"}.get(type(value), type(value).__name__)


def _bad_entries(field: str, entries: list[Any], ok: Any, wanted: str) -> str | None:
    """One line for a list field whose entries `ok` refuses: how many, and the first few, each quoted short."""
    count = 0
    sample = []
    for i, entry in enumerate(entries):
        if not ok(entry):
            count += 1
            if len(sample) < SAMPLE:
                sample.append(f"[{i}] {excerpt(entry, 24)}")
    if not count:
        return None
    more = f", and {count - len(sample):,} more" if count > len(sample) else ""
    return f"{field}: {count:,} of its {len(entries):,} entries are not {wanted} ({', '.join(sample)}{more})"


def _is_position(entry: Any) -> bool:
    return type(entry) is int or type(entry) is str


def _is_new_premise(entry: Any) -> bool:
    return type(entry) is dict and type(entry.get("name")) is str and type(entry.get("decl")) is str


def check_lists(payload: dict[str, Any], limits: ServeLimits) -> None:
    """The list fields before the model sees them: their sizes against the limits, then their entries, one error
    per field with a short sample of the bad entries (validating a list of a million wrong entries one by one
    built a million errors: gigabytes, docs/measurements.md)."""
    problems = []
    positions = 0
    for field in POSITION_FIELDS:
        value = payload.get(field)
        if isinstance(value, list):
            positions += len(value)
    if positions > limits.max_positions:
        raise RequestError(413, f"{positions:,} premises and modules named, more than this server's "
                                f"{limits.max_positions:,} (--max-positions)")
    new = payload.get("new_premises")
    if isinstance(new, list) and len(new) > limits.max_new_premises:
        raise RequestError(413, f"new_premises: {len(new):,} premises, more than this server's "
                                f"{limits.max_new_premises:,} (GET /max-new-premises); set "
                                f"premiseSelection.maxUnindexedPremises to at most that, or restart the server with a "
                                f"larger --max-new-premises")
    for field in (*POSITION_FIELDS, "new_premises"):
        value = payload.get(field)
        if value is None:
            continue
        if not isinstance(value, list):
            problems.append(f"{field}: must be an array, found a JSON {_kind(value)}")
        elif field == "new_premises":
            problems.append(_bad_entries(field, value, _is_new_premise, 'objects {"name": string, "decl": string}'))
        else:
            problems.append(_bad_entries(field, value, _is_position, "positions (integers) or names (strings)"))
    problems = [p for p in problems if p]
    if problems:
        raise RequestError(422, "; ".join(problems))


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


def parse_request(body: bytes, limits: ServeLimits,
                  counted: Callable[[int, int], None] | None = None) -> RetrieveRequest:
    """The request a body holds, or a `RequestError` (a 4xx with one line). `counted(bytes, values)` is called
    once the body's values are counted, before they are decoded (the app reserves their memory there)."""
    budget = _Budget(limits)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(400, f"body is not UTF-8 JSON (byte {exc.start} cannot be decoded)") from None
    values = count_values(text, limits)
    if counted is not None:
        counted(len(body), values)
    try:
        payload = json.loads(text, object_pairs_hook=budget.object_pairs, parse_constant=budget.constant)
    except json.JSONDecodeError as exc:
        raise RequestError(400, f"body is not JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    except RecursionError:
        raise RequestError(400, "body nests arrays or objects deeper than this server decodes") from None
    except ValueError as exc:  # Python refuses to read an integer of more than 4,300 digits
        raise RequestError(422, f"an integer too large for any field ({str(exc).split(';')[0]})") from None
    if not isinstance(payload, dict):
        raise RequestError(422, f"body must be a JSON object with a state, found a JSON {_kind(payload)}")
    if SURROGATE_ESCAPE.search(text):  # only then can a string hold a lone surrogate (raw ones are not UTF-8)
        _check_unicode(payload)
    check_lists(payload, limits)
    try:
        return RetrieveRequest.model_validate(payload)
    except ValidationError as exc:
        raise RequestError(422, one_error_per_field(exc)) from None


def one_error_per_field(exc: ValidationError) -> str:
    """`field: problem; ...` with each top-level field once (its first error), however many entries it has."""
    seen: dict[str, str] = {}
    for err in exc.errors():
        loc = err["loc"]
        top = str(loc[0]) if loc else "(body)"
        if top not in seen:
            where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])
            seen[top] = f"{top}{where}: {err['msg']}"
    return "; ".join(seen.values())
