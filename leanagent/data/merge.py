"""LeanAgent's "merge all" datasets: one LeanDojo dataset made of several repositories' datasets.

Under `lifelong.dataset_strategy: merge_all` repository i trains on repositories 0..i merged, with the rules of
LeanAgent's `DynamicDatabase.generate_merged_dataset`:

- corpus: files keyed by path, the first repository's copy kept (a later copy of the same path is dropped, even
  when its content differs; such paths are counted and named in `merge.json`, since a later repository's
  annotations may point into the version that was dropped);
- theorems: keyed by (file_path, full_name, start, end), the copy of the most recently processed repository (the
  later in the curriculum) kept.

One difference: LeanAgent re-splits the merged theorems itself (2% validation, 2% test, `random.seed(3407)`);
here each theorem stays in the benchmark split its kept copy was in, so the merged validation set is the union
of the repositories' validation sets and no repository's test theorem moves into training.

Under `replay` (`leanagent.data.replay`) the same rules merge only the drawn share of each earlier repository's
training theorems; with every share whole (a fraction of 1) the files written are `merge_all`'s, byte for byte.

The output is an ordinary LeanDojo dataset (`corpus.jsonl`, `SPLIT/{train,val,test}.json`), so `leanagent
validate` and `leanagent examples` read it, plus `merge.json`: the sources, the counts, and the SHA-256 of every
input and output file, by which a rerun tells a reusable merge from a stale one. It is written into a temporary
folder renamed into place, so a crash never leaves half a dataset under the final name.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from leanagent.data.errors import DatasetError
from leanagent.data.replay import Draw, drawn
from leanagent.data.theorems import read_split_json, split_source
from leanagent.ground.atomic import write_atomic
from leanagent.ground.file_digest import sha256_file
from leanagent.ground.names import CORPUS_FILE, DEFAULT_SPLIT, PART_FILES, TRAIN_PART, part_file

MERGE_FILE = "merge.json"
LISTED = 10  # conflicting paths named in merge.json


def dataset_files(split: str) -> list[str]:
    """The files of a dataset a run reads (and a merge writes), relative to its folder, corpus first:
    `corpus.jsonl`, `random/train.json`, `random/val.json`, `random/test.json`."""
    return [CORPUS_FILE, *(f"{split}/{name}" for name in PART_FILES)]


def digests(dataset: Path, split: str) -> dict[str, str]:
    """{relative name: SHA-256} of `dataset_files`; a missing file is recorded as "missing"."""
    return {name: sha256_file(dataset / name) if (dataset / name).is_file() else "missing"
            for name in dataset_files(split)}


def _theorem_key(raw: Any, where: str) -> tuple:
    try:
        return (raw["file_path"], raw["full_name"], tuple(raw["start"]), tuple(raw["end"]))
    except (KeyError, TypeError) as exc:
        raise DatasetError(f"{where}: a theorem needs file_path, full_name, start and end to be merged "
                           f"({type(exc).__name__}: {exc})") from None


def merge_datasets(sources: Sequence[Path], out: Path, split: str = DEFAULT_SPLIT,
                   draws: Sequence[Draw | None] | None = None) -> dict[str, Any]:
    """Write the merge of `sources` (in curriculum order) to the new folder `out`; return what `merge.json` holds.

    `draws[k]`, where given, keeps only that share of source k's training theorems (replay); None keeps them all.
    `merge.json` then records each draw under `replay`, with the positions in the source's `train.json` it kept."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out}: already exists; a merge is written only into a new folder")
    draws = list(draws) if draws is not None else [None] * len(sources)
    if len(draws) != len(sources):
        raise ValueError(f"{len(draws)} draws for {len(sources)} sources")
    inputs = {str(Path(s)): digests(Path(s), split) for s in sources}
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)  # our own leftover from a crash mid-merge
    (tmp / split).mkdir(parents=True)
    try:
        kept, conflicts = _merge_corpus(sources, tmp / CORPUS_FILE)
        counts, duplicates, replayed = _merge_theorems(sources, tmp / split, split, draws)
        info = {"sources": [str(Path(s)) for s in sources], "split": split, "files": kept,
                "corpus_conflicts": len(conflicts), "conflicting_paths": conflicts[:LISTED],
                "theorems": counts, "duplicate_theorems": duplicates, "inputs": inputs,
                "outputs": digests(tmp, split), **({"replay": replayed} if replayed else {})}
        write_atomic(tmp / MERGE_FILE, lambda f: json.dump(info, f, indent=2, sort_keys=True))
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return info


def _merge_corpus(sources: Sequence[Path], out: Path) -> tuple[int, list[str]]:
    """Corpus lines by path, the first copy kept byte for byte; (files kept, paths whose later copies differ)."""
    lines: dict[str, str] = {}
    conflicts: list[str] = []
    for source in sources:
        corpus = Path(source) / CORPUS_FILE
        with open(corpus, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    path = json.loads(line)["path"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise DatasetError(f"{corpus}:{lineno}: not a corpus record with a path") from None
                text = line.rstrip("\n")
                if path not in lines:
                    lines[path] = text
                elif lines[path] != text and path not in conflicts:
                    conflicts.append(path)

    def write(f) -> None:
        for text in lines.values():
            f.write(text + "\n")

    write_atomic(out, write)
    return len(lines), conflicts


def _merge_theorems(sources: Sequence[Path], out: Path, split: str, draws: Sequence[Draw | None]
                    ) -> tuple[dict[str, int], int, dict[str, dict[str, Any]]]:
    """Theorems by (file, name, start, end), the latest repository's copy kept, in the split that copy is in;
    each one at the position where its key first appeared; of a source with a draw, only the training theorems
    drawn. ({split file: count}, duplicates dropped, {source: its draw and the positions it kept})."""
    chosen: dict[tuple, tuple[str, Any]] = {}
    duplicates = 0
    replayed: dict[str, dict[str, Any]] = {}
    for source, draw in zip(sources, draws, strict=True):
        for name in PART_FILES:
            path = Path(source) / split / name
            where = split_source(path)
            theorems = read_split_json(path)
            positions: Sequence[int] = range(len(theorems))
            if draw is not None and name == part_file(TRAIN_PART):
                positions = drawn(len(theorems), draw)
                replayed[str(Path(source))] = {"fraction": draw.fraction, "key": draw.key, "of": len(theorems),
                                               "kept": len(positions), "positions": list(positions)}
            for k in positions:
                key = _theorem_key(theorems[k], f"{Path(source).name}/{where}: theorem #{k}")
                duplicates += key in chosen
                chosen[key] = (name, theorems[k])
    counts = {}
    for name in PART_FILES:
        theorems = [raw for split_name, raw in chosen.values() if split_name == name]
        counts[name.removesuffix(".json")] = len(theorems)
        write_atomic(out / name, lambda f, t=theorems: json.dump(t, f, ensure_ascii=False))
    return counts, duplicates, replayed
