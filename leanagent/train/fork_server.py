"""The fork server of `launcher: warm` (leanagent/launch/warm.py): torch, Lightning and the rank programs imported
once, each job's ranks forked from here.

`python -m leanagent.train.fork_server FD` serves the Unix socket it inherits as FD (bound by `start_fork_server`).
For each request it forks an agent (`run_agent`), which stands where torchrun stands: it forks one rank per device
(`run_rank`) with torchrun's variables, relays their output to the launcher with `[rank N] ` prefixes and to
`LOG_DIR/<run id>/attempt_0/<local rank>/{stdout,stderr}.log` as torchrun's `--tee` does, ends the other ranks
when one fails (SIGTERM, SIGKILL 30 s later, as torchrun), reports the job's exit code and exits.

Forking after torch's import, and what keeps it safe:

- Threads: a fork copies only the calling thread; a lock another thread held stays locked in the child forever.
  The imports start no thread of torch's (its OpenMP/MKL intra-op pool and its inter-op pool start at the first
  parallel op), Lightning and transformers start none, and Prefect is not imported. numpy's OpenBLAS starts its
  pool when loaded: the server runs with OPENBLAS_NUM_THREADS=1, so it starts none. The server never runs a torch
  op, and before every fork it checks that it is one thread (/proc/self/task), refusing the job otherwise. The agent,
  forked from it, starts no thread before it has forked every rank.
- Thread counts: OpenMP reads OMP_NUM_THREADS when loaded, so each rank sets its own with `torch.set_num_threads`:
  the job's OMP_NUM_THREADS, which the agent sets to 1 with 2+ ranks as torchrun does (same sums, same bits), or,
  with one rank and none set, the default a fresh interpreter would take (the server starts without the variable).
- What a fresh interpreter would redo: the environment (replaced whole, C's `environ` too), the working folder,
  `sys.argv`, signal handlers, Lightning's rank-zero flag (read from RANK at its import), numpy's global seed
  (Python's `random` reseeds itself at fork), new PYTHONPATH entries with their `sitecustomize`, and the exit
  (non-daemon threads joined, atexit handlers run, streams flushed; the server's own frames never unwind in a rank).
- Not redone: what the imports themselves read from the environment (the server's, at its start), warnings
  already shown by the imports (in the server's output, not the ranks' logs), and the hash seed (one for all ranks).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib.util
import json
import os
import runpy
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import pytorch_lightning  # noqa: F401  (imported once here, for every rank)
import torch
from lightning_fabric.utilities import rank_zero as fabric_rank_zero
from pytorch_lightning.utilities import rank_zero as pl_rank_zero

import leanagent.train.programs  # noqa: F401  (the rank programs and everything they import)
from leanagent.ground.supervision import (
    ENV_SUPERVISOR_PID,
    ENV_SUPERVISOR_START,
    EXIT_SUPERVISOR_GONE,
    WATCH_INTERVAL_S,
    find_process,
    running,
)
from leanagent.launch.warm import HEADER, READY

TERM_GRACE_S = 30.0  # torchrun's: SIGTERM to the other ranks when one fails, SIGKILL this much later
DRAIN_S = 2.0  # after the last rank ended, output still on its way (a rank's orphaned child may hold a pipe)
RUN_ID = "warm"
# Fresh-interpreter signal dispositions: Python's own SIGINT handler and SIGPIPE ignored, every other default.
DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def thread_count() -> int:
    """This process's OS threads (Linux), or Python's own count where /proc is missing."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def serve(listener: socket.socket) -> None:
    """Accept jobs forever: one forked agent each; the agents are reaped by the kernel (SIGCHLD ignored)."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    default_threads = torch.get_num_threads()  # a fresh interpreter's, with no OMP_NUM_THREADS (see the docstring)
    gc.freeze()  # the imports' objects stay shared with the ranks, untouched by their collections
    print(READY, flush=True)
    while True:
        conn, _ = listener.accept()
        try:
            header, fds, _, _ = socket.recv_fds(conn, HEADER.size, 1)
            (size,) = HEADER.unpack(header)
            body = b""
            while len(body) < size:
                chunk = conn.recv(size - len(body))
                if not chunk:
                    raise OSError("the launcher closed the socket mid-request")
                body += chunk
            request = json.loads(body)
        except (OSError, ValueError, struct.error) as exc:
            conn.close()
            print(f"[fork server] a bad request: {exc}", file=sys.stderr, flush=True)
            continue
        threads = thread_count()
        if threads != 1 or len(fds) != 1:
            why = f"it runs {threads} threads; it forks from one only" if threads != 1 else "no output pipe"
            conn.sendall(json.dumps({"error": why}).encode() + b"\n")
            conn.close()
            for fd in fds:
                os.close(fd)
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                listener.close()
                code = run_agent(request, conn, fds[0], default_threads)
            except BaseException:
                traceback.print_exc()  # to the launcher, as the agent's own output
                with contextlib.suppress(OSError):
                    conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
            finally:
                os._exit(code)
        conn.close()
        os.close(fds[0])


# ---- the agent: torchrun's part ------------------------------------------------------------------------------

class Stream:
    """One rank's stdout or stderr: relayed line by line with the rank's prefix, and written whole to its log."""

    def __init__(self, fd: int, prefix: bytes, log: Path) -> None:
        self.fd = fd
        self.prefix = prefix
        self.log = open(log, "wb", buffering=0)  # noqa: SIM115 - closed by `close`
        self.partial = b""

    def relay(self, out: int) -> bool:
        """Read what is there; False at the end of the stream."""
        chunk = os.read(self.fd, 65536)
        if not chunk:
            if self.partial.rstrip(b"\r"):
                write_all(out, self.prefix + self.partial.rstrip(b"\r") + b"\n")
                self.partial = b""
            return False
        self.log.write(chunk)
        # Lines as torchrun's tee reads them (universal newlines: a progress bar's \r ends a line too).
        text = (self.partial + chunk).replace(b"\r\n", b"\n")
        held = b"\r" if text.endswith(b"\r") else b""  # maybe the first half of \r\n
        *lines, self.partial = text[:len(text) - len(held)].replace(b"\r", b"\n").split(b"\n")
        self.partial += held
        if lines:
            write_all(out, b"".join(self.prefix + line + b"\n" for line in lines))
        return True

    def close(self) -> None:
        os.close(self.fd)
        self.log.close()


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BrokenPipeError:
            return  # nobody reads the job's output any more; the launcher's end is noticed on the control socket


def free_port() -> socket.socket:
    """A port for rank 0's store, held (bound, not listening, SO_REUSEADDR) until the job ends, so that nothing else
    takes it meanwhile; the store binds it beside this socket (both reuse the address, neither listened first)."""
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind(("127.0.0.1", 0))
    return held


def rank_environment(env: dict[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    """What torchrun gives each worker of a one-node job (`LocalElasticAgent._start_workers`); rank 0 hosts the
    store (TORCHELASTIC_USE_AGENT_STORE False), as there is no agent store."""
    env = dict(env)
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's rule: results equal torchrun's, bit for bit
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": str(nproc), "WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": RUN_ID,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    })
    return env


def run_agent(request: dict, conn: socket.socket, out: int, default_threads: int) -> int:
    """Fork the job's ranks, relay their output, end them if one fails or the launcher goes; the job's exit code."""
    os.setsid()  # a session of its own, as the local launcher starts torchrun
    for sig in DEFAULT_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    os.dup2(out, 1)  # the agent's own lines (an error of its own) reach the launcher, as torchrun's do
    os.dup2(out, 2)
    conn.sendall(json.dumps({"agent": os.getpid()}).encode() + b"\n")
    nproc = int(request["nproc"])
    attempt = Path(request["log_dir"]) / RUN_ID / "attempt_0"
    held = free_port()
    port = held.getsockname()[1]
    ranks: dict[int, int] = {}  # pid -> rank
    streams: list[Stream] = []
    for rank in range(nproc):
        (attempt / str(rank)).mkdir(parents=True, exist_ok=True)
        pipes = [os.pipe(), os.pipe()]
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            held.close()
            conn.close()
            for fd in [out, pipes[0][0], pipes[1][0], *(s.fd for s in streams), *(s.log.fileno() for s in streams)]:
                os.close(fd)
            run_rank(request, rank_environment(request["env"], rank, nproc, port), pipes[0][1], pipes[1][1],
                     default_threads)
        ranks[pid] = rank
        for (read_end, write_end), name in zip(pipes, ("stdout", "stderr"), strict=True):
            os.close(write_end)
            streams.append(Stream(read_end, f"[rank {rank}] ".encode(), attempt / str(rank) / f"{name}.log"))
    # Every rank is forked: from here the agent may do what it likes (it never forks again).
    try:
        return supervise(ranks, streams, conn, out, request["env"])
    finally:
        held.close()


def signal_ranks(ranks: dict[int, int], sig: int) -> None:
    """`sig` to every rank still running, and to its process group (its DataLoader workers)."""
    for pid in ranks:
        for send in (os.killpg, os.kill):
            try:
                send(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def supervise(ranks: dict[int, int], streams: list[Stream], conn: socket.socket, out: int,
              env: dict[str, str]) -> int:
    """Relay output until every rank has ended; on the first failure end the others as torchrun does."""
    launcher = None
    if ENV_SUPERVISOR_PID in env:
        launcher = find_process(int(env[ENV_SUPERVISOR_PID]), float(env.get(ENV_SUPERVISOR_START, 0)) or None)
    running_ranks = dict(ranks)  # not yet reaped: their pids (and process groups) are still theirs
    # SIGTERM (the launcher spares the agent, but a user may not): passed on to the ranks, as torchrun does.
    signal.signal(signal.SIGTERM, lambda signum, frame: signal_ranks(running_ranks, signal.SIGTERM))
    failure: tuple[int, int, int] | None = None  # rank, exit code, pid
    killed_at: float | None = None
    ended_at: float | None = None
    checked = time.monotonic()
    open_streams = {s.fd: s for s in streams}
    while running_ranks or (open_streams and time.monotonic() - (ended_at or 0.0) < DRAIN_S):
        readable, _, _ = select.select([*open_streams, conn], [], [], 0.2)
        for fd in readable:
            if fd is conn:
                if not conn.recv(1):  # the launcher has gone: nobody collects this job (torchrun.py's watchdog)
                    return end_orphaned(running_ranks)
            elif not open_streams[fd].relay(out):
                open_streams.pop(fd).close()
        for pid in list(running_ranks):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                rank = running_ranks.pop(pid)
                if code != 0 and failure is None:
                    failure = (rank, code, pid)
                    write_all(out, f"[warm] rank {rank} (pid {pid}) exited {code}: ending the other ranks\n".encode())
                    signal_ranks(running_ranks, signal.SIGTERM)
                    killed_at = time.monotonic()
        if killed_at is not None and running_ranks and time.monotonic() - killed_at > TERM_GRACE_S:
            signal_ranks(running_ranks, signal.SIGKILL)
        if not running_ranks and ended_at is None:
            ended_at = time.monotonic()
        now = time.monotonic()
        if launcher is not None and now - checked > WATCH_INTERVAL_S:
            checked = now
            if not running(launcher):
                return end_orphaned(running_ranks)
    for stream in open_streams.values():
        stream.close()
    code = 0
    if failure is not None:
        rank, exit_code, pid = failure
        write_all(out, (f"Root Cause (first observed failure):\n  rank      : {rank} (local_rank: {rank})\n"
                        f"  exitcode  : {exit_code} (pid: {pid})\n").encode())
        code = 1
    conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
    return code


def end_orphaned(ranks: dict[int, int]) -> int:
    """SIGKILL the ranks and their groups at once (a rerun resumes from the last checkpoint), then exit."""
    signal_ranks(ranks, signal.SIGKILL)
    return EXIT_SUPERVISOR_GONE


# ---- a rank: what a fresh interpreter would do -------------------------------------------------------------

def run_rank(request: dict, env: dict[str, str], stdout: int, stderr: int, default_threads: int) -> None:
    """Become rank `env["RANK"]` and run the job's entry as `python ARGV` would; never returns."""
    os.setsid()  # torchrun starts every worker in a session of its own
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    for fd in (devnull, stdout, stderr):
        os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    for sig in DEFAULT_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    os.chdir(request["cwd"])
    new_paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    os.environ.clear()
    os.environ.update(env)
    np.random.seed()
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]) if env.get("OMP_NUM_THREADS") else default_threads)
    fabric_rank_zero.rank_zero_only.rank = pl_rank_zero.rank_zero_only.rank = int(env["RANK"])
    argv = list(request["argv"])
    code = 0
    try:
        module = argv[1] if argv[0] == "-m" else None
        sys.argv = [module or argv[0], *argv[2 if module else 1:]]
        sys.path[0] = os.getcwd() if module else str(Path(argv[0]).resolve().parent)
        sys.path[1:1] = new_paths
        run_sitecustomize(new_paths)
        if module:
            # `python -m` imports the module afresh as __main__, and a second time under its name if its code asks
            # for itself (the rank programs do): so here, rather than finding the server's copy in sys.modules.
            sys.modules.pop(module, None)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        code = exit_code(stop)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            threading._shutdown()  # type: ignore[attr-defined]  # what an interpreter's exit does first
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def exit_code(stop: SystemExit) -> int:
    """The exit status Python gives `sys.exit(value)`."""
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code & 0xFF
    print(stop.code, file=sys.stderr)
    return 1


def run_sitecustomize(new_paths: list[str]) -> None:
    """The `sitecustomize` that an interpreter started with the job's PYTHONPATH would run first, if the new entries
    hold one (a test's hook): `site` imports the first found on the path, before any of the job's code."""
    for folder in new_paths:
        path = Path(folder) / "sitecustomize.py"
        if path.is_file():
            spec = importlib.util.spec_from_file_location("sitecustomize", path)
            module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
            sys.modules["sitecustomize"] = module
            spec.loader.exec_module(module)  # type: ignore[union-attr]
            return


def main() -> None:
    listener = socket.socket(fileno=int(sys.argv[1]))
    try:
        serve(listener)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
