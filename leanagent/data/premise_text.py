"""The text the retriever encodes for a premise: its code, with its own name tagged where it is declared."""

from __future__ import annotations

import re
from bisect import bisect_left

MARK_START, MARK_END = "<a>", "</a>"
_EMPTY_SUFFIX = re.compile(r"(?<=\s)«?»?")


def serialize_premise(full_name: str, code: str) -> str:
    """The text the retriever encodes: the code with the premise's own name tagged where it is declared.

    LeanDojo, ReProver and LeanAgent tag the name *inside* the code (``protected theorem
    <a>Nat.add_comm</a> : ...``), and the published retrievers were trained on that text, so we
    produce it byte for byte: first ``_root_.NAME`` is tagged; then the longest dotted suffix of
    the name (the whole name, then without its first component, ...) that occurs after whitespace,
    optionally in «guillemets», is tagged at every such occurrence, and the search stops there.
    The replacement is literal (the reference passes it as a regex template, which would
    misread a backslash in a «name»).

    Why not as the reference does it: it searches the code once per suffix, and a server is sent names and code
    (a name of 512 parts and a 100,000-character declaration took tens of seconds of CPU: docs/measurements.md).
    Here the work is linear in the name and the code whatever their shape. A premise of a corpus is settled by a few
    `str.find`s (`_tag_found`); past `FIND_BUDGET` of them, a name without whitespace is settled by the code's words
    (`_longest_after_space`: a sort and a binary search per suffix) and one regex pass, and a name with whitespace
    by one pass over the code that finds every suffix's occurrences at once (`_suffix_match_lengths`).
    """
    tagged = f"{MARK_START}{full_name}{MARK_END}"
    code = code.replace(f"_root_.{full_name}", tagged)
    # Suffix i is the name from `starts[i]` on: after every ".", as the reference's `split(".")` cuts it.
    starts = [0, *(m.end() for m in re.finditer(r"\.", full_name))]
    if not any(c.isspace() for c in full_name):
        found = _tag_found(full_name, starts, code, tagged)
        if found is not None:
            return found
        chosen = _longest_after_space(full_name, starts, code)
        if chosen is None:
            return code
        suffix = full_name[starts[chosen]:]
        if not suffix:
            return _EMPTY_SUFFIX.sub(lambda _: tagged, code)
        if "«" not in suffix and "»" not in suffix:
            tagged_code, _ = _tag_words(code, suffix, tagged, FIND_BUDGET)
            if tagged_code is not None:
                return tagged_code
        # Linear: the literal holds no whitespace, so a comparison begun after a space stops at the next one.
        return re.sub(r"(?<=\s)«?" + re.escape(suffix) + "»?", lambda _: tagged, code)
    ends = _suffix_match_lengths(full_name, code)
    chosen = _longest_by_ends(full_name, starts, code, ends)
    if chosen is None:
        return code
    if starts[chosen] == len(full_name):
        return _EMPTY_SUFFIX.sub(lambda _: tagged, code)
    return _tag_by_ends(code, len(full_name) - starts[chosen], ends, tagged)


FIND_BUDGET = 32  # `str.find` calls a premise's tagging makes before it takes the paths linear in any shape


def _tag_found(full_name: str, starts: list[int], code: str, tagged: str) -> str | None:
    """The reference's loop over suffixes, longest first, each searched with `str.find` (far cheaper than
    compiling a pattern per premise, and a corpus is serialized whole): the tagged code, or None once
    `FIND_BUDGET` searches did not settle it (or a suffix is empty or holds «»: the regex's alone, its «? may
    take the suffix's own «)."""
    budget = FIND_BUDGET
    for start in starts:
        suffix = full_name[start:]
        if not suffix or "«" in suffix or "»" in suffix:
            return None
        result, budget = _tag_words(code, suffix, tagged, budget)
        if result is None:
            return None
        if result is not code:
            return result
    return code


def _tag_words(code: str, suffix: str, tagged: str, budget: int) -> tuple[str | None, int]:
    r"""``re.sub(r"(?<=\s)«?" + re.escape(suffix) + "»?", tagged, code)`` for a non-empty `suffix` without
    whitespace or «», by `str.find`, and the budget of searches left; None for the code when it ran out. The code
    itself (the same object) when the suffix does not occur after whitespace."""
    out: list[str] = []
    last = pos = 0
    while budget > 0:
        budget -= 1
        j = code.find(suffix, pos)
        if j < 0:
            if not out:
                return code, budget
            out.append(code[last:])
            return "".join(out), budget
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
        out += [code[last:start], tagged]
        last = pos = end
    return None, 0


def _longest_after_space(full_name: str, starts: list[int], code: str) -> int | None:
    """The first (longest) suffix of a name without whitespace that occurs after whitespace in `code`, optionally
    after a «: such an occurrence is a prefix of a word that follows whitespace (or of that word without its
    leading «). So the words are sorted once and each suffix is one binary search: O(n log n) in C for the code,
    O(k log n) comparisons for the k suffixes, none of them a scan of the code."""
    words = code.split()
    if words and not code[:1].isspace():
        words = words[1:]  # the code's first word follows nothing
    candidates = sorted({*words, *(w[1:] for w in words if w.startswith("«"))})
    for i, start in enumerate(starts):
        suffix = full_name[start:]
        if not suffix:  # the empty suffix (a name ending in "."): the regex matches after any whitespace
            return i if _EMPTY_SUFFIX.search(code) else None
        j = bisect_left(candidates, suffix)
        if j < len(candidates) and candidates[j].startswith(suffix):
            return i
    return None


def _suffix_match_lengths(name: str, code: str) -> list[int]:
    """ends[q] for q in 0..len(code): the length of the longest common suffix of code[:q] and the name, in one
    pass (the Z-algorithm over both strings reversed), O(len(name) + len(code))."""
    pattern, text = name[::-1], code[::-1]
    m, n = len(pattern), len(text)
    z = [m] + [0] * max(m - 1, 0)
    left = right = 0
    for i in range(1, m):
        k = min(z[i - left], right - i) if i < right else 0
        while i + k < m and pattern[k] == pattern[i + k]:
            k += 1
        z[i] = k
        if i + k > right:
            left, right = i, i + k
    ext = [0] * n
    left = right = 0
    for i in range(n):
        if i < right and z[i - left] < right - i:
            ext[i] = z[i - left]
            continue
        k = max(0, right - i)
        while k < m and i + k < n and text[i + k] == pattern[k]:
            k += 1
        ext[i] = k
        if k:
            left, right = i, i + k
    return [0, *reversed(ext)]


def _after_space(code: str, start: int) -> bool:
    """Whether a match of `(?<=\\s)«?` may begin its suffix at `start`."""
    return (start >= 1 and code[start - 1].isspace()) or (
        start >= 2 and code[start - 1] == "«" and code[start - 2].isspace())


def _longest_by_ends(full_name: str, starts: list[int], code: str, ends: list[int]) -> int | None:
    """The first suffix that occurs after whitespace, from the match lengths: a suffix shorter than the longest
    match ending at q is preceded there by the name's own "." (neither whitespace nor «), so at each end only the
    suffix of exactly that length can count. One pass over the ends."""
    index = {len(full_name) - start: i for i, start in enumerate(starts) if start < len(full_name)}
    best = None
    for q, length in enumerate(ends):
        i = index.get(length)
        if i is not None and (best is None or i < best) and _after_space(code, q - length):
            best = i
    if best is None and starts[-1] == len(full_name) and _EMPTY_SUFFIX.search(code):
        return len(starts) - 1
    return best


def _tag_by_ends(code: str, length: int, ends: list[int], tagged: str) -> str:
    """`re.sub(r"(?<=\\s)«?SUFFIX»?", tagged, code)` for the suffix of `length` characters, its occurrences read
    from the match lengths (a literal holding whitespace could make the regex compare it at every space):
    left to right, without overlap, a « before it taken when whitespace precedes the «, a » after it taken."""
    begins: dict[int, int] = {}  # where a match begins -> where its suffix begins
    for q, n in enumerate(ends):
        if n < length:
            continue
        y = q - length
        if y >= 2 and code[y - 1] == "«" and code[y - 2].isspace():
            begins[y - 1] = y  # the regex's «? is greedy: at one beginning it takes the « first
        elif y >= 1 and code[y - 1].isspace():
            begins.setdefault(y, y)
    out: list[str] = []
    last = 0
    for begin in sorted(begins):
        if begin < last:
            continue
        end = begins[begin] + length
        if end < len(code) and code[end] == "»":
            end += 1
        out += [code[last:begin], tagged]
        last = end
    if not out:
        return code
    out.append(code[last:])
    return "".join(out)
