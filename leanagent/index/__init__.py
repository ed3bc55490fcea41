"""A premise index: a dataset's corpus embedded once, queried many times by a prover.

`build_index` embeds the corpus with the retriever's own sorted, token-budget `embed_corpus` and writes
an INDEX folder:

- `embeddings.safetensors`: one bf16 row per premise, in corpus order (tensor `embeddings`);
- `premises.jsonl`: per premise its path, full_name, start, end, kind and the serialized text the
  retriever encoded, line k for row k;
- `files.jsonl`: per corpus file its direct imports, its premises' row range and the last line a
  premise of it reaches: what accessibility needs, in the corpus's own terms, so the import closure
  is computed by the same `Corpus` code evaluation uses (exactly the same premises count);
- `names.json`: the premise names (as Lean writes them) and the module names a server lists, each once, in the
  order a client caches them; an index written after another (the next stage of a lifelong run) keeps the other's
  lists as they were and appends its new names, so a client's cached positions keep their meaning;
- `index.json`, written last (a folder without it is an unfinished index): the model and its identity
  (path, and per weights file its size, modification time and SHA-256; `leanagent.model_identity`),
  the SHA-256 of `embeddings.safetensors`, the datasets, the embedding width and count, and the lengths states
  and premises are cut at.

`PremiseIndex.load` reads it, refuses it when the model is no longer the one that embedded the corpus
(a retrained `last.ckpt` at the same path would otherwise answer with stale embeddings), when the embeddings are
not the bytes index.json names (a flipped byte, another index's file), not finite or not unit length, or not what
the model gives for a few of the premises, and every file it cannot read, in one line naming the file (and line)
and the problem; then it loads the encoder once. `PremiseIndex.retrieve` formats a proof state as training did,
encodes it and ranks premises with `top_k_accessible`, restricted to those accessible at a file and line when
given: the premises of the files it imports (transitively) and those of the same file ending at or before that
position. Any line from 1 on is a position: past a file's last premise, all of its premises count.

One concern a module: `files.py` (the files, their format, the writer), `build.py` (`build_index`), `stage.py`
(`StageIndex`, a lifelong run's stage), `read.py` (load and verify), `query.py` (`PremiseIndex`, `Hit`), `cache.py`
(`retrieve`, an index kept per process). This package names what the rest of leanagent uses, imported on first use
so that `import leanagent.index.files` costs no model.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "INDEX_FILE": "files", "EMBEDDINGS_FILE": "files", "PREMISES_FILE": "files", "FILES_FILE": "files",
    "NAMES_FILE": "files", "INDEX_FILES": "files", "FILE_WITHOUT_LINE": "files", "PremiseIndexError": "files",
    "read_names": "files", "served_names": "files", "write_index": "files", "build_index": "build",
    "StageIndex": "stage", "Hit": "query", "PremiseIndex": "query", "retrieve": "cache",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(f"leanagent.index.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'leanagent.index' has no attribute {name!r}")
