"""Each fast path of the training data against a plain implementation written here from the definitions.

Tokenization against ``ByT5Tokenizer`` itself; premise text against the reference's regex; accessibility
and negative pools against lists built by walking the imports; the negative sampler against a
list-based sampler making the same random calls (so the draws must be equal, not just alike); and
collate against a batch built example by example.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from data_helpers import reference_serialize

import leanagent.data.corpus as corpus_module
from leanagent.data.corpus import Corpus
from leanagent.data.dataset import TrainDataset, example_seed, tokenize_premises, tokenize_texts
from leanagent.data.errors import DatasetError
from leanagent.data.examples import TrainExample
from leanagent.data.negatives import negative_pools, pool_members, sample_negatives
from leanagent.data.premise_text import serialize_premise
from leanagent.data.ranges import RangeUnion
from leanagent.data.tokenize import byt5_spec

# ---- tokenization --------------------------------------------------------------------------------

SPECIAL_LITERALS = ["<pad>", "</s>", "<unk>", "<extra_id_0>", "<extra_id_7>", "<extra_id_124>", " </s> ", "<pad> x"]
NOT_SPECIAL = ["<extra_id_125>", "<pa", "</ s>", "<a>", "</a>", "<<pad", "s>"]
CODE_POINTS = (
    [chr(c) for c in range(32, 127)] * 4
    + ["\n", "\t", " ", "\u00a0", "\u2003"]
    + [chr(c) for c in range(0x300, 0x370)]  # combining marks
    + ["é", "ß", "Ω", "λ", "ℕ", "∀", "→", "≤", "⟨", "⟩", "«", "»", "中", "文"]
    + ["🙂", "🚀", "👍🏽", "👨\u200d👩\u200d👧", "🇫🇷"]  # emoji, skin tone, ZWJ sequence, flag
)


def random_text(rng: random.Random, specials: bool) -> str:
    n = rng.choice([0, 0, 1, 3, 10, 50, 200, 1100, 3000])
    parts = rng.choices(CODE_POINTS, k=n)
    if specials and n and rng.random() < 0.5:
        for _ in range(rng.randint(1, 3)):
            parts.insert(rng.randrange(len(parts) + 1), rng.choice(SPECIAL_LITERALS))
    if n and rng.random() < 0.3:
        parts.insert(rng.randrange(len(parts) + 1), rng.choice(NOT_SPECIAL))
    return "".join(parts)


def reference_tokens(tokenizer: Any, texts: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tokenizer(texts, padding="longest", truncation=True, max_length=max_len, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def assert_same_tokens(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert got[0].dtype == want[0].dtype and got[1].dtype == want[1].dtype
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])


def test_the_byt5_tokenizer_is_recognised_with_every_special_literal(tokenizer) -> None:
    spec = byt5_spec(tokenizer)
    assert spec is not None
    for literal in set(tokenizer.all_special_tokens) | set(tokenizer.added_tokens_encoder):
        assert spec.needs_tokenizer(f"x{literal}y".encode())
    for text in NOT_SPECIAL:
        assert not spec.needs_tokenizer(text.encode())


@pytest.mark.filterwarnings("ignore:This sequence already has")
@pytest.mark.parametrize("max_len", [2, 3, 7, 64, 1024])
def test_tokenize_texts_is_byt5_on_random_unicode(tokenizer, max_len: int) -> None:
    rng = random.Random(max_len)
    for _ in range(60):
        texts = [random_text(rng, specials=rng.random() < 0.3) for _ in range(rng.randint(1, 9))]
        assert_same_tokens(tokenize_texts(tokenizer, texts, max_len), reference_tokens(tokenizer, texts, max_len))


@pytest.mark.filterwarnings("ignore:This sequence already has")
def test_edge_texts(tokenizer) -> None:
    cases = [[""], ["", ""], ["a" * 5000], ["</s>"], ["x</s>"], ["<pad>"], [" <unk> "], ["é" * 600, ""],
             ["e\u0301" * 400], ["🙂" * 300, "a"], ["<extra_id_3>" * 3, "plain"]]
    for texts in cases:
        for max_len in (2, 5, 1024):
            assert_same_tokens(tokenize_texts(tokenizer, texts, max_len), reference_tokens(tokenizer, texts, max_len))
    with pytest.raises(UnicodeEncodeError):  # a lone surrogate: the tokenizer's own error, as before
        tokenize_texts(tokenizer, ["a\ud800"], 16)


class _WordTokenizer:
    """Not ByT5: one id per character, padding 0 (the fast path must hand every batch to it)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, texts, padding, truncation, max_length, return_tensors):
        self.calls += 1
        rows = [[ord(c) % 97 + 5 for c in t][: max_length - 1] + [2] for t in texts]
        width = max(len(r) for r in rows)
        return {"input_ids": torch.tensor([r + [0] * (width - len(r)) for r in rows]),
                "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])}


def test_other_tokenizers_are_used_as_they_are(tokenizer) -> None:
    other = _WordTokenizer()
    ids, _ = tokenize_texts(other, ["ab", "c"], 8)
    assert other.calls >= 1 and ids.tolist() == [[5, 6, 2], [7, 2, 0]]
    assert byt5_spec(other) is None
    # A ByT5 tokenizer with an extra token is not the one we imitate: it is called for every batch.
    from transformers import ByT5Tokenizer

    extended = ByT5Tokenizer()
    assert byt5_spec(extended) is not None
    extended.add_tokens(["⊢"])  # changed after its first check: checked again
    assert byt5_spec(extended) is None
    texts = ["⊢ x = x", "a ⊢ b"]
    assert_same_tokens(tokenize_texts(extended, texts, 32), reference_tokens(extended, texts, 32))
    left = ByT5Tokenizer()
    left.padding_side = "left"
    assert byt5_spec(left) is None
    assert_same_tokens(tokenize_texts(left, ["ab", "c"], 32), reference_tokens(left, ["ab", "c"], 32))


# ---- premise text --------------------------------------------------------------------------------

def test_premise_text_equals_the_regex_reference() -> None:
    rng = random.Random(0)
    pieces = [" ", "\n", "\u2003", "\u00a0", "a", "b", ".", "«", "»", "_", "x", "\\", "(", "theorem "]
    components = ["a", "b", "ab", "ba", "a_b", "«a b»", "", "x", "_root_", "«a»"]
    for _ in range(20000):
        name = ".".join(rng.choice(components) for _ in range(rng.randint(1, 3)))
        code = "".join(rng.choice([*pieces, name, name]) for _ in range(rng.randint(0, 14)))
        assert serialize_premise(name, code) == reference_serialize(name, code), (name, code)


# ---- a random corpus with imports ----------------------------------------------------------------

def random_records(rng: random.Random, num_files: int, big: int = 0) -> list[dict[str, Any]]:
    """Files imported at random (a DAG, plus one cycle), premises in position order except in some files,
    and `big` premises in the first file so that some pools are large enough for rejection sampling."""
    records = []
    for f in range(num_files):
        n = big if f == 0 and big else rng.choice([0, 1, 2, 5, 12, 40])
        premises = []
        for k in range(n):
            line = 3 * k + 1
            end = (line + rng.randint(0, 2), rng.randint(1, 9))
            premises.append({"full_name": f"F{f}.p{k}", "code": f"theorem p{k} : True", "start": [line, 1],
                             "end": list(end)})
        if rng.random() < 0.2 and n > 2:  # ends out of corpus order: sorted arrays, not ranges
            rng.shuffle(premises)
        imports = [f"F{j}.lean" for j in rng.sample(range(f), min(f, rng.randint(0, 3)))]
        records.append({"path": f"F{f}.lean", "imports": imports, "premises": premises})
    records[1]["imports"].append(f"F{num_files - 1}.lean")  # a cycle through the last file
    rng.shuffle(records)  # corpus order is not the import order
    return records


class Plain:
    """Accessibility and pools written out as lists, straight from the definitions."""

    def __init__(self, corpus: Corpus, records: list[dict[str, Any]]) -> None:
        self.corpus = corpus
        self.imports = {r["path"]: list(r["imports"]) for r in records}
        self.file = [p.path for p in corpus.premises]
        self.end = [p.end for p in corpus.premises]

    def closure(self, path: str) -> set[str]:
        seen: set[str] = set()
        todo = list(self.imports.get(path, []))
        while todo:
            p = todo.pop()
            if p not in seen and p in self.imports:
                seen.add(p)
                todo.extend(self.imports[p])
        seen.discard(path)
        return seen

    def of_files(self, files: set[str]) -> list[int]:
        return [i for i, f in enumerate(self.file) if f in files]

    def before(self, path: str, start: tuple[int, int], strict: bool) -> list[int]:
        return [i for i, f in enumerate(self.file) if f == path and (self.end[i] < start if strict
                                                                      else self.end[i] <= start)]

    def pools(self, ex: TrainExample) -> tuple[list[int], list[int]]:
        own = self.before(ex.file_path, ex.theorem_start, strict=True)
        imported = self.of_files(self.closure(ex.file_path))
        pos_file = self.file[ex.pos_premise]
        if pos_file == ex.file_path:
            return own, imported
        if pos_file in self.closure(ex.file_path):
            return self.of_files({pos_file}), own + [i for i in imported if self.file[i] != pos_file]
        return [], own + imported


def leanagent_sample(plain: Plain, ex: TrainExample, n: int, n_in: int, rng: random.Random) -> list[int]:
    """LeanAgent's draw, as README states it, on written-out lists: `random.sample` of min(n_in, n) premises of
    the in-file pool, then of the rest from the outside pool, positives left out. Defined where both pools have
    enough premises (the reference crashes otherwise) and hold at most 4,096 (larger ones are drawn by rejection,
    for speed; `check_negatives` holds those to the definition's properties instead)."""
    positives = set(ex.all_pos_premises) | {ex.pos_premise}
    in_file, outside = plain.pools(ex)
    chosen = rng.sample([i for i in in_file if i not in positives], min(n_in, n))
    allowed = [i for i in outside if i not in positives and i not in chosen]
    return chosen + rng.sample(allowed, n - len(chosen))


def defined(plain: Plain, ex: TrainExample, n: int, n_in: int) -> bool:
    positives = set(ex.all_pos_premises) | {ex.pos_premise}
    in_file, outside = plain.pools(ex)
    in_ok = [i for i in in_file if i not in positives]
    out_ok = [i for i in outside if i not in positives]
    return (len(in_file) <= 4096 and len(outside) <= 4096 and len(in_ok) >= min(n_in, n)
            and len(out_ok) >= n - min(n_in, n))


def check_negatives(plain: Plain, ex: TrainExample, n: int, n_in: int, got: list[int]) -> None:
    """README's composition, for any corpus: never a positive; distinct while the corpus has enough other
    premises; min(n_in, n) from the in-file pool when it has them, the rest from what the theorem can see
    (the outside pool), and only when those run short from the rest of the in-file pool, then the corpus."""
    positives = set(ex.all_pos_premises) | {ex.pos_premise}
    in_file, outside = (set(p) - positives for p in plain.pools(ex))
    non_positive = set(range(len(plain.corpus))) - positives
    assert len(got) == n and not set(got) & positives, (ex, got)
    assert len(set(got)) == min(n, len(non_positive)), (ex, got)
    first = min(n_in, n, len(in_file))
    assert set(got[:first]) <= in_file, (ex, got)
    rest = got[first:]
    from_outside = min(len(rest), len(outside))
    assert set(rest[:from_outside]) <= outside, (ex, got)
    if from_outside < len(rest):  # widened: what the pools lacked came from the rest of the corpus
        assert outside <= set(rest[:from_outside]), (ex, got)


def random_example(rng: random.Random, corpus: Corpus, plain: Plain, index: int) -> TrainExample:
    path = rng.choice(corpus.paths)
    start = (rng.randint(1, 130), rng.randint(1, 9))
    visible = plain.before(path, start, strict=False) + plain.of_files(plain.closure(path))
    anywhere = range(len(corpus))
    pos = rng.choice(visible) if visible and rng.random() < 0.9 else rng.choice(anywhere)
    others = rng.sample(visible or list(anywhere), min(len(visible or anywhere), rng.choice([0, 0, 1, 3])))
    return TrainExample(index, "⊢ p", path, start, pos, list(dict.fromkeys([pos, *others])), f"T.t{index}")


@pytest.fixture(scope="module")
def random_corpus() -> tuple[Corpus, Plain]:
    records = random_records(random.Random(5), 60, big=5000)
    corpus = Corpus.from_records(records)
    return corpus, Plain(corpus, records)


def test_accessibility_equals_the_plain_lists(random_corpus: tuple[Corpus, Plain]) -> None:
    corpus, plain = random_corpus
    rng = random.Random(1)
    for path in corpus.paths + ["Missing.lean"]:
        imported = plain.of_files(plain.closure(path))
        assert corpus.imported_indices(path) == imported
        assert list(corpus.imported_ranges(path)) == imported
        for _ in range(4):
            start = (rng.randint(1, 130), rng.randint(1, 9))
            for strict in (False, True):
                own = plain.before(path, start, strict)
                assert corpus.in_file_indices(path, start, strict) == own
                assert [int(i) for i in corpus.in_file_segment(path, start, strict)] == own
            want = sorted(plain.before(path, start, strict=False) + imported)
            assert corpus.accessible_indices(path, start).tolist() == want
            assert corpus.accessible_mask(path, start).nonzero().flatten().tolist() == want


def test_range_union_against_a_list() -> None:
    rng = random.Random(2)
    for _ in range(200):
        bounds = sorted(rng.sample(range(200), 2 * rng.randint(0, 8)))
        starts = np.array(bounds[0::2], dtype=np.int64)
        stops = np.array(bounds[1::2], dtype=np.int64)
        if rng.random() < 0.5 and len(starts) > 1:  # touching ranges are merged
            stops[0] = starts[1]
        union = RangeUnion.from_ranges(starts, stops)
        members = [i for a, b in zip(starts.tolist(), stops.tolist(), strict=True) for i in range(a, b)]
        assert list(union) == members and len(union) == len(members)
        assert union.to_array().tolist() == members
        assert [union[r] for r in range(len(members))] == members
        for x in range(-2, 203):
            assert union.rank(x) == sum(m < x for m in members)
            assert union.index(x) == (members.index(x) if x in members else -1)


def test_pools_equal_the_plain_pools(random_corpus: tuple[Corpus, Plain]) -> None:
    corpus, plain = random_corpus
    rng = random.Random(3)
    for k in range(400):
        ex = random_example(rng, corpus, plain, k)
        in_file, outside = negative_pools(corpus, ex)
        assert (pool_members(in_file), pool_members(outside)) == plain.pools(ex)


@pytest.fixture(scope="module")
def small_corpus() -> tuple[Corpus, Plain]:
    """No file of thousands of premises: LeanAgent's own draw is defined for most examples."""
    records = random_records(random.Random(6), 60)
    corpus = Corpus.from_records(records)
    return corpus, Plain(corpus, records)


@pytest.mark.parametrize(("n", "n_in"), [(3, 1), (1, 1), (7, 3), (40, 2), (0, 0)])
@pytest.mark.parametrize("which", ["small_corpus", "random_corpus"])
def test_negatives_are_leanagents_draws_where_defined_and_of_its_composition_everywhere(
        which: str, request: pytest.FixtureRequest, n: int, n_in: int) -> None:
    corpus, plain = request.getfixturevalue(which)
    rng = random.Random(n * 10 + n_in)
    exact = 0
    for k in range(300):
        ex = random_example(rng, corpus, plain, k)
        seed = rng.randrange(10**9)
        got = sample_negatives(corpus, ex, n, n_in, random.Random(seed))
        check_negatives(plain, ex, n, n_in, got)
        if defined(plain, ex, n, n_in):
            assert got == leanagent_sample(plain, ex, n, n_in, random.Random(seed)), ex
            exact += 1
    if which == "small_corpus":
        assert exact >= 100, exact  # the definition covered enough examples to mean something


def test_mostly_banned_large_pool_and_a_small_cache(random_corpus: tuple[Corpus, Plain],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Rejection sampling that falls back to filtering, and an imported-ranges cache that keeps evicting."""
    corpus, plain = random_corpus
    big_file = "F0.lean"  # the file with 5,000 premises
    importers = [p for p in corpus.paths if big_file in plain.closure(p)]
    assert importers
    big = plain.of_files({big_file})
    positives = big[:-3]  # all but three premises of the big file are positives
    ex = TrainExample(0, "⊢ p", importers[0], (1, 1), positives[0], positives, "T.t")
    for seed in range(5):
        check_negatives(plain, ex, 6, 2, sample_negatives(corpus, ex, 6, 2, random.Random(seed)))
    monkeypatch.setattr(corpus_module, "IMPORTED_RANGES_BUDGET", 4)
    fresh = Corpus.from_records(random_records(random.Random(5), 60, big=5000))
    rng = random.Random(4)
    for k in range(200):
        ex = random_example(rng, fresh, plain, k)
        # An evicting cache changes nothing: the same draws as the corpus whose cache holds everything.
        assert sample_negatives(fresh, ex, 3, 1, random.Random(k)) == sample_negatives(corpus, ex, 3, 1,
                                                                                       random.Random(k))
    assert fresh._imported_ranges_held <= 4 or len(fresh._imported_ranges) == 1


def test_tiny_corpora_widen_then_repeat() -> None:
    rng = random.Random(7)
    repeated = 0
    for _ in range(40):
        records = random_records(rng, 3)
        corpus = Corpus.from_records(records)
        if not len(corpus):
            continue
        plain = Plain(corpus, records)
        for k in range(10):
            ex = random_example(rng, corpus, plain, k)
            n, seed = rng.choice([1, 3, 10, 30]), rng.randrange(10**9)
            if not set(range(len(corpus))) - set(ex.all_pos_premises) - {ex.pos_premise}:
                with pytest.raises(DatasetError, match=ex.theorem):  # nothing but positives: no negative exists
                    sample_negatives(corpus, ex, n, 1, random.Random(seed))
                continue
            got = sample_negatives(corpus, ex, n, 1, random.Random(seed))
            check_negatives(plain, ex, n, 1, got)
            repeated += len(set(got)) < n  # repeats: the corpus had fewer non-positives than asked for
    assert repeated > 10


# ---- collate -------------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:This sequence already has")
def test_collate_equals_a_batch_built_example_by_example(tokenizer) -> None:
    rng = random.Random(6)
    records = random_records(rng, 30)
    for r in records:  # long, Unicode and special-literal premise code
        for p in r["premises"]:
            p["code"] = p["code"] + " " + random_text(rng, specials=rng.random() < 0.1)
    corpus = Corpus.from_records(records)
    plain = Plain(corpus, records)
    examples = [random_example(rng, corpus, plain, k) for k in range(64)]
    for ex in examples:
        ex.context = random_text(rng, specials=rng.random() < 0.1)
    for num_negatives, max_len in ((3, 1024), (2, 40), (0, 7)):
        ds = TrainDataset(corpus, examples, tokenizer, num_negatives, 1, max_len, max_len, seed=1, deterministic=True)
        for b in range(0, len(examples), 4):
            items = [ds[i] for i in range(b, b + 4)]
            got = ds.collate(items)
            batch = [it["example"] for it in items]
            order = [e.pos_premise for e in batch]
            for slot in range(num_negatives):
                for it in items:
                    order.append(it["negatives"][slot])
            contexts = reference_tokens(tokenizer, [e.context for e in batch], max_len)
            premises = reference_tokens(tokenizer, [corpus.premises[i].text for i in order], max_len)
            label = [[1.0 if j in e.all_pos_premises else 0.0 for j in order] for e in batch]
            assert_same_tokens((got["context_ids"], got["context_mask"]), contexts)
            assert_same_tokens((got["premise_ids"], got["premise_mask"]), premises)
            assert got["label"].dtype == torch.float32 and got["label"].tolist() == label
            assert got["premise_index"].tolist() == order
            assert got["index"].tolist() == [e.index for e in batch]
            for it in items:  # the dataset's negatives are the sampler's, seeded by the example (deterministic)
                assert it["negatives"] == sample_negatives(corpus, it["example"], num_negatives, 1,
                                                           random.Random(example_seed(1, it["example"].index)))
                check_negatives(plain, it["example"], num_negatives, 1, it["negatives"])
    # Corpus embedding passes numpy indices.
    idx = np.array([5, 0, 17, 3])
    want = reference_tokens(tokenizer, [corpus.premises[i].text for i in idx.tolist()], 64)
    assert_same_tokens(tokenize_premises(tokenizer, corpus, idx, 64), want)
