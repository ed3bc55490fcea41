"""Where LeanCopilot looks for its retriever, and how an export gets there and back.

Facts of LeanCopilot (lean-dojo/LeanCopilot) this follows:

- Its built-in retriever is two model URLs (`LeanCopilot/Models/Builtin.lean`): `encoder` and `premisesUrl`
  (`ENCODER`, `PREMISES`). A URL's folder is `CACHE / host / path` (`ModelCheckpointManager/Download.lean`,
  `getModelDir`), CACHE being `$LEAN_COPILOT_CACHE_DIR`, else `~/.cache/lean_copilot/models`.
- Before it reads the premise folder it asks whether the folder is up to date (`isUpToDate`): inside it, `git fetch
  --quiet --all`, `git symbolic-ref refs/remotes/origin/HEAD --short`, then `git diff BRANCH origin/BRANCH
  --shortstat`, any failure an error of `select_premises`. `lake exe LeanCopilot/download` asks the same of every
  folder, and deletes one it finds out of date before cloning the published one again.

So an exported folder is made a git repository that is its own origin (`make_git_ready`: one empty commit on
`main`, origin `.`, fetched): those three commands then succeed offline and find nothing to update, and `lake exe
LeanCopilot/download` leaves the folder alone. The files themselves stay untracked (no copy in git's objects).

`install` puts an export's two folders there; a folder already there (LeanCopilot's published one, or an earlier
export) is moved aside with a dated suffix, never deleted, so going back is one `mv`. A kill at any moment leaves
each folder either the one that was there or the export's, whole, and the next `--install` finishes or undoes what
the killed one left, moving nothing aside twice:

1. each folder is copied beside its target (`.NAME.leanagent-incoming`), then renamed `.NAME.leanagent-ready` once
   whole; a journal beside it (`.NAME.leanagent-install.json`, the export's id) is written next;
2. the ready folder and the target swap names in one system call (Linux `renameat2(RENAME_EXCHANGE)`, macOS
   `renamex_np(RENAME_SWAP)`), the two folders one after the other; where neither exists, the target is renamed
   aside and the ready folder into its place, two calls;
3. what the swap left at the ready name (the folder that was there) is renamed aside, and the journal removed.

A later install first clears a killed one's leftovers (`_recover`): an incoming folder is a partial copy, removed; a
ready folder is either a whole copy never swapped in (removed) or, when the target holds the journal's export, the
folder that was there (moved aside); a missing target with a ready folder is put in place. A target that already is
this export (its `leanagent-export.json` id) is left as it is: a retry moves nothing aside again.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from leanagent.ground.file_digest import sha256_file

CACHE_ENV = "LEAN_COPILOT_CACHE_DIR"
DEFAULT_CACHE = "~/.cache/lean_copilot/models"
ASIDE = ".before-leanagent-"  # + the time it was moved aside
GIT_IDENTITY = ("-c", "user.name=leanagent", "-c", "user.email=leanagent@localhost")
EXPORT_FILE = "leanagent-export.json"  # in each exported folder: which export it is
INCOMING, READY, JOURNAL = ".leanagent-incoming", ".leanagent-ready", ".leanagent-install.json"  # .NAME + these


@dataclass(frozen=True)
class CacheFolder:
    """One of the models LeanCopilot's retrieval reads: its built-in URL, and the folder an export writes for it."""

    role: str
    url: str

    @property
    def folder(self) -> str:
        return urlparse(self.url).path.rstrip("/").rsplit("/", 1)[-1]

    def cache_path(self, root: Path | None = None) -> Path:
        parsed = urlparse(self.url)
        return (root or cache_root()) / parsed.hostname / parsed.path.strip("/")


ENCODER = CacheFolder("encoder", "https://huggingface.co/kaiyuy/ct2-leandojo-lean4-retriever-byt5-small")
PREMISES = CacheFolder("premises", "https://huggingface.co/kaiyuy/premise-embeddings-leandojo-lean4-retriever-byt5-small")
LEANCOPILOT_FOLDERS = (ENCODER, PREMISES)


def cache_root() -> Path:
    """LeanCopilot's model cache on this machine, as it computes it."""
    given = os.environ.get(CACHE_ENV)
    return Path(given).expanduser() if given else Path(DEFAULT_CACHE).expanduser()


def make_git_ready(folder: Path) -> bool:
    """Make `folder` pass LeanCopilot's up-to-date check (module docstring); False when git is not installed."""
    git = shutil.which("git")
    if git is None:
        return False
    for args in (["init", "-q", "-b", "main"], [*GIT_IDENTITY, "commit", "-q", "--allow-empty", "-m",
                                                 "leanagent export (files untracked)"],
                 ["remote", "add", "origin", "."], ["fetch", "-q", "origin"], ["remote", "set-head", "origin", "main"]):
        subprocess.run([git, *args], cwd=folder, check=True, capture_output=True, timeout=60)
    return True


def write_export_id(out: Path) -> str:
    """Mark both folders of an export in `out` with one id, the SHA-256 of their files (git's own left out): how an
    install knows a folder in the cache already is this export, so that a retry moves nothing aside again."""
    digest = hashlib.sha256()
    for folder in LEANCOPILOT_FOLDERS:
        root = Path(out) / folder.folder
        for path in sorted(p for p in root.rglob("*") if p.is_file() and ".git" not in p.relative_to(root).parts):
            digest.update(f"{folder.folder}/{path.relative_to(root).as_posix()}\0{sha256_file(path)}\0".encode())
    export = digest.hexdigest()
    for folder in LEANCOPILOT_FOLDERS:
        (Path(out) / folder.folder / EXPORT_FILE).write_text(json.dumps({"export_id": export}), encoding="utf-8")
    return export


def export_id(folder: Path) -> str | None:
    """The id `write_export_id` gave `folder` (None: not an export's, or unreadable)."""
    try:
        found = json.loads((Path(folder) / EXPORT_FILE).read_text(encoding="utf-8")).get("export_id")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None


def install(out: Path, root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """Put an export's two folders into LeanCopilot's cache, each whole or not at all (module docstring); a folder
    already there is moved aside with a dated suffix. Returns (moved aside, installed)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    targets = [folder.cache_path(root) for folder in LEANCOPILOT_FOLDERS]
    moved: list[Path] = []
    for target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
        moved += _recover(target, stamp)
    # An export written before exports had an id gets one now: a journal must name what it swaps in.
    new_id = export_id(Path(out) / ENCODER.folder) or write_export_id(out)
    staged = []
    for folder, target in zip(LEANCOPILOT_FOLDERS, targets, strict=True):
        if export_id(target) == new_id:
            continue  # already this export: a retry after a kill
        incoming = _beside(target, INCOMING)
        shutil.copytree(Path(out) / folder.folder, incoming, symlinks=True, copy_function=_copy_file)
        _rename(incoming, _beside(target, READY))
        staged.append(target)
    for target in staged:
        _write_journal(target, new_id)
    for target in staged:  # the swaps of both folders together, one system call each where the system has one
        ready = _beside(target, READY)
        if not (target.exists() or target.is_symlink()):
            _rename(ready, target)
        elif not _exchange(ready, target):
            moved.append(_aside(target, stamp))
            _rename(target, moved[-1])
            _rename(ready, target)
    for target in staged:
        ready = _beside(target, READY)
        if ready.exists() or ready.is_symlink():  # what the swap took out of the target's place
            moved.append(_aside(target, stamp))
            _rename(ready, moved[-1])
        _beside(target, JOURNAL).unlink(missing_ok=True)
    return moved, targets


def _recover(target: Path, stamp: str) -> list[Path]:
    """Finish or undo what a killed install left beside `target` (module docstring); returns what it moved aside."""
    incoming, ready, journal = (_beside(target, suffix) for suffix in (INCOMING, READY, JOURNAL))
    if incoming.exists():
        shutil.rmtree(incoming)
    moved = []
    if ready.exists() or ready.is_symlink():
        swapping = _journal_id(target)
        if swapping is not None and not (target.exists() or target.is_symlink()):
            _rename(ready, target)  # killed between the two renames of a system without a swap call
        elif swapping is not None and export_id(target) == swapping:
            moved.append(_aside(target, stamp))  # swapped: the ready name holds the folder that was there
            _rename(ready, moved[-1])
        else:
            shutil.rmtree(ready)  # a whole copy, never swapped in
    journal.unlink(missing_ok=True)
    journal.with_name(f"{journal.name}.tmp").unlink(missing_ok=True)  # a journal killed while being written
    return moved


def _beside(target: Path, suffix: str) -> Path:
    return target.with_name(f".{target.name}{suffix}")


def _aside(target: Path, stamp: str) -> Path:
    """A free name to move `target` aside to: `NAME.before-leanagent-STAMP`, then `-1`, `-2`, ..."""
    aside, n = target.with_name(f"{target.name}{ASIDE}{stamp}"), 1
    while aside.exists() or aside.is_symlink():
        aside, n = target.with_name(f"{target.name}{ASIDE}{stamp}-{n}"), n + 1
    return aside


def _write_journal(target: Path, new_id: str) -> None:
    journal = _beside(target, JOURNAL)
    tmp = journal.with_name(f"{journal.name}.tmp")
    tmp.write_text(json.dumps({"export_id": new_id}), encoding="utf-8")
    _rename(tmp, journal)


def _journal_id(target: Path) -> str | None:
    try:
        found = json.loads(_beside(target, JOURNAL).read_text(encoding="utf-8")).get("export_id")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None


# The file system's steps, each one function (a test kills the command after any of them).
def _copy_file(src: str, dst: str) -> str:
    return shutil.copy2(src, dst)


def _rename(src: Path, dst: Path) -> None:
    os.rename(src, dst)


_AT_FDCWD, _RENAME_EXCHANGE, _RENAME_SWAP = -100, 2, 2  # <fcntl.h>, <linux/fs.h>, macOS <stdio.h>


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names `a` and `b` in one system call; False where the system (or its file system) has none."""
    libc = ctypes.CDLL(None, use_errno=True)
    if hasattr(libc, "renameat2"):
        done = libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    elif hasattr(libc, "renamex_np"):
        done = libc.renamex_np(os.fsencode(a), os.fsencode(b), _RENAME_SWAP)
    else:
        return False
    if done == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def readme(index: Path, meta: dict[str, Any], stage: str | None, premises: int, width: int, cut: int) -> str:
    """OUT/README.md: what the folders are, where LeanCopilot reads them, how to put them there and go back. `cut`:
    the tokens leanagent cuts a state at (the index's `context_max_len`)."""
    where = f"stage {stage} of a lifelong run, index `{index}`" if stage else f"index `{index}`"
    lines = [
        "# A leanagent retriever for LeanCopilot",
        "",
        f"Exported from {where}: {premises:,} premises, embeddings {width} wide, model "
        f"`{meta.get('checkpoint') or meta.get('model')}`.",
        "",
        "LeanCopilot's `select_premises` reads two folders from its model cache, named by its built-in model",
        "URLs (`LeanCopilot/Models/Builtin.lean`). The cache is `$LEAN_COPILOT_CACHE_DIR`, or",
        "`~/.cache/lean_copilot/models` when that is unset, and a URL's folder is the cache followed by the URL's",
        "host and path:",
        "",
        "| folder here | what | LeanCopilot's folder (default cache) |",
        "| --- | --- | --- |",
    ]
    for folder, what in ((ENCODER, "the encoder, converted to CTranslate2 (float32)"),
                         (PREMISES, "`embeddings.npy` (float64) and `dictionary.json`")):
        lines.append(f"| `{folder.folder}/` | {what} | `{DEFAULT_CACHE}/{folder.cache_path(Path('.')).as_posix()}` |")
    lines += [
        "",
        "## Put them there",
        "",
        "`leanagent export SOURCE --format leancopilot OUT --install` does it: each folder LeanCopilot has there",
        f"now is moved aside (renamed with the suffix `{ASIDE}DATE-TIME`, never deleted), then these are copied",
        "in. By hand, the same for each folder:",
        "",
        "```bash",
        f"CACHE=${{{CACHE_ENV}:-$HOME/.cache/lean_copilot/models}}/huggingface.co/kaiyuy",
        "mkdir -p \"$CACHE\"",
    ]
    for folder in LEANCOPILOT_FOLDERS:
        lines += [f"[ -e \"$CACHE/{folder.folder}\" ] && mv \"$CACHE/{folder.folder}\" "
                  f"\"$CACHE/{folder.folder}{ASIDE}$(date +%Y%m%d-%H%M%S)\"",
                  f"cp -r {folder.folder} \"$CACHE/\""]
    lines += [
        "```",
        "",
        "Each folder is a git repository that is its own origin (one empty commit, the files untracked): LeanCopilot",
        "runs `git fetch` and `git diff` in its premise folder before using it, and `lake exe LeanCopilot/download`",
        "deletes a folder it finds out of date. These checks then pass offline and nothing is downloaded over them.",
        "If git was missing when this was exported, run in each folder: `git init -b main && git commit --allow-empty",
        "-m export && git remote add origin . && git fetch origin && git remote set-head origin main`.",
        "",
        "Restart Lean (the server of your editor) afterwards: LeanCopilot loads both once per process.",
        "",
        "## Go back",
        "",
        "Delete the two folders from the cache and rename the ones moved aside back (drop the suffix). If there were",
        "none, delete ours and run `lake exe LeanCopilot/download` to fetch LeanCopilot's published retriever again.",
        "",
        "## What differs from `leanagent serve`",
        "",
        "LeanCopilot ranks every premise here by dot product, whatever the current file imports; `leanagent",
        "serve` (and `leanagent retrieve --file ... --line ...`) ranks only the premises the state may use.",
        f"LeanCopilot also encodes the whole state, where leanagent cuts it at {cut:,} tokens (one per UTF-8 byte,",
        "the last `</s>`: the run's `data.max_seq_len`, as training and evaluation cut states); for shorter states",
        "the two agree to float rounding.",
        "",
        "Row 0 of `embeddings.npy` holds no premise: LeanCopilot stops Lean when row 0 is among the premises it",
        "returns (its C++ asserts the index is above 0), so the export puts the mean of the premises' rows there,",
        "which ranks below the best k unless fewer than k premises score above their mean, and checked",
        "that LeanCopilot's retrieval does not return it at its default k (16) on the datasets' test states. Its",
        "entry in `dictionary.json` names no premise.",
        "",
        "A newer stage of the run is not picked up by itself: export it again (with `--install`) when it is done.",
        "",
    ]
    return "\n".join(lines)
