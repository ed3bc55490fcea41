"""`leanagent export SOURCE --format leancopilot OUT`: the folders LeanCopilot reads, loaded and ranked as LeanCopilot
does (`tests/leancopilot_standin.py`: its file reader, its byte table, its mean, its float32 product, its top k, its
index check; no leanagent code), answer as `leanagent retrieve` does without an import filter, and never with the
placeholder row 0, at LeanCopilot's default k and above.

The run-sized check (every test state of the three demo repositories, from a trained lifelong run):
tests/prefect/test_leancopilot_run.py. ReProver's byt5-small path, from a hub id in the Hugging Face cache: the
slow test at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from leanagent.data.corpus import Corpus
from leanagent.data.synthetic import write_demo_repos
from leanagent.data.theorems import load_states
from leanagent.export.leancopilot import FIXED_STATES, PLACEHOLDER, export_leancopilot
from leanagent.export.leancopilot_cache import ENCODER, PREMISES
from leanagent.export.leancopilot_native import LeanCopilotCrash, read_leancopilot_npy, top_k_indices
from leanagent.index.build import build_index
from leanagent.index.query import PremiseIndex
from tests.leancopilot_standin import SPECIAL_STATES, LeanCopilot, partial_sort, read_npy_double

ctranslate2 = pytest.importorskip("ctranslate2")  # no wheel for Intel Macs: not installed there

REPO_ROOT = Path(__file__).resolve().parents[2]


def cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "leanagent.cli", *argv], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, cwd=REPO_ROOT, timeout=900)


@pytest.fixture(scope="module")
def exported(tiny_model, unit_repo, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("leancopilot")
    build_index(tiny_model, unit_repo, root / "index")
    done = export_leancopilot(root / "index", root / "out")  # the command itself: the tests below
    assert done.premises == 38 and done.code_from_corpus == 38 and not done.warnings
    return {"root": root, "index": root / "index", "out": root / "out", "done": done}


def real_premises(index: Path) -> set[tuple[str, str]]:
    return {(p["full_name"], p["path"]) for p in PremiseIndex.load(index, engine="torch", dtype="fp32").premises}


def test_the_folders_are_leancopilot_s_layout_and_read_back(exported, unit_repo) -> None:
    out = exported["out"]
    assert sorted(p.name for p in out.iterdir()) == sorted(["README.md", ENCODER.folder, PREMISES.folder])
    assert {"model.bin", "config.json", "vocabulary.json"} <= {p.name for p in (out / ENCODER.folder).iterdir()}
    index = PremiseIndex.load(exported["index"], engine="torch", dtype="fp32")
    embeddings = read_npy_double(out / PREMISES.folder / "embeddings.npy")  # as LeanCopilot reads it, or fails
    assert embeddings.shape == (len(index) + 1, index.embeddings.shape[1])
    assert np.array_equal(embeddings[1:], index.embeddings.double().numpy())  # the index's rows, exactly, from row 1
    assert np.allclose(embeddings[0], embeddings[1:].mean(axis=0), rtol=0, atol=1e-12)  # row 0: their centroid
    dictionary = json.loads((out / PREMISES.folder / "dictionary.json").read_text(encoding="utf-8"))
    assert list(dictionary) == [str(i) for i in range(len(index) + 1)]
    assert dictionary["0"] == PLACEHOLDER and " " in PLACEHOLDER["full_name"]  # no Lean name has a space
    corpus = {(p.path, p.full_name): p.code for p in Corpus.from_jsonl(unit_repo / "corpus.jsonl").premises}
    for i, premise in enumerate(index.premises):
        entry = dictionary[str(i + 1)]
        assert set(entry) == {"full_name", "path", "code"}
        assert (entry["full_name"], entry["path"]) == (premise["full_name"], premise["path"])
        assert entry["code"] == corpus[(premise["path"], premise["full_name"])]  # the source, untagged
    readme = (out / "README.md").read_text()
    for url in (ENCODER.url, PREMISES.url):
        assert url.split("huggingface.co/")[1] in readme
    assert "LEAN_COPILOT_CACHE_DIR" in readme and "## Go back" in readme and "ranks every premise" in readme
    assert "cuts it at 1,024 tokens" in readme and "Row 0 of `embeddings.npy` holds no premise" in readme


def test_leancopilot_s_retrieval_is_leanagent_retrieve_without_an_import_filter(exported, unit_repo) -> None:
    leancopilot = LeanCopilot(exported["out"])
    states = sorted(set(load_states([unit_repo / "random" / "test.json"])))
    assert len(states) >= 10
    for engine in (("torch", "fp32"), ("auto", "auto")):  # the reference, and what `leanagent retrieve` runs
        index = PremiseIndex.load(exported["index"], engine=engine[0], dtype=engine[1])
        for state in states:
            assert leancopilot.names(state, 10) == [h.full_name for h in index.retrieve(state, k=10)], (engine, state)


def test_leancopilot_never_returns_the_placeholder_row(exported, unit_repo) -> None:
    """Every test state and the special ones, at LeanCopilot's default k: k real premises, no abort (38 premises:
    the run-sized test checks k = 64 too); the export's own check saw the placeholder below the k best as well."""
    leancopilot = LeanCopilot(exported["out"])
    real = real_premises(exported["index"])
    tests = set(load_states([unit_repo / "random" / "test.json"]))
    best = len(leancopilot.embeddings)
    for state in sorted(tests) + list(SPECIAL_STATES):
        found = leancopilot.retrieve(state, 16)  # Aborted: LeanCopilot's assert, the test fails
        assert len(found) == 16 and all((name, path) in real for _, name, path, _, _ in found), state
        scores = leancopilot.scores(state)
        best = min(best, 1 + int((scores[1:] > scores[0]).sum()))
    done = exported["done"]
    assert best > 16 and done.placeholder_best_rank > 16, (best, done.placeholder_best_rank)
    assert done.checked_states == len(FIXED_STATES) + len(tests)


def test_the_export_s_own_check_is_leancopilot_s_retrieval(exported, unit_repo) -> None:
    """leanagent.export.leancopilot_native against the stand-in: the same k rows, in the same order."""
    from leanagent.export.leancopilot_native import LeanCopilotRetrieval

    mine, theirs = LeanCopilotRetrieval(exported["out"]), LeanCopilot(exported["out"])
    for state in sorted(set(load_states([unit_repo / "random" / "test.json"])))[:10] + list(SPECIAL_STATES):
        assert [r.row for r in mine.retrieve(state, 16)] == [row for row, *_ in theirs.retrieve(state, 16)], state


PARTIAL_SORT_CPP = r"""
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <vector>
int main() {
  long n, k;
  std::scanf("%ld %ld", &n, &k);
  std::vector<float> input(n);
  for (auto &v : input) std::scanf("%f", &v);
  std::vector<int> ids(n);
  std::iota(ids.begin(), ids.end(), 0);
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(),
                    [&input](const int &i1, const int &i2) { return input[i1] > input[i2]; });
  for (long j = 0; j < k; ++j) std::printf("%d\n", ids[j]);
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
def test_the_top_k_is_std_partial_sort_ties_and_all(tmp_path) -> None:
    """CTranslate2's CPU TopK is std::partial_sort with `input[i1] > input[i2]`: the stand-in's and the export's
    emulations give the compiled one's indices, in its order, on scores full of ties."""
    (tmp_path / "topk.cc").write_text(PARTIAL_SORT_CPP)
    subprocess.run(["g++", "-O2", "-o", str(tmp_path / "topk"), str(tmp_path / "topk.cc")], check=True, timeout=300)
    rng = np.random.default_rng(0)
    for n, k, levels in ((40, 16, 5), (300, 16, 3), (300, 64, 50), (1000, 17, 1000), (20000, 16, 7), (16, 16, 2)):
        scores = (rng.integers(0, levels, n) / 4).astype(np.float32)
        feed = f"{n} {k}\n" + "\n".join(repr(float(v)) for v in scores)
        compiled = subprocess.run([str(tmp_path / "topk")], input=feed, capture_output=True, text=True, check=True,
                                  timeout=60).stdout.split()
        assert [int(i) for i in compiled] == partial_sort(scores.tolist(), k) == top_k_indices(scores, k), (n, k)


def test_embeddings_are_refused_where_leancopilot_would_refuse_or_misread_them(tmp_path) -> None:
    rows = np.arange(12, dtype=np.float64).reshape(3, 4)
    np.save(tmp_path / "ok.npy", rows)
    assert np.array_equal(read_leancopilot_npy(tmp_path / "ok.npy"), rows)
    assert np.array_equal(read_npy_double(tmp_path / "ok.npy"), rows)
    np.save(tmp_path / "f32.npy", rows.astype(np.float32))
    np.save(tmp_path / "fortran.npy", np.asfortranarray(rows))
    (tmp_path / "short.npy").write_bytes((tmp_path / "ok.npy").read_bytes()[:-8])
    for name, why in (("f32", "dtype <f4"), ("fortran", "Fortran order"), ("short", "88 bytes of data")):
        with pytest.raises(LeanCopilotCrash, match=why):
            read_leancopilot_npy(tmp_path / f"{name}.npy")
        with pytest.raises(AssertionError):
            read_npy_double(tmp_path / f"{name}.npy")
    with pytest.raises(LeanCopilotCrash, match="sorts past the end"):
        top_k_indices(np.zeros(4, np.float32), 5)


def test_an_index_of_too_few_premises_for_leancopilot_s_k_is_refused(tiny_model, unit_repo, tmp_path, capsys) -> None:
    """12 premises: LeanCopilot's default k = 16 would return row 0 (or read past the rows) on every call."""
    small = tmp_path / "small"
    shutil.copytree(unit_repo, small)
    lines = (small / "corpus.jsonl").read_text().splitlines()
    (small / "corpus.jsonl").write_text(lines[0] + "\n")  # its first file: 12 premises, no imports
    build_index(tiny_model, small, tmp_path / "index")
    code, _, err = in_process(capsys, "export", str(tmp_path / "index"), str(tmp_path / "out"), "--format",
                              "leancopilot")
    assert code == 1 and len(err.strip().splitlines()) == 1 and "12 premises" in err, err
    assert "asks for its 16 best rows and aborts Lean when one is row 0" in err and not (tmp_path / "out").exists()


def test_the_summary_says_where_the_code_came_from(exported, tmp_path, capsys) -> None:
    code, out, err = in_process(capsys, "export", str(exported["index"]), str(tmp_path / "o"), "--format",
                                "leancopilot")
    assert code == 0, err
    assert "code of all 38 from their corpora;" in out and "the rest" not in out and "the other" not in out
    assert "16 premises each (its default k), never the placeholder row 0" in out


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


def test_install_moves_what_is_there_aside_and_never_deletes(exported, tiny_model, tmp_path, monkeypatch,
                                                             capsys) -> None:
    """LeanCopilot's folder and an earlier export are moved aside; the same export installed again moves nothing."""
    cache = tmp_path / "cache"
    theirs = cache / "huggingface.co" / "kaiyuy" / PREMISES.folder
    theirs.mkdir(parents=True)
    (theirs / "embeddings.npy").write_bytes(b"LeanCopilot's own")
    monkeypatch.setenv("LEAN_COPILOT_CACHE_DIR", str(cache))
    other = write_demo_repos(tmp_path / "other-data", 1, seed=6, scale=2)[0]  # 64 premises
    build_index(tiny_model, other, tmp_path / "other-index")
    for source, out, moved in ((exported["index"], "out1", 1), (tmp_path / "other-index", "out2", 2),
                               (tmp_path / "other-index", "out3", 0)):  # the last: the same export again
        code, stdout, stderr = in_process(capsys, "export", str(source), str(tmp_path / out), "--format",
                                          "leancopilot", "--install")
        assert code == 0, stderr
        assert stdout.count("installed: ") == 2 and stdout.count("moved aside: ") == moved, stdout
    # The encoder: ours, and the first export's moved aside; the premises: ours, the first's and LeanCopilot's.
    kept = sorted(p.name for p in theirs.parent.iterdir())
    assert len([n for n in kept if n.startswith(ENCODER.folder)]) == 2 and len(kept) == 5, kept
    asides = [p for p in theirs.parent.iterdir() if p.name.startswith(f"{PREMISES.folder}.before-leanagent-")]
    assert len(asides) == 2 and b"LeanCopilot's own" in {(p / "embeddings.npy").read_bytes() for p in asides}
    installed = LeanCopilot(tmp_path / "out2")  # what is in the cache now answers as the export does
    assert np.array_equal(read_npy_double(theirs / "embeddings.npy").astype(np.float32), installed.embeddings)


# The install in a subprocess, SIGKILLed right after the n-th of one kind of file-system step (a file copied, a
# rename, a swap of two names); `no-swap`: as on a system without a swap call. `cli`: the whole `leanagent export
# ... --install` command line; `install`: the install alone, of an export already in OUT (a second's imports).
KILLED_INSTALL = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from leanagent.export import leancopilot_cache as cache
    kind, after, mode, how = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    calls = {"copy": 0, "rename": 0, "swap": 0}
    def counted(step, real):
        def run(*args, **kwargs):
            result = real(*args, **kwargs)
            calls[step] += 1
            if step == kind and calls[step] == after:
                os.kill(os.getpid(), signal.SIGKILL)
            return result
        return run
    cache._copy_file = counted("copy", cache._copy_file)
    cache._rename = counted("rename", cache._rename)
    cache._exchange = counted("swap", (lambda a, b: False) if mode == "no-swap" else cache._exchange)
    if how == "cli":
        from leanagent import cli
        cli.main(sys.argv[5:])
    else:
        cache.install(Path(sys.argv[5]))
""")


def files_of(folder: Path) -> dict[str, bytes]:
    """A folder's files and their bytes, git's own left out (each export's commit differs by its time)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and ".git" not in p.relative_to(folder).parts}


def test_a_killed_install_leaves_each_folder_old_or_new_and_whole(exported, tmp_path, monkeypatch, capsys) -> None:
    """Killed at several points, retried each time: each of LeanCopilot's folders is always the one that was there
    or the export's, whole (but between the two renames of a system without a swap call: then the retry puts the
    export in place); in the end both are the export's and each old folder is set aside once, whatever the kills."""
    cache = tmp_path / "cache"
    kaiyuy = cache / "huggingface.co" / "kaiyuy"
    names = (ENCODER.folder, PREMISES.folder)
    old = {}

    def theirs() -> None:  # LeanCopilot's own folders, nothing else
        shutil.rmtree(cache, ignore_errors=True)
        for name in names:
            (kaiyuy / name / "sub").mkdir(parents=True)
            (kaiyuy / name / "model.bin").write_bytes(b"LeanCopilot's " + name.encode())
            (kaiyuy / name / "sub" / "x").write_text("theirs")
            old[name] = files_of(kaiyuy / name)

    out = tmp_path / "out"
    new = {name: files_of(exported["out"] / name) for name in names}
    env = {**os.environ, "LEAN_COPILOT_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1"}

    def install(kind: str, after: int, mode: str = "swap", how: str = "install") -> tuple[str, str]:
        """The install killed after the `after`-th step of `kind` (none: not killed); then each folder's state."""
        argv = ["export", str(exported["index"]), str(out), "--format", "leancopilot", "--force", "--install"] \
            if how == "cli" else [str(exported["out"])]
        done = subprocess.run([sys.executable, "-c", KILLED_INSTALL, kind, str(after), mode, how, *argv],
                              capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=900)
        assert done.returncode == (-signal.SIGKILL if kind else 0), done.stderr
        state = []
        for name in names:
            here = files_of(kaiyuy / name) if (kaiyuy / name).exists() else None
            state.append("old" if here == old[name] else "new" if here == new[name] else
                         "missing" if here is None else "broken")
        return tuple(state)

    def finished(how: str) -> None:
        if how == "cli":  # the command itself, in this process (its imports already paid)
            monkeypatch.setenv("LEAN_COPILOT_CACHE_DIR", str(cache))
            code, stdout, err = in_process(capsys, "export", str(exported["index"]), str(out), "--format",
                                           "leancopilot", "--force", "--install")
            assert code == 0 and stdout.count("moved aside: ") == 1, err  # the premises' (the encoder's: earlier)
            assert install("", 0) == ("new", "new")  # and once more: nothing to do, nothing moved
        else:
            assert install("", 0) == ("new", "new")
        for name in names:
            asides = sorted(p for p in kaiyuy.iterdir() if p.name.startswith(f"{name}.before-leanagent-"))
            assert [files_of(p) for p in asides] == [old[name]], name
        assert sorted(p.name for p in kaiyuy.iterdir() if p.name.startswith(".")) == []  # nothing half-done left

    theirs()
    # The command killed mid-copy of the encoder; then the install killed when both are copied and ready; with no
    # swap call, between moving the encoder aside and renaming the export into its place (the one gap); after the
    # premises' swap, before the old one is set aside. The command, run again, finishes.
    assert install("copy", 3, how="cli") == ("old", "old")
    assert install("rename", 2) == ("old", "old")
    assert install("rename", 5, "no-swap") == ("missing", "old")
    assert install("swap", 1) == ("new", "new")
    finished("cli")
    theirs()
    # Between the two folders' swaps, then after both before either old folder is set aside.
    assert install("swap", 1) == ("new", "old")
    assert install("swap", 1) == ("new", "new")
    finished("install")


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


@pytest.mark.slow
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
    assert leancopilot.names(state, 10) == [h.full_name for h in index.retrieve(state, k=10)]
    uncached = cli("index", "--model", "kaiyuy/not-here", "--dataset", str(unit_repo), "--out",
                   str(tmp_path / "i2"), env=env)
    assert uncached.returncode == 1 and "no snapshot of that Hugging Face model" in uncached.stderr
