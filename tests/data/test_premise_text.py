"""A premise's text, name tagged: the regex reference's output byte for byte, and work linear in the name and the
code whatever their shape (a server serializes the names and declarations it is sent).

Work is counted, not timed: the Python lines executed and the C functions called, under `sys.settrace` and
`sys.setprofile`. The C functions the tagging calls (`split`, `sorted`, `bisect_left`, one `re.sub`) are each
linear in their input (the sort n log n); the reference calls one regex pass over the code per suffix of the name,
and the code it replaced one `str.find` per occurrence.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable

from data_helpers import reference_serialize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leanagent.data.premise_text import serialize_premise

# Components and pieces of code that make the suffix search hard: repeats, «», whitespace inside names, dots.
COMPONENTS = ["a", "b", "ab", "a_b", "«a b»", "«a»", "", "a b", "x", "«", "»", "_root_", "aa"]
PIECES = [" ", "\n", "\u2003", "\u00a0", "a", "b", ".", "«", "»", "x", "\\", "(", "theorem ", "a.", "«a", "a»"]
FUZZ = settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def name_and_code(draw: st.DrawFn, max_parts: int = 12, max_pieces: int = 40) -> tuple[str, str]:
    name = ".".join(draw(st.lists(st.sampled_from(COMPONENTS), min_size=1, max_size=max_parts)))
    suffixes = [name[m.end():] for m in re.finditer(r"\.", name)] + [name]
    pieces = st.one_of(st.sampled_from(PIECES), st.sampled_from(suffixes), st.text(max_size=3))
    return name, "".join(draw(st.lists(pieces, max_size=max_pieces)))


@FUZZ
@given(name_and_code())
def test_premise_text_equals_the_regex_reference(case: tuple[str, str]) -> None:
    name, code = case
    assert serialize_premise(name, code) == reference_serialize(name, code)


def work(fn: Callable[[], object]) -> int:
    """Python lines executed plus C functions called while `fn` runs (deterministic, unlike its time)."""
    count = 0

    def line(frame, event, arg):  # noqa: ANN001, ANN202
        nonlocal count
        if event == "line":
            count += 1
        return line

    def calls(frame, event, arg) -> None:  # noqa: ANN001
        nonlocal count
        if event == "c_call":
            count += 1

    sys.settrace(line)
    sys.setprofile(calls)
    try:
        fn()
    finally:
        sys.settrace(None)
        sys.setprofile(None)
    return count


# Adversarial shapes at the server's limits' scale (a name of up to 1,023 characters), the code cut to 20,000
# characters to keep tracing quick: (a name's unit, how many parts, the code's unit).
SHAPES = [
    ("a", 512, "a."),            # many parts, the code one long word of the name's pieces: every suffix occurs
    ("a", 512, " a."),           # the same with whitespace everywhere: every suffix occurs after whitespace
    ("ab", 300, "ab.ab.ab"),     # no whitespace at all
    ("«a»", 200, " «a».«a»"),    # guillemets
    ("a b", 256, "a b."),        # whitespace inside the name: the one-pass match lengths
    ("a b", 256, " a b."),
]


@settings(max_examples=12, deadline=None, derandomize=True)
@given(st.sampled_from(SHAPES), st.sampled_from([5_000, 20_000]))
def test_premise_text_work_is_linear_in_the_name_and_the_code(shape: tuple[str, int, str], size: int) -> None:
    unit, parts, code_unit = shape
    name = ".".join([unit] * parts)[:1023]
    code = (code_unit * (size // len(code_unit) + 1))[:size]
    steps = work(lambda: serialize_premise(name, code))
    half = work(lambda: serialize_premise(name, code[: size // 2]))
    # Linear: a few steps per character at most (the code this replaced took 12.6 million for the first shape at
    # 5,000 characters, 55 million at 20,000), and twice the code costs at most about twice the work.
    assert steps <= 25 * (len(name) + len(code)) + 10_000, (shape, size, steps)
    assert steps <= 2.2 * half + 10_000, (shape, size, steps, half)
