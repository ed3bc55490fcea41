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
export) is moved aside with a dated suffix, never deleted, so going back is one `mv`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from leanagent.index.read import IndexMeta

CACHE_ENV = "LEAN_COPILOT_CACHE_DIR"
DEFAULT_CACHE = "~/.cache/lean_copilot/models"
ASIDE = ".before-leanagent-"  # + the time it was moved aside
GIT_IDENTITY = ("-c", "user.name=leanagent", "-c", "user.email=leanagent@localhost")


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


def install(out: Path, root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """Copy an export's two folders into LeanCopilot's cache; a folder already there is moved aside first, with a
    dated suffix. Returns (moved aside, installed)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved, installed = [], []
    for folder in LEANCOPILOT_FOLDERS:
        target = folder.cache_path(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists() or target.is_symlink():
            aside = target.with_name(f"{target.name}{ASIDE}{stamp}")
            n = 1
            while aside.exists():
                aside, n = target.with_name(f"{target.name}{ASIDE}{stamp}-{n}"), n + 1
            target.rename(aside)
            moved.append(aside)
        shutil.copytree(Path(out) / folder.folder, target, symlinks=True)
        installed.append(target)
    return moved, installed


def readme(index: Path, meta: IndexMeta, stage: str | None, premises: int, width: int) -> str:
    """OUT/README.md: what the folders are, where LeanCopilot reads them, how to put them there and go back."""
    where = f"stage {stage} of a lifelong run, index `{index}`" if stage else f"index `{index}`"
    lines = [
        "# A leanagent retriever for LeanCopilot",
        "",
        f"Exported from {where}: {premises:,} premises, embeddings {width} wide, model "
        f"`{meta.named_model}`.",
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
        "LeanCopilot also encodes the whole state as Lean prints it, where leanagent drops a leading `N goals`",
        "line and cuts a state at 1,024 bytes, as training did; for shorter states the two agree to float rounding.",
        "",
        "A newer stage of the run is not picked up by itself: export it again (with `--install`) when it is done.",
        "",
    ]
    return "\n".join(lines)
