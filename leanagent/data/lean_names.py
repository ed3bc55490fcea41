"""Lean's names for what an index holds: a corpus file's module, and a premise's name as `Name.toString` writes it.

The client reads both back with Lean's own parsers (`FromJson Name`), and caches the lists for its whole
process, so one badly written name would make it reject a whole reply.
"""

from __future__ import annotations

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
