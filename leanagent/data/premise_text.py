"""The text the retriever encodes for a premise: its code, with its own name tagged where it is declared."""

from __future__ import annotations

import re

MARK_START, MARK_END = "<a>", "</a>"


def serialize_premise(full_name: str, code: str) -> str:
    """The text the retriever encodes: the code with the premise's own name tagged where it is declared.

    LeanDojo, ReProver and LeanAgent tag the name *inside* the code (``protected theorem
    <a>Nat.add_comm</a> : ...``), and the published retrievers were trained on that text, so we
    produce it byte for byte: first ``_root_.NAME`` is tagged; then the longest dotted suffix of
    the name (the whole name, then without its first component, ...) that occurs after whitespace,
    optionally in «guillemets», is tagged at every such occurrence, and the search stops there.
    The replacement is literal (the reference passes it as a regex template, which would
    misread a backslash in a «name»). The work is linear in the name's length (a server serializes names it is
    sent), so the suffixes are found by their offsets, not joined one by one.
    """
    tagged = f"{MARK_START}{full_name}{MARK_END}"
    code = code.replace(f"_root_.{full_name}", tagged)
    # The dotted suffixes, longest first, are the name from each component's start on. Linear in the name: a suffix
    # is sliced only once it fits in the code, and since a suffix occurs only if every shorter one does, the longest
    # that occurs at all is found by bisection; the ones before it cannot be tagged and are never built.
    starts = [0, *(k + 1 for k, c in enumerate(full_name) if c == ".")]
    first = next((i for i, start in enumerate(starts) if len(full_name) - start <= len(code)), len(starts))
    lo, hi = first, len(starts)
    while lo < hi:
        mid = (lo + hi) // 2
        if full_name[starts[mid]:] in code:
            hi = mid
        else:
            lo = mid + 1
    for start in starts[lo:]:
        suffix = full_name[start:]
        if suffix and "«" not in suffix and "»" not in suffix:
            new_code = _tag_after_space(code, suffix, tagged)
        else:  # the regex's own backtracking over «» in the name, or empty matches: ask the regex
            pattern = re.compile(r"(?<=\s)«?" + re.escape(suffix) + "»?")
            new_code = pattern.sub(lambda _: tagged, code)
        if new_code != code:
            return new_code
    return code


def _tag_after_space(code: str, suffix: str, tagged: str) -> str:
    r"""``re.sub(r"(?<=\s)«?" + re.escape(suffix) + "»?", tagged, code)`` for a non-empty `suffix` without «»,
    by `str.find` (compiling a pattern per premise costs more than the rest of the data path).

    The regex matches, left to right and without overlap, an occurrence preceded by whitespace (``\s`` is
    `str.isspace`) or by « that is itself preceded by whitespace, and takes a following ».
    """
    out: list[str] = []
    last = pos = 0
    while True:
        j = code.find(suffix, pos)
        if j < 0:
            break
        if j >= 1 and code[j - 1] == "«":
            start = j - 1
            ok = start >= pos and start >= 1 and code[start - 1].isspace()
        else:
            start = j
            ok = j >= 1 and code[j - 1].isspace()
        if not ok:
            pos = j + 1
            continue
        end = j + len(suffix)
        if end < len(code) and code[end] == "»":
            end += 1
        out.append(code[last:start])
        out.append(tagged)
        last = pos = end
    if not out:
        return code
    out.append(code[last:])
    return "".join(out)
