"""A mathlib-size LeanDojo-format dataset, for measuring the data path (not for learning anything).

`write_demo_repos` (``synthetic.py``) writes small, learnable repositories; this module writes ONE
dataset with the shape that makes a real corpus expensive: thousands of files, tens of thousands of
premises, an import DAG whose longest chain is hundreds of files deep (so most files import most of
the corpus), premise code with a long tail of lengths (most a few hundred bytes, some many
kilobytes, multi-byte Unicode throughout), and code that declares its own name, so the premise
text is tagged (``theorem <a>Ns.foo_bar</a> ...``) as in LeanDojo.

Layout, as LeanDojo writes it: the files' topological order is *not* the corpus order (records are
sorted by path, the first tenth of the DAG lives under ``.lake/packages/``), every theorem is also
a premise of its file, and annotations point at premises by position (``def_pos`` on the declared
name, inside the premise's span) in the theorem's own file before it or in a file it imports.
Everything is drawn from one seed: the same arguments write the same bytes.

By default nothing in a proof state says which premises its tactic uses, so a retriever can learn nothing
from it. For comparing training recipes at this scale, `ScaleSpec.hinted` makes each state show a few
consecutive words of every premise its tactic uses (as a real goal shows the constants of the lemma that
rewrites it), and `ScaleSpec.state_lengths` draws each state's length in bytes from given ones (real
minif2f states', say), with filler words around the hints. Both off, the bytes are those of before.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from leanagent.ground.names import CORPUS_FILE, DEFAULT_SPLIT, TEST_PART, TRAIN_PART, VAL_PART, part_file

LAKE_ROOT = ".lake/packages/lean4/src/lean/"
_ONSETS = ("b", "c", "d", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "pr", "r", "s", "st", "t", "tr", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou")
_CODAS = ("", "n", "r", "s", "l", "m", "x", "nd", "rt", "ck")
_DIRS = ("Algebra", "Analysis", "CategoryTheory", "Combinatorics", "Data", "Geometry", "GroupTheory",
         "LinearAlgebra", "Logic", "MeasureTheory", "NumberTheory", "Order", "RingTheory", "SetTheory",
         "Topology", "Probability", "FieldTheory", "Dynamics", "ModelTheory", "Computability")
_SUBDIRS = ("Basic", "Defs", "Lemmas", "Order", "Group", "Ring", "Module", "Field", "Hom", "Instances",
            "Finset", "List", "Nat", "Int", "Real", "Set", "Filter", "Monoid", "Ideal", "Polynomial")
_SYMBOLS = ("=", "+", "*", "≤", "<", "→", "↔", "∀", "∃", "ℕ", "ℝ", "(", ")", "⟨", "⟩", ":", ",", "fun", "=>",
            "·", "∘", "∈", "⊆", "∑", "⁻¹", "|", "^", "0", "1", "2", "x", "y", "a", "b", "n", "s", "f", "g",
            "simp", "rw", "exact", "intro", "at", "apply", "refine", "obtain", "with", "have", "by", "show")
_KEYWORDS = ("theorem", "theorem", "theorem", "lemma", "def", "instance", "abbrev", "structure")
_KINDS = {"theorem": "commonTheorem", "lemma": "commonTheorem", "def": "definition", "instance": "instance",
          "abbrev": "definition", "structure": "structure"}
_ATTRIBUTES = ("@[simp]\n", "@[to_additive]\n", "@[simp, norm_cast]\n", "@[ext]\n")
_HYPS = ("α : Type u_1", "inst✝ : Group α", "s t : Set α", "n m : ℕ", "f : α → β", "hx : x ∈ s", "h : a ≤ b")
WORDS_PER_LINE = 12
HINT_WORDS = 4


@dataclass(frozen=True)
class ScaleSpec:
    """How big: `files` corpus files, `premises` premises in all, `theorems` theorems (default premises // 16)."""

    files: int = 2000
    premises: int = 76000
    theorems: int | None = None
    seed: int = 0
    hinted: bool = False  # each state shows HINT_WORDS consecutive words of each premise its tactic uses
    state_lengths: tuple[int, ...] = ()  # bytes; when given, each state is filled to one drawn from these
    eval_share: float = 0.05  # of the theorems, in val and again in test

    def __post_init__(self) -> None:
        if self.files < 2 or self.premises < self.files:
            raise ValueError(f"need at least 2 files and one premise per file, got {self.files} files "
                             f"and {self.premises} premises")
        if not 0 < self.eval_share < 0.5:
            raise ValueError(f"eval_share must be between 0 and 0.5, got {self.eval_share}")
        if self.theorems is not None and self.theorems < 3:
            raise ValueError(f"need at least 3 theorems (one per split), got {self.theorems}")

    @property
    def num_theorems(self) -> int:
        return self.theorems if self.theorems is not None else max(3, self.premises // 16)


MATHLIB_SCALE = ScaleSpec()


@dataclass
class Decl:
    full_name: str
    code: str
    kind: str
    start: tuple[int, int]
    end: tuple[int, int]
    name_pos: tuple[int, int]  # where the declared name starts: annotations point here
    name_len: int
    hint: tuple[str, ...]  # the first words of its statement: what a goal it rewrites shows (`ScaleSpec.hinted`)


def _word(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(parts))


def _syllable_namer(rng: random.Random):
    """Distinct pronounceable words (file stems must not collide)."""
    used: set[str] = set()

    def name(parts: int) -> str:
        while True:
            s = _word(rng, parts)
            if s not in used:
                used.add(s)
                return s

    return name


def plan_imports(num_files: int, seed: int) -> list[list[int]]:
    """Imports of each file by topological number (a file imports only lower numbers).

    Every file imports one of the few files just before it (a geometric gap, mean 5), which makes
    chains hundreds of files deep (~400 of 2,000), and up to three files anywhere before it, which makes the
    transitive closures large, as in mathlib.
    """
    rng = np.random.default_rng([seed, 1])
    gaps = rng.geometric(0.2, size=num_files)
    far_counts = rng.integers(0, 4, size=num_files)
    far_draws = rng.random((num_files, 3))
    imports: list[list[int]] = [[]]
    for t in range(1, num_files):
        chosen = [max(0, t - int(gaps[t]))]
        for u in far_draws[t, : far_counts[t]]:
            j = int(u * t)
            if j not in chosen:
                chosen.append(j)
        imports.append(chosen)
    return imports


def _file_paths(num_files: int, rng: random.Random, root: str | None = None) -> list[str]:
    """A tenth under `.lake/packages/lean4/` and the rest under `Mathlib/`, as a traced Mathlib; with `root`, every
    file under it (a dependency as another repository's corpus carries it: `.lake/packages/NAME/Name/`)."""
    namer = _syllable_namer(rng)
    lake = max(1, num_files // 10) if root is None else 0
    paths = []
    for t in range(num_files):
        stem = namer(2).capitalize()
        if t < lake:
            paths.append(f"{LAKE_ROOT}Init/{rng.choice(_SUBDIRS)}/{stem}.lean")
        else:
            paths.append(f"{root or 'Mathlib/'}{rng.choice(_DIRS)}/{rng.choice(_SUBDIRS)}/{stem}.lean")
    return paths


def _premise_counts(spec: ScaleSpec, rng: np.random.Generator) -> np.ndarray:
    """At least one premise per file, a long tail of big files, summing to exactly `spec.premises`."""
    weights = rng.lognormal(0.0, 0.9, size=spec.files)
    extra = spec.premises - spec.files
    share = weights / weights.sum() * extra
    counts = np.floor(share).astype(np.int64)
    left = extra - int(counts.sum())
    counts[np.argsort(-(share - counts), kind="stable")[:left]] += 1
    return counts + 1


def _code_lengths(n: int, rng: np.random.Generator) -> np.ndarray:
    """Target bytes of each premise's code: median ~180, about 1% over 2 kB, a few near 12 kB."""
    return np.clip(rng.lognormal(np.log(180.0), 1.0, size=n), 40, 12000).astype(np.int64)


def _words(rng: random.Random, vocabulary: list[str], count: int) -> list[str]:
    return rng.choices(vocabulary, k=count)


def _lines(words: list[str], indent: str) -> str:
    return f"\n{indent}".join(" ".join(words[i : i + WORDS_PER_LINE]) for i in range(0, len(words), WORDS_PER_LINE))


def _file_decls(path: str, namespace: str, count: int, lengths: np.ndarray, first_line: int,
                vocabulary: list[str], word_bytes: int, rng: random.Random) -> list[Decl]:
    decls: list[Decl] = []
    line = first_line
    for k in range(count):
        keyword = rng.choice(_KEYWORDS)
        short = f"{_word(rng, rng.randint(1, 2))}_{_word(rng, 1)}_{k}"
        attribute = rng.choice(_ATTRIBUTES) if keyword in ("theorem", "lemma") and rng.random() < 0.3 else ""
        # Mostly the short name inside the file's namespace; sometimes the full name, as `protected` ones are.
        declared = f"{namespace}.{short}" if rng.random() < 0.1 else short
        head = f"{keyword} {declared}"
        binders = " ".join(_words(rng, ["(a b : α)", "[Group α]", "{s : Set α}", "(n : ℕ)", "(hf : f x = y)"],
                                  rng.randint(0, 3)))
        header = f"{head} {binders} :" if binders else f"{head} :"
        target = int(lengths[k])
        n_words = max(3, (target - len(header)) // word_bytes)
        body_words = _words(rng, vocabulary, n_words)
        body = _lines(body_words, "    ")
        code = f"{attribute}{header}\n    {body}"
        if keyword in ("theorem", "lemma") and rng.random() < 0.2:
            code += f"\n  exact {short} _"  # the name again in the body: tagged there too, as LeanDojo does
        name_line = line + attribute.count("\n")
        name_col = len(keyword) + 2  # columns are 1-based: after "keyword "
        n_lines = code.count("\n") + 1
        last = code[code.rfind("\n") + 1 :]
        end = (line + n_lines - 1, len(last) + 1)
        decls.append(Decl(f"{namespace}.{short}", code, _KINDS[keyword], (line, 1), end, (name_line, name_col),
                           len(declared), tuple(body_words[:HINT_WORDS])))
        line += n_lines + 1
    return decls


def _state(rng: random.Random, vocabulary: list[str], np_rng: np.random.Generator) -> str:
    hyps = rng.sample(_HYPS, rng.randint(0, 4))
    n_words = int(np.clip(np_rng.lognormal(np.log(30.0), 0.9), 3, 600))
    goal = _lines(_words(rng, vocabulary, n_words), "  ")
    state = "\n".join([*hyps, f"⊢ {goal}"])
    return state


def _sized_state(rng: random.Random, vocabulary: list[str], size: int, hints: list[list[str]]) -> str:
    """A state of about `size` bytes (at least the hints): hypotheses, then a goal of filler words with
    each hint's words, kept together, at a random place."""
    hyps = rng.sample(_HYPS, rng.randint(0, 4))
    used = sum(len(h.encode()) + 1 for h in hyps) + len("⊢ ".encode()) + sum(
        len(w.encode()) + 1 for hint in hints for w in hint)
    chunks: list[list[str]] = []
    while used < size:
        word = rng.choice(vocabulary)
        chunks.append([word])
        used += len(word.encode()) + 1
    for hint in hints:
        chunks.insert(rng.randint(0, len(chunks)), hint)
    return "\n".join([*hyps, f"⊢ {_lines([w for chunk in chunks for w in chunk], '  ')}"])


def _walk(file: int, imports: list[list[int]], rng: random.Random) -> int:
    """A file that `file` imports transitively: a few random steps down its imports (-1 if it imports none)."""
    current = -1
    for _ in range(1 + min(int(rng.expovariate(0.15)), 200)):
        options = imports[file if current < 0 else current]
        if not options:
            break
        current = rng.choice(options)
    return current


@dataclass
class ScaleFiles:
    """The corpus files of a spec, by topological number: their paths, imports (numbers) and declarations, and
    the words their code is made of (what hinted states show)."""

    paths: list[str]
    imports: list[list[int]]
    decls: list[list[Decl]]
    vocabulary: list[str]

    def corpus_lines(self) -> list[str]:
        """corpus.jsonl's lines (without newlines), sorted by path as LeanDojo writes them."""
        lines = []
        for t in sorted(range(len(self.paths)), key=lambda t: self.paths[t]):
            record = {
                "path": self.paths[t],
                "imports": [self.paths[j] for j in self.imports[t]],
                "premises": [{"full_name": d.full_name, "code": d.code, "start": list(d.start), "end": list(d.end),
                              "kind": d.kind} for d in self.decls[t]],
            }
            lines.append(json.dumps(record, ensure_ascii=False))
        return lines

    def closure(self, files: list[int]) -> list[int]:
        """`files` and every file they import, transitively, in topological order."""
        seen: set[int] = set()
        todo = list(files)
        while todo:
            t = todo.pop()
            if t not in seen:
                seen.add(t)
                todo.extend(self.imports[t])
        return sorted(seen)


def scale_files(spec: ScaleSpec, rng: random.Random, np_rng: np.random.Generator, root: str | None = None
                ) -> ScaleFiles:
    """The files of `spec`, drawn from `rng` and `np_rng` (`write_scale_dataset` goes on drawing its theorems from
    them); `root`: every path under it (`_file_paths`)."""
    imports = plan_imports(spec.files, spec.seed)
    paths = _file_paths(spec.files, rng, root)
    counts = _premise_counts(spec, np_rng)
    lengths = _code_lengths(spec.premises, np_rng)
    vocabulary = [_word(rng, rng.randint(1, 3)) for _ in range(3000)] + list(_SYMBOLS) * 20
    word_bytes = round(sum(len(w.encode()) + 1 for w in vocabulary) / len(vocabulary))
    files: list[list[Decl]] = []
    offset = 0
    for t in range(spec.files):
        namespace = paths[t].rsplit("/", 1)[1][: -len(".lean")]
        n = int(counts[t])
        files.append(_file_decls(paths[t], namespace, n, lengths[offset : offset + n], 3 + len(imports[t]),
                                 vocabulary, word_bytes, rng))
        offset += n
    return ScaleFiles(paths, imports, files, vocabulary)


def write_scale_dataset(out: Path, spec: ScaleSpec = MATHLIB_SCALE) -> Path:
    """Write ``out/corpus.jsonl`` and ``out/random/{train,val,test}.json``; return `out`."""
    out = Path(out)
    rng = random.Random(f"scale-{spec.seed}")
    np_rng = np.random.default_rng([spec.seed, 0])
    built = scale_files(spec, rng, np_rng)
    theorems = _theorems(spec, built.paths, built.imports, built.decls, built.vocabulary, rng, np_rng)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / CORPUS_FILE, "w", encoding="utf-8") as fh:
        for line in built.corpus_lines():
            fh.write(line + "\n")
    rng.shuffle(theorems)
    n_eval = max(1, round(spec.eval_share * len(theorems)))
    parts = {VAL_PART: theorems[:n_eval], TEST_PART: theorems[n_eval : 2 * n_eval], TRAIN_PART: theorems[2 * n_eval :]}
    (out / DEFAULT_SPLIT).mkdir(exist_ok=True)
    for name, part in parts.items():
        text = json.dumps(part, ensure_ascii=False, indent=1)
        (out / DEFAULT_SPLIT / part_file(name)).write_text(text, encoding="utf-8")
    return out


def decl_annotation(path: str, decl: Decl, rng: random.Random) -> dict[str, Any]:
    line, col = decl.name_pos
    # A few annotations name a generated declaration (to_additive and the like) that is not in the corpus:
    # only the position finds the premise.
    name = decl.full_name if rng.random() < 0.97 else decl.full_name + "_add"
    return {"full_name": name, "def_path": path, "def_pos": [line, col], "def_end_pos": [line, col + decl.name_len]}


def _theorems(spec: ScaleSpec, paths: list[str], imports: list[list[int]], files: list[list[Decl]],
              vocabulary: list[str], rng: random.Random, np_rng: np.random.Generator) -> list[dict[str, Any]]:
    """Theorems of the repository's own files (not ``.lake``), each one of its file's premises."""
    own = [t for t in range(spec.files) if not paths[t].startswith(".lake/")]
    candidates = [(t, k) for t in own for k, d in enumerate(files[t]) if d.kind == "commonTheorem"]
    picked = rng.sample(candidates, min(spec.num_theorems, len(candidates)))
    theorems = []
    for t, k in picked:
        decl = files[t][k]
        tactics = []
        for _ in range(1 + min(int(rng.expovariate(0.4)), 30)):
            annotations, used = [], []
            for _ in range(rng.choice((0, 1, 1, 1, 2, 2, 3, 4))):
                if k > 0 and rng.random() < 0.3:
                    target_file, target = t, files[t][rng.randrange(k)]  # own file, strictly before the theorem
                else:
                    target_file = _walk(t, imports, rng)
                    if target_file < 0:
                        continue
                    target = rng.choice(files[target_file])
                annotations.append(decl_annotation(paths[target_file], target, rng))
                used.append(target)
            names = [a["full_name"].rsplit(".", 1)[1] for a in annotations]
            tactic = f"simp [{', '.join(names)}]" if names else rng.choice(("intro x", "ring", "omega", "constructor"))
            annotated = f"simp [{', '.join(f'<a>{n}</a>' for n in names)}]" if names else tactic
            if spec.hinted or spec.state_lengths:
                size = (rng.choice(spec.state_lengths) if spec.state_lengths
                        else len(_state(rng, vocabulary, np_rng).encode()))
                before = _sized_state(rng, vocabulary, size, [list(t.hint) for t in used] if spec.hinted else [])
            else:
                before = _state(rng, vocabulary, np_rng)
                if rng.random() < 0.1:
                    before = f"2 goals\n{before}\n\n{_state(rng, vocabulary, np_rng)}"
            tactics.append({"tactic": tactic, "annotated_tactic": [annotated, annotations], "state_before": before,
                            "state_after": ""})
        for a, b in zip(tactics, tactics[1:], strict=False):
            a["state_after"] = b["state_before"]
        tactics[-1]["state_after"] = "no goals"
        theorems.append({
            "url": "https://github.com/leanagent-demo/mathlib-scale",
            "commit": f"{spec.seed:040x}"[-40:],
            "file_path": paths[t],
            "full_name": decl.full_name,
            "theorem_statement": decl.code.split("\n", 1)[0],
            "start": list(decl.start),
            "end": list(decl.end),
            "traced_tactics": tactics,
        })
    return theorems
