"""`leanagent export SOURCE --format leancopilot OUT`: the folders LeanCopilot reads, loaded as LeanCopilot loads
them (the `ctranslate2` package its C++ links, `numpy` for embeddings.npy, its tokenizer's string tokens, the mean
over tokens, a dot product, top k), answer as `leanagent retrieve` does without an import filter.

The run-sized check (every test state of the three demo repositories, from a trained lifelong run):
tests/prefect/test_leancopilot_run.py. ReProver's byt5-small path, from a hub id in the Hugging Face cache: the
slow test at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from leanagent.data.corpus import Corpus
from leanagent.data.theorems import load_states
from leanagent.export.leancopilot import export_leancopilot
from leanagent.export.leancopilot_cache import ENCODER, PREMISES
from leanagent.index.build import build_index
from leanagent.index.query import PremiseIndex
from leanagent.model.ct2 import leancopilot_tokens

ctranslate2 = pytest.importorskip("ctranslate2")  # no wheel for Intel Macs: not installed there

REPO_ROOT = Path(__file__).resolve().parents[2]


class LeanCopilot:
    """LeanCopilot's retrieval, as `cpp/ct2.cpp` and `LeanCopilot/Models/Native.lean` do it, on an export."""

    def __init__(self, out: Path) -> None:
        self.encoder = ctranslate2.Encoder(str(out / ENCODER.folder), device="cpu")  # compute type: its default
        self.embeddings = np.load(out / PREMISES.folder / "embeddings.npy")  # read as npy::read_npy<double>
        self.dictionary = json.loads((out / PREMISES.folder / "dictionary.json").read_text(encoding="utf-8"))

    def encode(self, state: str) -> np.ndarray:
        hidden = np.asarray(self.encoder.forward_batch([leancopilot_tokens(state)]).last_hidden_state)
        return hidden[0].astype(np.float64).mean(axis=0)  # the sum over tokens / their count, in double

    def retrieve(self, state: str, k: int = 10) -> list[str]:
        # Its C++ casts both to float for CTranslate2's MatMul.
        scores = self.embeddings.astype(np.float32) @ self.encode(state).astype(np.float32)
        return [self.dictionary[str(i)]["full_name"] for i in np.argsort(-scores, kind="stable")[:k]]


def cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "leanagent.cli", *argv], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, cwd=REPO_ROOT, timeout=900)


@pytest.fixture(scope="module")
def exported(tiny_model, unit_repo, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("leancopilot")
    build_index(tiny_model, unit_repo, root / "index")
    done = export_leancopilot(root / "index", root / "out")  # the command itself: the tests below
    assert done.premises == 38 and done.code_from_corpus == 38 and not done.warnings
    return {"root": root, "index": root / "index", "out": root / "out"}


def test_the_folders_are_leancopilot_s_layout_and_read_back(exported, unit_repo) -> None:
    out = exported["out"]
    assert sorted(p.name for p in out.iterdir()) == sorted(["README.md", ENCODER.folder, PREMISES.folder])
    assert {"model.bin", "config.json", "vocabulary.json"} <= {p.name for p in (out / ENCODER.folder).iterdir()}
    index = PremiseIndex.load(exported["index"], engine="torch", dtype="fp32")
    embeddings = np.load(out / PREMISES.folder / "embeddings.npy")
    assert embeddings.dtype == np.float64 and embeddings.shape == tuple(index.embeddings.shape)
    assert np.array_equal(embeddings, index.embeddings.double().numpy())  # the index's rows, exactly
    dictionary = json.loads((out / PREMISES.folder / "dictionary.json").read_text(encoding="utf-8"))
    assert list(dictionary) == [str(i) for i in range(len(index))]
    corpus = {(p.path, p.full_name): p.code for p in Corpus.from_jsonl(unit_repo / "corpus.jsonl").premises}
    for i, premise in enumerate(index.premises):
        entry = dictionary[str(i)]
        assert set(entry) == {"full_name", "path", "code"}
        assert (entry["full_name"], entry["path"]) == (premise["full_name"], premise["path"])
        assert entry["code"] == corpus[(premise["path"], premise["full_name"])]  # the source, untagged
    readme = (out / "README.md").read_text()
    for url in (ENCODER.url, PREMISES.url):
        assert url.split("huggingface.co/")[1] in readme
    assert "LEAN_COPILOT_CACHE_DIR" in readme and "## Go back" in readme and "ranks every premise" in readme


def test_leancopilot_s_retrieval_is_leanagent_retrieve_without_an_import_filter(exported, unit_repo) -> None:
    leancopilot = LeanCopilot(exported["out"])
    states = sorted(set(load_states([unit_repo / "random" / "test.json"])))
    assert len(states) >= 10
    for engine in (("torch", "fp32"), ("auto", "auto")):  # the reference, and what `leanagent retrieve` runs
        index = PremiseIndex.load(exported["index"], engine=engine[0], dtype=engine[1])
        for state in states:
            assert leancopilot.retrieve(state) == [h.full_name for h in index.retrieve(state, k=10)], (engine, state)


def test_leancopilot_s_up_to_date_check_passes_in_each_folder(exported) -> None:
    """LeanCopilot's `isUpToDate`: these three git commands in the folder, then `select_premises` uses it."""
    for folder in (ENCODER.folder, PREMISES.folder):
        where = exported["out"] / folder
        subprocess.run(["git", "fetch", "--quiet", "--all"], cwd=where, check=True, capture_output=True)
        branch = subprocess.run(["git", "symbolic-ref", "refs/remotes/origin/HEAD", "--short"], cwd=where,
                                check=True, capture_output=True, text=True).stdout.strip()
        changed = subprocess.run(["git", "diff", branch.split("/")[1], branch, "--shortstat"], cwd=where,
                                 check=True, capture_output=True, text=True).stdout.strip()
        assert branch == "origin/main" and changed == ""
        tracked = subprocess.run(["git", "ls-files"], cwd=where, check=True, capture_output=True, text=True)
        assert tracked.stdout == ""  # the files stay out of git's objects


def in_process(capsys, *argv: str) -> tuple[int, str, str]:
    """The command line in this process (its imports already paid): exit code, stdout, stderr."""
    from leanagent import cli as command_line

    with pytest.raises(SystemExit) as exit_info:
        command_line.main(list(argv))
    captured = capsys.readouterr()
    return int(exit_info.value.code), captured.out, captured.err


def test_install_moves_what_is_there_aside_and_never_deletes(exported, tmp_path, monkeypatch, capsys) -> None:
    cache = tmp_path / "cache"
    theirs = cache / "huggingface.co" / "kaiyuy" / PREMISES.folder
    theirs.mkdir(parents=True)
    (theirs / "embeddings.npy").write_bytes(b"LeanCopilot's own")
    monkeypatch.setenv("LEAN_COPILOT_CACHE_DIR", str(cache))
    for attempt, out in enumerate(("out1", "out2")):
        code, stdout, stderr = in_process(capsys, "export", str(exported["index"]), str(tmp_path / out), "--format",
                                          "leancopilot", "--install")
        assert code == 0, stderr
        assert stdout.count("installed: ") == 2 and stdout.count("moved aside: ") == 1 + attempt
    # The encoder: ours, and the first export's moved aside; the premises: ours, the first's and LeanCopilot's.
    kept = sorted(p.name for p in theirs.parent.iterdir())
    assert len([n for n in kept if n.startswith(ENCODER.folder)]) == 2 and len(kept) == 5, kept
    asides = [p for p in theirs.parent.iterdir() if p.name.startswith(f"{PREMISES.folder}.before-leanagent-")]
    assert len(asides) == 2 and b"LeanCopilot's own" in {(p / "embeddings.npy").read_bytes() for p in asides}
    installed = LeanCopilot(tmp_path / "out2")  # what is in the cache now answers as the export does
    assert np.array_equal(np.load(theirs / "embeddings.npy"), installed.embeddings)


def test_refusals_are_one_line(exported, tmp_path, capsys) -> None:
    code, _, err = in_process(capsys, "export", str(exported["index"]), str(exported["out"]), "--format",
                              "leancopilot")
    assert code == 1 and err.startswith("error: ") and "not empty" in err and len(err.strip().splitlines()) == 1
    code, _, err = in_process(capsys, "export", str(exported["index"]), str(tmp_path / "x"), "--install")
    assert code == 1 and err.strip() == "error: --install: only with --format leancopilot"
    code, _, err = in_process(capsys, "export", str(tmp_path / "nothing"), str(tmp_path / "y"), "--format",
                              "leancopilot")
    assert code == 1 and "no such index folder" in err and not (tmp_path / "y").exists()


def test_an_index_whose_model_changed_is_not_exported(unit_repo, tmp_path, capsys) -> None:
    """LeanCopilot would pair the index's rows with another encoder: refused, --force or not."""
    import shutil

    from leanagent.model.presets import write_random_encoder

    model = write_random_encoder(tmp_path / "model", "tiny", seed=0)
    build_index(model, unit_repo, tmp_path / "index", engine="torch", dtype="fp32")
    other = write_random_encoder(tmp_path / "other", "tiny", seed=1)
    shutil.copyfile(other / "model.safetensors", model / "model.safetensors")  # retrained in place
    code, _, err = in_process(capsys, "export", str(tmp_path / "index"), str(tmp_path / "out"), "--format",
                              "leancopilot", "--force")
    assert code == 1 and len(err.strip().splitlines()) == 1 and "embeddings would be stale" in err, err
    assert err.strip().endswith("Rebuild the index (`leanagent index`), then export it")
    assert not (tmp_path / "out").exists()


def test_reprovers_byt5_small_exports_from_its_hub_id_in_the_cache(unit_repo, tmp_path) -> None:
    """`model.name_or_path: kaiyuy/leandojo-lean4-retriever-byt5-small` (ReProver's) where the Hugging Face cache
    has it: a folder of its architecture (byt5-small) laid out as the cache lays out a snapshot."""
    hub = tmp_path / "hf" / "hub"
    revision = "0" * 40
    snapshot = hub / "models--kaiyuy--leandojo-lean4-retriever-byt5-small" / "snapshots" / revision
    made = cli("init-model", str(snapshot), "--preset", "byt5-small")
    assert made.returncode == 0, made.stderr
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(revision)
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(hub)}
    indexed = cli("index", "--model", "kaiyuy/leandojo-lean4-retriever-byt5-small", "--dataset", str(unit_repo),
                  "--out", str(tmp_path / "index"), env=env)
    assert indexed.returncode == 0, indexed.stderr
    meta = json.loads((tmp_path / "index" / "index.json").read_text())
    assert meta["model"] == str(snapshot.resolve()) and meta["embedding_dim"] == 1472
    done = cli("export", str(tmp_path / "index"), str(tmp_path / "out"), "--format", "leancopilot", env=env)
    assert done.returncode == 0, done.stderr
    leancopilot = LeanCopilot(tmp_path / "out")
    index = PremiseIndex.load(tmp_path / "index", engine="torch", dtype="fp32")
    state = load_states([unit_repo / "random" / "test.json"])[0]
    assert leancopilot.retrieve(state) == [h.full_name for h in index.retrieve(state, k=10)]
    uncached = cli("index", "--model", "kaiyuy/not-here", "--dataset", str(unit_repo), "--out",
                   str(tmp_path / "i2"), env=env)
    assert uncached.returncode == 1 and "no snapshot of that Hugging Face model" in uncached.stderr
