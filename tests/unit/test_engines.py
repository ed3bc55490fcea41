"""The query engines (`--engine torch|ct2`), the CTranslate2 conversion, and scoring in fp32 chunks.

Real CTranslate2 (the package LeanCopilot's C++ links), a real tiny encoder (the shared `tiny_model`), a real index
of a synthetic repository (`unit_repo`), and the real command line in subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from leanagent.data.dataset import tokenize_texts
from leanagent.index.build import build_index
from leanagent.index.files import PremiseIndexError
from leanagent.index.query import PremiseIndex
from leanagent.model import topk
from leanagent.model.ct2 import Ct2Encoder, convert, leancopilot_tokens, vocabulary
from leanagent.model.engines import EngineError, choose
from leanagent.model.evaluation import CorpusEmbedding
from leanagent.model.loading import load_model
from leanagent.model.topk import FP32_CHUNKS, NATIVE, score_matrix, scoring_path, top_k_accessible

ctranslate2 = pytest.importorskip("ctranslate2")  # no wheel for Intel Macs: not installed there

REPO_ROOT = Path(__file__).resolve().parents[2]
# Proof states of varied lengths, with the two bytes whose LeanCopilot tokens are not chr(byte) (\b, \f), and
# characters of 2, 3 and 4 UTF-8 bytes.
TEXTS = ["n : ℕ\n⊢ gcd n n = n", "x\by\fz : Nat ⊢ x = x", "a b c : Nat\n⊢ a + b + c = a + c + b" * 6, "⊢ 𝔽 ≠ ∅ ∧ é"]


@pytest.fixture(scope="module")
def converted(tiny_model, tmp_path_factory) -> dict:
    retriever = load_model(tiny_model).retriever
    folder = convert(retriever.encoder, tmp_path_factory.mktemp("ct2") / "model")
    return {"retriever": retriever, "folder": folder}


@pytest.fixture(scope="module")
def index(tiny_model, unit_repo, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("engines") / "index"
    build_index(tiny_model, unit_repo, out, engine="torch", dtype="fp32")
    return out


def test_ct2_gives_torch_fp32_s_embeddings(converted) -> None:
    retriever = converted["retriever"]
    ids, mask = tokenize_texts(retriever.tokenizer, TEXTS, 1024)
    with torch.no_grad():
        reference = retriever.encode(ids, mask)
    encoder = Ct2Encoder(converted["folder"], "fp32")
    rows = [ids[i, : int(mask[i].sum())].tolist() for i in range(len(TEXTS))]
    together, alone = encoder.encode(rows), torch.cat([encoder.encode([row]) for row in rows])
    for got in (together, alone):
        assert torch.nn.functional.cosine_similarity(got, reference).min() >= 0.9999
        assert (got - reference).abs().max() <= 1e-4
    int8 = Ct2Encoder(converted["folder"], "int8_float32").encode(rows)
    assert 0.9 < float(torch.nn.functional.cosine_similarity(int8, reference).min()) < 1.0  # quantized: near, not equal


def test_the_vocabulary_is_the_tokens_leancopilot_emits(converted) -> None:
    """LeanCopilot/Models/ByT5.lean's `vocab`: byte b is the character of code point b, except bytes 8 and 12,
    the two characters `\\b` and `\\f`; then `</s>`. The model's vocabulary must map each to id 3 + b."""
    tokens = json.loads((converted["folder"] / "vocabulary.json").read_text(encoding="utf-8"))
    expected = ["<pad>", "</s>", "<unk>"] + [chr(b) for b in range(256)] + [f"<extra_id_{i}>" for i in range(125)]
    expected[3 + 8], expected[3 + 12] = "\\b", "\\f"
    assert tokens == expected == vocabulary(384) and len(set(tokens)) == 384
    assert leancopilot_tokens("a\b") == ["a", "\\b", "</s>"]
    model = ctranslate2.Encoder(str(converted["folder"]))
    retriever = converted["retriever"]
    for text in TEXTS:  # LeanCopilot's string tokens reach the ids the model was trained on
        ids = retriever.tokenizer(text).input_ids
        by_token = np.asarray(model.forward_batch([leancopilot_tokens(text)]).last_hidden_state)
        by_id = np.asarray(model.forward_batch([ids]).last_hidden_state)
        assert np.array_equal(by_token, by_id), text


def test_auto_takes_the_exact_engine_and_never_int8() -> None:
    assert choose("auto", "auto", "cpu") == ("ct2", "fp32")
    assert choose("auto", "auto", "cuda") == ("torch", "auto")  # torch's own rule decides on a GPU
    assert choose("auto", "bf16", "cpu") == ("torch", "bf16") and choose("auto", "int8", "cpu") == ("torch", "int8")
    assert choose("auto", "int8_float32", "cpu") == ("ct2", "int8_float32")
    assert choose("ct2", "auto", "cpu") == ("ct2", "fp32")
    with pytest.raises(EngineError, match="--engine torch runs fp32, bf16, int8"):
        choose("torch", "int8_float32", "cpu")
    with pytest.raises(EngineError, match="--engine ct2 runs on cpu, not --device cuda"):
        choose("ct2", "fp32", "cuda")


def test_without_ctranslate2_engine_ct2_is_one_line_and_auto_falls_back_to_torch(index) -> None:
    hide = "import sys; sys.modules['ctranslate2'] = None; from leanagent.cli.main import main; sys.exit(main())"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = [sys.executable, "-c", hide, "retrieve", str(index), "--state", TEXTS[0], "--json"]
    refused = subprocess.run([*run, "--engine", "ct2"], capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.strip().splitlines() == [
        "error: --engine ct2 needs ctranslate2, which is not installed: pip install ctranslate2 (wheels for Linux "
        "x86_64 and aarch64, macOS arm64, Windows)"]
    answered = subprocess.run(run, capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    assert answered.returncode == 0, answered.stderr
    assert json.loads(answered.stdout)["engine"] == "torch"


def test_a_conversion_is_cached_next_to_the_index_and_redone_for_another_model(index) -> None:
    first = PremiseIndex.load(index)  # auto: ct2 fp32
    [cached] = sorted(index.glob("ct2-*"))
    stamp = (cached / "model.bin").stat().st_mtime_ns
    again = PremiseIndex.load(index, dtype="int8_float32")
    assert (again.engine, again.dtype) == ("ct2", "int8_float32")
    assert (cached / "model.bin").stat().st_mtime_ns == stamp  # converted once, every dtype served from it
    meta = json.loads((cached / "leanagent.json").read_text())
    (cached / "leanagent.json").write_text(json.dumps({**meta, "model_sha256": "0" * 64}))  # another model's
    PremiseIndex.load(index)
    assert json.loads((cached / "leanagent.json").read_text()) == meta  # not used: converted again
    torch_index = PremiseIndex.load(index, engine="torch", dtype="fp32")
    for state in TEXTS:
        a, b = first.retrieve(state, k=10), torch_index.retrieve(state, k=10)
        assert [h.full_name for h in a] == [h.full_name for h in b]
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-5)
    assert first.embeddings.dtype == torch.bfloat16 and first.scoring == FP32_CHUNKS  # no fp32 copy of the rows


def test_an_index_that_cannot_hold_a_conversion_gets_one_for_the_process_only(index, tmp_path) -> None:
    import shutil

    # An index that records no model identity: a cached conversion could not be checked, so none is kept.
    unidentified = shutil.copytree(index, tmp_path / "old", ignore=shutil.ignore_patterns("ct2-*"))
    meta = json.loads((unidentified / "index.json").read_text())
    del meta["model_identity"]
    (unidentified / "index.json").write_text(json.dumps(meta))
    loaded = PremiseIndex.load(unidentified)
    assert loaded.engine == "ct2" and not list(unidentified.glob("ct2-*")) and not list(tmp_path.glob(".*"))
    assert [h.full_name for h in loaded.retrieve(TEXTS[0])] == [
        h.full_name for h in PremiseIndex.load(index, engine="torch", dtype="fp32").retrieve(TEXTS[0])]
    # A folder this user may not write (not testable as root, who writes anyway).
    locked = shutil.copytree(index, tmp_path / "locked", ignore=shutil.ignore_patterns("ct2-*"))
    locked.chmod(0o555)
    try:
        if not os.access(locked, os.W_OK):
            loaded = PremiseIndex.load(locked)
            assert loaded.engine == "ct2" and not list(locked.glob("ct2-*"))
            assert any("cannot be cached there" in w for w in loaded.warnings)
    finally:
        locked.chmod(0o755)


def _cli(argv: list[str]) -> int:
    from leanagent import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    return int(exit_info.value.code)


def test_retrieve_takes_the_engine_and_dtype_and_says_which_ran(index, capsys) -> None:
    assert _cli(["retrieve", str(index), "--state", TEXTS[0], "--json", "--engine", "ct2", "--dtype",
                 "int8_float32"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert (answer["engine"], answer["dtype"], answer["scoring"]) == ("ct2", "int8_float32", FP32_CHUNKS)
    assert len(answer["premises"]) == 10
    assert _cli(["retrieve", str(index), "--state", "x", "--engine", "torch", "--dtype", "int8_float32"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --dtype int8_float32: --engine torch runs fp32, bf16, int8"]


def test_an_index_embedded_by_ct2_holds_torch_s_rows(index, tiny_model, unit_repo, tmp_path) -> None:
    meta = build_index(tiny_model, unit_repo, tmp_path / "ct2-index", engine="ct2")
    assert (meta["engine"], meta["embedded_at"]) == ("ct2", "fp32")
    from safetensors.torch import load_file

    ours = load_file(str(tmp_path / "ct2-index" / "embeddings.safetensors"))["embeddings"].float()
    theirs = load_file(str(index / "embeddings.safetensors"))["embeddings"].float()
    assert (ours - theirs).abs().max() <= 2 ** -8  # the same fp32 rows, each rounded to bf16 (one ulp at most)
    with pytest.raises(PremiseIndexError, match="--engine ct2 runs on cpu"):
        build_index(tiny_model, unit_repo, tmp_path / "x", engine="ct2", device="cuda")


@pytest.mark.parametrize("n, width", [(3000, 96), (20000, 64), (2000, 1472)])
def test_fp32_chunks_give_the_bf16_product_s_top_k(monkeypatch, n, width) -> None:
    """The CPU without bf16 matmuls: bf16 rows multiplied in fp32 a chunk at a time (chunk boundaries crossed
    here) rank as the bf16 product does; the decision is by the CPU, given here to take both branches."""
    g = torch.Generator().manual_seed(n)
    rows = torch.nn.functional.normalize(torch.randn(n, width, generator=g), dim=1).to(torch.bfloat16)
    contexts = torch.nn.functional.normalize(torch.randn(32, width, generator=g), dim=1)
    accessible = torch.rand(32, n, generator=g) < 0.5
    monkeypatch.setattr(topk, "CHUNK_ELEMENTS", 700 * width + 3)
    native = top_k_accessible(contexts, rows, accessible, 50, path=NATIVE)
    chunked = top_k_accessible(contexts, rows, accessible, 50, path=FP32_CHUNKS)
    assert torch.equal(native[1], chunked[1]) and torch.equal(native[0], chunked[0])
    assert chunked[0].dtype == torch.bfloat16  # the product's own rounding, so ties tie as they do there
    a, b = score_matrix(contexts, rows, NATIVE).float(), score_matrix(contexts, rows, FP32_CHUNKS).float()
    # One bf16 rounding apart at most (near 0, where a bf16 step is tiny, the sums' own fp32 rounding apart).
    assert ((a - b).abs() <= torch.maximum(a.abs(), b.abs()) * 2 ** -7 + 1e-6).all()
    assert scoring_path(rows, bf16_matmuls=False) == FP32_CHUNKS and scoring_path(rows, bf16_matmuls=True) == NATIVE
    assert scoring_path(rows, exact=True, bf16_matmuls=True) == FP32_CHUNKS  # an index: exact products always
    assert scoring_path(rows.float(), bf16_matmuls=False) == NATIVE
    exact = score_matrix(contexts, rows, FP32_CHUNKS, exact=True)
    assert exact.dtype == torch.float32 and torch.allclose(exact, contexts @ rows.float().t(), atol=1e-6)


def test_evaluation_ranks_the_same_by_either_path(unit_repo) -> None:
    """Evaluation's ranking (`CorpusEmbedding.top_k`, accessibility masks of real contexts) by both paths."""
    from leanagent.data.corpus import Corpus
    from leanagent.data.dataset import build_eval_examples
    from leanagent.data.theorems import load_split

    corpus = Corpus.from_jsonl(unit_repo / "corpus.jsonl")
    examples = build_eval_examples(corpus, load_split(unit_repo / "random" / "test.json"))
    g = torch.Generator().manual_seed(5)
    rows = torch.nn.functional.normalize(torch.randn(len(corpus), 64, generator=g), dim=1).to(torch.bfloat16)
    contexts = torch.nn.functional.normalize(torch.randn(len(examples), 64, generator=g), dim=1)
    mask = torch.stack([corpus.accessible_mask(e.file_path, e.theorem_start) for e in examples])
    embedding = CorpusEmbedding.of_corpus(rows, corpus)
    native, chunked = (embedding.top_k(contexts, mask, 10, path) for path in (NATIVE, FP32_CHUNKS))
    assert torch.equal(native[1], chunked[1]) and torch.equal(native[0], chunked[0])


def test_the_cpu_decides_the_scoring_path() -> None:
    """oneDNN limited to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2) is a CPU without bf16 matmuls as torch sees it: evaluation's
    bf16 rows are then scored in fp32 chunks; here, the CPU's own answer."""
    from leanagent.model.dtypes import cpu_has_bf16

    code = ("import torch; from leanagent.model.topk import scoring_path; "
            "print(scoring_path(torch.zeros(2, 4, dtype=torch.bfloat16)))")
    avx2 = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT,
                          env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert avx2.returncode == 0 and avx2.stdout.strip() == FP32_CHUNKS, avx2.stderr
    assert scoring_path(torch.zeros(2, 4, dtype=torch.bfloat16)) == (NATIVE if cpu_has_bf16() else FP32_CHUNKS)
