"""A small, learnable LeanDojo-format dataset generator for tests and the demo.

Every premise states a lemma about made-up function symbols (``glim``, ``frob``) and every proof
state that uses it shows the lemma's left-hand side, so a byte-level retriever can learn the
match from shared substrings within a CPU epoch or two. Repositories share one core library
file, import their own files in a DAG, and differ in how many short proofs they have, so the
curriculum order is not simply the repository order.

With a `dependency` (a `ScaleSpec`), every repository also carries one shared dependency, as LeanAgent's
repositories nearly all carry Mathlib: the same files, byte for byte, under `.lake/packages/NAME/` in every
corpus (mathlib-shaped: `synthetic_scale.py`), of which each repository's first file imports a few (so it sees
their import closure, a part of the dependency); a share of its tactics use those premises, each state showing
a few words of the premise it needs, beside its own lemmas. Its theorems stay its own.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from leanagent.data.synthetic_scale import MATHLIB_SCALE, Decl, ScaleFiles, ScaleSpec, decl_annotation, scale_files
from leanagent.ground.names import CORPUS_FILE, DEFAULT_SPLIT, TEST_PART, TRAIN_PART, VAL_PART, part_file

_LAKE_PACKAGES = ".lake/packages/"
CORE_PATH = f"{_LAKE_PACKAGES}core/Core/Basic.lean"
CORE_UNARY = ("frob", "zark", "quon")
CORE_BINARY = ("blix",)
_ONSETS = ("gl", "tr", "sn", "pl", "vr", "kw", "dr", "fl", "sk", "br", "gr", "st", "cl", "pr", "sm", "th")
_VOWELS = ("a", "e", "i", "o", "u", "y")
_CODAS = ("m", "x", "nd", "rk", "v", "sp", "lt", "g", "mp", "z")
_VARS = ("x", "y", "n", "m")
_SHORT_FRACTIONS = (0.45, 0.1, 0.3, 0.2, 0.4, 0.05, 0.35, 0.15)  # mean < 1/3, so p33 separates one-step proofs
_HYPS = "x y n m : Nat\n"
DEPENDENCY_IMPORTS = 3  # dependency files each repository's first file imports (it sees their import closures)
DEPENDENCY_SHARE = 0.3  # of a repository's rewriting steps, those that use a dependency premise
# The shared dependency's sizes `leanagent demo-data --shared-dependency` offers: a test-size one, and one as large as
# `--mathlib-scale` (Mathlib's order of magnitude).
DEPENDENCY_SIZES = {"small": ScaleSpec(files=60, premises=1500), "mathlib": MATHLIB_SCALE}


@dataclass
class _Lemma:
    """A premise; `lhs`/`rhs` are templates over ``{a}`` and ``{b}`` so states can rename variables."""

    name: str
    params: str
    lhs: str
    rhs: str
    path: str = ""
    start: tuple[int, int] = (0, 0)
    end: tuple[int, int] = (0, 0)

    @property
    def code_lines(self) -> list[str]:
        return [f"theorem {self.name}{self.params} :", f"    {self.lhs} = {self.rhs}".format(a="a", b="b")]

    def premise(self) -> dict[str, Any]:
        return {
            "full_name": self.name,
            "code": "\n".join(self.code_lines),
            "start": list(self.start),
            "end": list(self.end),
            "kind": "commonTheorem",
        }

    def annotation(self) -> dict[str, Any]:
        col = self.start[1] + len("theorem ")
        return {
            "full_name": self.name,
            "def_path": self.path,
            "def_pos": [self.start[0], col],
            "def_end_pos": [self.start[0], col + len(self.name)],
        }

    def instance(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.sample(_VARS, 2)
        return self.lhs.format(a=a, b=b), self.rhs.format(a=a, b=b)


@dataclass
class _File:
    path: str
    imports: list[str]
    unary: list[str]
    binary: list[str]
    lemmas: list[_Lemma] = field(default_factory=list)


def _lemmas_for(ns: str, unary: list[str], binary: list[str], visible: list[str], rng: random.Random) -> list[_Lemma]:
    """Lemmas introducing each new symbol, some relating it to symbols the file can already see."""
    out: list[_Lemma] = []
    for f in unary:
        out.append(_Lemma(f"{ns}.{f}_zero", "", f"{f} 0", "0"))
        others = [g for g in visible + unary if g != f]
        for g in rng.sample(others, min(3, len(others))):
            out.append(_Lemma(f"{ns}.{f}_{g}", " (a : Nat)", f"{f} ({g} {{a}})", f"{g} ({f} {{a}})"))
    for h in binary:
        out.append(_Lemma(f"{ns}.{h}_comm", " (a b : Nat)", f"{h} {{a}} {{b}}", f"{h} {{b}} {{a}}"))
        pool = visible + unary
        for f in rng.sample(pool, min(2, len(pool))):
            out.append(_Lemma(f"{ns}.{h}_{f}", " (a b : Nat)", f"{h} ({f} {{a}}) {{b}}", f"{f} ({h} {{a}} {{b}})"))
    return out


class _Namer:
    """Pronounceable, globally unique symbols, so no two repositories share a lemma by accident."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used = set(CORE_UNARY + CORE_BINARY)

    def symbol(self) -> str:
        while True:
            s = self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) + self.rng.choice(_CODAS)
            if s not in self.used:
                self.used.add(s)
                return s


def _place(file: _File, start_line: int, slots: list[int], lengths: list[int]) -> list[tuple[int, int]]:
    """Give lemmas real positions and return the (start, end) line of each theorem, in `slots` order.

    A theorem in slot s sits after the file's first s lemmas, which is exactly its in-file accessible set.
    """
    line = start_line
    spans: dict[int, tuple[int, int]] = {}
    order = sorted(range(len(slots)), key=lambda t: slots[t])
    t = 0
    for j in range(len(file.lemmas) + 1):
        while t < len(order) and slots[order[t]] == j:
            n = lengths[order[t]]
            spans[order[t]] = (line, line + n + 1)
            line += n + 3
            t += 1
        if j < len(file.lemmas):
            lemma = file.lemmas[j]
            lemma.path = file.path
            lemma.start = (line, 1)
            lemma.end = (line + 1, len(lemma.code_lines[1]) + 1)
            line += 3
    return [spans[k] for k in range(len(slots))]


def _rewrite_step(lemmas: list[_Lemma], rng: random.Random) -> tuple[str, str, str, list[dict[str, Any]]]:
    """(goal, tactic, annotated tactic, annotations) for a step that rewrites with `lemmas`."""
    sides = [lem.instance(rng) for lem in lemmas]
    goal = " + ".join(lhs for lhs, _ in sides) + " = " + " + ".join(rhs for _, rhs in sides)
    names = [lem.name for lem in lemmas]
    verb = "rw" if len(lemmas) == 1 else "simp only"
    tactic = f"{verb} [{', '.join(names)}]"
    annotated = f"{verb} [{', '.join(f'<a>{n}</a>' for n in names)}]"
    return goal, tactic, annotated, [lem.annotation() for lem in lemmas]


def _tactic(before: str, tactic: str, annotated: str, annotations: list[dict[str, Any]]) -> dict[str, Any]:
    return {"tactic": tactic, "annotated_tactic": [annotated, annotations], "state_before": before, "state_after": ""}


def _dependency_step(choice: tuple[str, Decl], rng: random.Random) -> tuple[str, str, str, list[dict[str, Any]]]:
    """(goal, tactic, annotated tactic, annotations) for a step that uses one premise of the dependency: the goal
    shows the first words of its statement, as a goal shows the constants of the lemma that rewrites it."""
    path, decl = choice
    name = decl.full_name.rsplit(".", 1)[1]
    return (" ".join(decl.hint), f"simp [{name}]", f"simp [<a>{name}</a>]", [decl_annotation(path, decl, rng)])


def _proof(
    accessible: list[_Lemma], own: list[_Lemma], length: int, multi_goal: bool, rng: random.Random,
    dependency: list[tuple[str, Decl]] | None = None,
) -> tuple[list[dict[str, Any]], str]:
    """Traced tactics of one theorem and its statement; each step's state shows the lemmas it needs. With
    `dependency` (the premises of the shared dependency the theorem can see), a share of the steps use one."""

    def pick() -> list[_Lemma]:
        pool = own if own and rng.random() < 0.7 else accessible
        k = 2 if rng.random() < 0.3 and len(pool) >= 2 else 1
        return rng.sample(pool, k)

    def step() -> tuple[str, str, str, list[dict[str, Any]]]:
        if dependency and rng.random() < DEPENDENCY_SHARE:
            return _dependency_step(rng.choice(dependency), rng)
        return _rewrite_step(pick(), rng)

    tactics: list[dict[str, Any]] = []
    if multi_goal:
        g1, t1, a1, n1 = step()
        g2, t2, a2, n2 = step()
        statement = f"({g1}) ∧ ({g2})"
        tactics.append(_tactic(f"{_HYPS}⊢ {statement}", "constructor", "constructor", []))
        tactics.append(_tactic(f"2 goals\n{_HYPS}⊢ {g1}\n\n{_HYPS}⊢ {g2}", f"· {t1}", f"· {a1}", n1))
        tactics.append(_tactic(f"{_HYPS}⊢ {g2}", t2, a2, n2))
    else:
        steps = [step() for _ in range(length)]
        statement = steps[0][0]
        if length > 1 and rng.random() < 0.3:
            tactics.append(_tactic(f"⊢ ∀ (x y n m : Nat), {statement}", "intro x y n m", "intro x y n m", []))
        for goal, tactic, annotated, annotations in steps:
            tactics.append(_tactic(f"{_HYPS}⊢ {goal}", tactic, annotated, annotations))
    for before, after in zip(tactics, tactics[1:], strict=False):
        before["state_after"] = after["state_before"]
    tactics[-1]["state_after"] = "no goals"
    return tactics, statement


def _repo_theorems(
    ns: str, index: int, files: list[_File], core: _File, count: int, short: float, seed: int, rng: random.Random,
    dependency: list[tuple[str, Decl]] | None = None,
) -> list[dict[str, Any]]:
    shares = (0.25, 0.35, 0.40)
    per_file = [round(count * s) for s in shares[:-1]]
    per_file.append(count - sum(per_file))
    commit = hashlib.sha1(f"{seed}-{index}".encode()).hexdigest()
    theorems: list[dict[str, Any]] = []
    visible = list(core.lemmas)
    for f_idx, (file, n) in enumerate(zip(files, per_file, strict=True)):
        slots = [rng.randint(0, len(file.lemmas)) for _ in range(n)]
        if f_idx == 0 and slots:
            slots[0] = 0  # the first theorem of the first file sees only the core library
        lengths = [1 if rng.random() < short else rng.randint(2, 5) for _ in range(n)]
        multi = 1 if f_idx == len(files) - 1 and n > 1 else -1  # one "2 goals" proof per repository
        no_tactics = {k for k in range(n) if rng.random() < 0.1 and k not in (0, multi)}
        tactic_counts = [0 if k in no_tactics else (3 if k == multi else lengths[k] + 1) for k in range(n)]
        spans = _place(file, 4 + len(file.imports), slots, tactic_counts)
        for k in range(n):
            accessible = visible + file.lemmas[: slots[k]]
            own = [lem for lem in accessible if not lem.name.startswith("Core.")]
            tactics, statement = _proof(accessible, own, lengths[k], k == multi, rng, dependency)
            name = f"{ns}.demo_{len(theorems)}"
            start, end = spans[k]
            theorems.append(
                {
                    "url": f"https://github.com/leanagent-demo/repo_{index}",
                    "commit": commit,
                    "file_path": file.path,
                    "full_name": name,
                    "theorem_statement": f"theorem {name} : ∀ (x y n m : Nat), {statement} := by",
                    "start": [start, 1],
                    "end": [end, 20],
                    "traced_tactics": [] if k in no_tactics else tactics,
                }
            )
        visible = visible + file.lemmas
    return theorems


def _write_dataset(out: Path, files: list[_File], theorems: list[dict[str, Any]], rng: random.Random,
                   dependency_lines: list[str] | None = None) -> None:
    """`dependency_lines`: the shared dependency's corpus lines, written as they are after the `.lake` files."""
    out.mkdir(parents=True, exist_ok=True)
    lake = [f for f in files if f.path.startswith(".lake/")] if dependency_lines else files
    with open(out / CORPUS_FILE, "w", encoding="utf-8") as fh:
        for f in lake:
            record = {"path": f.path, "imports": f.imports, "premises": [lem.premise() for lem in f.lemmas]}
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")
        for line in dependency_lines or ():
            fh.write(line + "\n")
        for f in (files if dependency_lines else []):
            if f not in lake:
                record = {"path": f.path, "imports": f.imports, "premises": [lem.premise() for lem in f.lemmas]}
                fh.write(json.dumps(record, ensure_ascii=False) + "\n")
    shuffled = list(theorems)
    rng.shuffle(shuffled)
    n_train, n_val = round(0.7 * len(shuffled)), round(0.15 * len(shuffled))
    parts = {
        TRAIN_PART: shuffled[:n_train],
        VAL_PART: shuffled[n_train : n_train + n_val],
        TEST_PART: shuffled[n_train + n_val :],
    }
    (out / DEFAULT_SPLIT).mkdir(exist_ok=True)
    for name, part in parts.items():
        text = json.dumps(part, ensure_ascii=False, indent=1)
        (out / DEFAULT_SPLIT / part_file(name)).write_text(text, encoding="utf-8")


def _repo_namespace(i: int) -> str:
    return f"Repo{chr(ord('A') + i)}" if i < 26 else f"Repo{i}"


def write_demo_repos(out: Path, num_repos: int, seed: int = 0, theorems_per_repo: int = 40,
                     scale: int = 1, dependency: ScaleSpec | None = None,
                     dependency_name: str = "mathlib") -> list[Path]:
    """Write `num_repos` complete LeanDojo datasets ``out/repo_{i}``; identical output for identical arguments.

    `scale` multiplies the function symbols (and so the premises) of each repository's files: a larger
    corpus makes retrieval harder for an untrained encoder, so training visibly helps. `dependency`: every
    repository carries this shared dependency under `.lake/packages/{dependency_name}/` (the module docstring).
    """
    out = Path(out)
    master = random.Random(seed)
    namer = _Namer(master)
    core = _core_file(random.Random(f"core-{seed}"))
    _place(core, 1, [], [])
    fractions = list(_SHORT_FRACTIONS)
    master.shuffle(fractions)
    shared = _dependency(dependency, dependency_name) if dependency is not None else None
    lines = shared.corpus_lines() if shared is not None else None
    dirs = []
    for i in range(num_repos):
        rng = random.Random(f"repo-{seed}-{i}")
        ns = _repo_namespace(i)
        files = _repo_files(ns, namer, rng, scale)
        seen = _import_dependency(files[0], shared, random.Random(f"imports-{seed}-{i}")) if shared else None
        theorems = _repo_theorems(ns, i, files, core, theorems_per_repo, fractions[i % len(fractions)], seed, rng,
                                  seen)
        target = out / f"repo_{i}"
        _write_dataset(target, [core, *files], theorems, rng, lines)
        dirs.append(target)
    return dirs


def _dependency(spec: ScaleSpec, name: str) -> ScaleFiles:
    """The shared dependency's files, under `.lake/packages/NAME/Name/` (drawn from `spec.seed` alone)."""
    rng = random.Random(f"dependency-{spec.seed}")
    return scale_files(spec, rng, np.random.default_rng([spec.seed, 2]),
                       root=f"{_LAKE_PACKAGES}{name}/{name[:1].upper()}{name[1:]}/")


def _import_dependency(first: _File, dependency: ScaleFiles, rng: random.Random) -> list[tuple[str, Decl]]:
    """`first` (a repository's first file, which the others import) imports DEPENDENCY_IMPORTS files of the
    dependency; the premises it sees through them, (path, declaration) each."""
    picked = sorted(rng.sample(range(len(dependency.paths)), min(DEPENDENCY_IMPORTS, len(dependency.paths))))
    first.imports = first.imports + [dependency.paths[t] for t in picked]
    return [(dependency.paths[t], d) for t in dependency.closure(picked) for d in dependency.decls[t]]


def _core_file(rng: random.Random) -> _File:
    core = _File(CORE_PATH, [], list(CORE_UNARY), list(CORE_BINARY))
    core.lemmas = _lemmas_for("Core", core.unary, core.binary, [], rng)
    return core


def _repo_files(ns: str, namer: _Namer, rng: random.Random, scale: int = 1) -> list[_File]:
    """Base imports the core library, Ext imports Base, Main imports Ext and the core again (a DAG)."""

    def symbols(n: int) -> list[str]:
        return [namer.symbol() for _ in range(n * scale)]

    base = _File(f"{ns}/Base.lean", [CORE_PATH], symbols(2), symbols(1))
    ext = _File(f"{ns}/Ext.lean", [base.path], symbols(2), [])
    main = _File(f"{ns}/Main.lean", [ext.path, CORE_PATH], symbols(1), symbols(1))
    visible = list(CORE_UNARY)
    for f in (base, ext, main):
        f.lemmas = _lemmas_for(ns, f.unary, f.binary, visible, rng)
        visible = visible + f.unary
    return [base, ext, main]
