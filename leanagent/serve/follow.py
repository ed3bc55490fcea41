"""`leanagent serve RUN_DIR`: serve a lifelong run's newest finished stage, and follow the run as it learns.

After each repository the flow's evaluation job writes the stage's premise index (the stage's model over the
union of every repository's corpus so far, from the embeddings the evaluation computed) and the manifest records
it. A `StageFollower` thread reads the manifest every few seconds; when a newer stage has an index, it loads it
beside the one being served (the model and the embeddings: for a while both are in memory), builds its server,
and swaps it in (`ServerHolder.swap`): a request takes the server current when it starts and finishes on it, so
requests in flight finish on the old stage and none fails; the old server is closed, and its memory let go, when
its last request is answered. A stage whose index cannot be used (unfinished, corrupt, its model gone) is not
taken: the server goes on serving, says so once, and tries again when a newer stage finishes.

A client caches the lists of indexed premises and modules for its whole process and then names premises by their
position in them. A stage's lists extend the previous stage's (the flow writes them so, `names.json`), so a
client that cached them at an earlier stage still means the same premises; what the new stage adds is at the end.
"""

from __future__ import annotations

import ctypes
import gc
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from leanagent.index.files import INDEX_FILES
from leanagent.run.manifest import MANIFEST_NAME, read_manifest, stage_indexes
from leanagent.serve.server import PremiseServer

DEFAULT_FOLLOW_S = 10.0


@dataclass(frozen=True)
class Stage:
    """A finished stage of a run with its index: the repository trained through, its position, the index folder."""

    position: int
    name: str
    index: Path


class StageRefused(ValueError):
    """A stage whose index is not the run's own (outside its folder); the message is one line."""


def run_stages(run_dir: Path) -> list[Stage]:
    """The run's finished stages that have an index, in curriculum order; ManifestUnreadableError (one line naming
    the manifest and the key) for a manifest cut short or of the wrong shape."""
    manifest = read_manifest(Path(run_dir) / MANIFEST_NAME)
    return [Stage(position, name, Path(folder)) for position, name, folder in stage_indexes(manifest)]


def check_inside(run_dir: Path, stage: Stage) -> None:
    """A stage's index folder, and each of its files, must lie inside the run's folder once links are resolved:
    the manifest names what is served, and a link out of the run would serve whatever it points to."""
    root = Path(run_dir).resolve()
    folder = (root / stage.index).resolve()
    for path in (folder, *((folder / name).resolve() for name in INDEX_FILES)):
        if not path.is_relative_to(root):
            raise StageRefused(f"{stage.index}: resolves to {path}, outside the run's folder {root}; a run serves "
                               f"only the indexes it wrote")


def is_run_dir(path: Path) -> bool:
    return (Path(path) / MANIFEST_NAME).is_file()


class ServerHolder:
    """The server requests are answered by: taken per request (`using`), swapped whole (`swap`)."""

    def __init__(self, server: PremiseServer) -> None:
        self._lock = threading.Lock()
        self._current: PremiseServer | None = server
        self._users: dict[int, int] = {}
        self._in_use: dict[int, PremiseServer] = {}  # servers with a request running (a swapped-out one among them)
        self.requests = 0  # retrievals answered, by whichever server (`answered`)

    @property
    def current(self) -> PremiseServer:
        if self._current is None:
            raise RuntimeError("the server has been released")
        return self._current

    def answered(self) -> None:
        with self._lock:
            self.requests += 1

    @contextmanager
    def using(self) -> Iterator[PremiseServer]:
        """The current server for the length of one request, however many swaps happen meanwhile."""
        with self._lock:
            server = self.current
            self._users[id(server)] = self._users.get(id(server), 0) + 1
            self._in_use[id(server)] = server
        try:
            yield server
        finally:
            with self._lock:
                self._users[id(server)] -= 1
                done = not self._users[id(server)] and server is not self._current
                if not self._users[id(server)]:
                    del self._users[id(server)]
                    del self._in_use[id(server)]
            if done:
                server.close()

    def abort(self) -> None:
        """The process stops: every server with requests running (and the current one) ends them with a 503 at
        once (`PremiseServer.abort`)."""
        with self._lock:
            servers = [*self._in_use.values(), *([self._current] if self._current is not None else [])]
        for server in servers:
            server.abort()

    def release(self, wait_s: float) -> None:
        """Let go of the served stage when the server has stopped, its threads ended (up to `wait_s` each): its
        model is then freed here and now. Left to the interpreter's exit, a CTranslate2 encoder is never freed, and
        the process can abort as it exits ("terminate called without an active exception", seen after a swap)."""
        with self._lock:
            server, self._current = self._current, None
        if server is not None:
            server.close(wait_s)
        gc.collect()

    def swap(self, server: PremiseServer) -> PremiseServer:
        """Serve `server` from the next request on; the old one is closed once its requests are answered."""
        with self._lock:
            old, self._current = self._current, server
            idle = not self._users.get(id(old))
        if idle and old is not server:
            old.close()
        return old


def give_back_memory() -> None:
    """Collect what nothing references any more, and hand the C allocator's free pages back to the system (glibc's
    `malloc_trim`): a swapped-out stage's model and embeddings are freed when its last request ends, but glibc keeps
    freed heap pages for the process unless told, so its resident memory would stay at the peak of the swap."""
    gc.collect()
    trim_heap()


def trim_heap() -> None:
    """The C allocator's free pages handed back to the system (glibc's `malloc_trim`), without a garbage collection
    (which holds the interpreter's lock: 2 s on a loaded machine, every other thread waiting). A ctypes call lets
    the lock go while it runs."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS): its allocator returns pages itself
        return
    trim(0)


class StageFollower(threading.Thread):
    """Every `every_s` seconds, the run's newest stage with an index; a newer one than served is loaded in the
    background (`load`) and swapped in. `log` gets one line per stage taken, and one per stage that cannot be."""

    def __init__(self, run_dir: Path, holder: ServerHolder, served: Stage, load: Callable[[Stage], PremiseServer],
                 log: Callable[[str], None], every_s: float = DEFAULT_FOLLOW_S) -> None:
        super().__init__(name="leanagent-follow-run", daemon=True)
        self.run_dir = Path(run_dir)
        self.holder = holder
        self.served = served
        self.load = load
        self.log = log
        self.every_s = every_s
        self.refused: set[tuple[int, str]] = set()
        self._stopping = threading.Event()
        # Servers swapped out and not yet freed (their last request may still run): memory is given back when they go.
        self._retired: list[weakref.ref[PremiseServer]] = []

    def stop(self, wait_s: float = 0.0) -> None:
        """Stop following; `wait_s`: how long to wait for a stage being loaded (the thread ends after it)."""
        self._stopping.set()
        if wait_s and self.is_alive():
            self.join(timeout=wait_s)

    def check(self) -> Stage | None:
        """Take the newest stage if it is newer than the one served and loads; the stage now served, if it moved."""
        stages = run_stages(self.run_dir)
        if not stages or stages[-1].position <= self.served.position:
            return None
        newest = stages[-1]
        key = (newest.position, str(newest.index))
        if key in self.refused:
            return None
        try:
            check_inside(self.run_dir, newest)
            server = self.load(newest)
        except Exception as exc:  # any reason a stage cannot be served: the current one goes on
            self.refused.add(key)
            self.log(f"warning: stage {newest.name} (#{newest.position + 1}) cannot be served, still serving "
                     f"{self.served.name}: {_one_line(exc)}")
            return None
        self._retired.append(weakref.ref(self.holder.swap(server)))
        self.log(f"now serving stage {newest.name} (#{newest.position + 1}): {len(server.premise_names)} premises, "
                 f"{len(server.module_names)} modules")
        self.served = newest
        return newest

    def release_retired(self) -> bool:
        """Give memory back once a swapped-out server is gone (its last request answered); whether one went."""
        if not self._retired:
            return False
        gc.collect()
        alive = [ref for ref in self._retired if ref() is not None]
        gone = len(alive) < len(self._retired)
        self._retired = alive
        if gone:
            give_back_memory()
        return gone

    def run(self) -> None:
        """Poll until stopped, whatever goes wrong: each problem (a manifest cut short or of the wrong shape, a
        folder that cannot be read) is logged once, in one line, while it lasts, and the next poll tries again."""
        said: str | None = None
        while not self._stopping.wait(self.every_s):
            try:
                self.check()
                self.release_retired()
                said = None
            except Exception as exc:
                line = f"warning: cannot follow the run, still serving {self.served.name}: {_one_line(exc)}"
                if line != said:
                    self.log(line)
                    said = line


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}" if not first or isinstance(exc, MemoryError | KeyError | TypeError) \
        else first
