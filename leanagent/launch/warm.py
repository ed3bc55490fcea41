"""The warm launcher: each job's ranks forked from a process that has imported torch, Lightning and the rank
programs once, for a test suite that runs hundreds of short jobs (`launcher: warm`).

A rank under torchrun spends seconds importing before it does anything; a suite of short CPU jobs pays that for
every rank of every job. Here a fork server (`leanagent.train.fork_server`, started once with
`start_fork_server`) holds those imports; for each job it forks an agent, which plays torchrun's part (it sets
`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR`/`MASTER_PORT` and torchrun's other variables, forks one rank
per device, prefixes each rank's lines with `[rank N] `, writes them to the job's log folder and ends the other
ranks when one fails). The ranks are real: gloo, Lightning's `Trainer` (which sees a torchrun environment), the
rank program of `leanagent.train.programs`, run as `python -m` would run it.

What is not warm: the launcher side. The agent stands where torchrun stands, so `LocalJob` watches it as the local
launcher watches torchrun (`AgentProcess` gives it what it reads of a `Popen`): the ranks record their pids, the
launcher finds the agent's descendants with psutil and ends them by pid and start time (`end_job`), and the
heartbeats, deadlines and cancellation of `Launcher.launch` work unchanged. The agent ends the job when the
launcher is gone (its control socket closes), and each rank's own watcher does too (supervision.py).

Where the server is: `LEANAGENT_FORK_SERVER` names its Unix socket (the suite's `write_cpu_config` fixture starts
one per test session). One node only (`trainer.num_nodes: 1`). This module imports no torch.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from leanagent.ground.config import PipelineConfig, TrainerConfig
from leanagent.ground.job import PROGRAMS_ENTRY
from leanagent.ground.supervision import parent_death_signal, supervisor_environment
from leanagent.launch.base import Launcher, LauncherPlugin, LaunchError, child_environment
from leanagent.launch.local import LocalJob, check_accelerator
from leanagent.launch.quiet import quiet_environment

SERVER_ENV = "LEANAGENT_FORK_SERVER"  # the fork server's Unix socket
SERVER_MODULE = "leanagent.train.fork_server"
# How long a launch waits for the server's answer: its imports, on a busy machine, when the first job comes early.
SERVER_ANSWER_S = 600.0
HEADER = struct.Struct("!I")  # a request: its length, then its JSON
READY = "[fork server] ready"  # its first line, once its imports are done


class WarmPlugin(LauncherPlugin):
    """`launcher: warm`: ranks forked from the fork server named by LEANAGENT_FORK_SERVER, on this machine."""

    name = "warm"

    def launcher(self, cfg: PipelineConfig) -> WarmLauncher:
        return WarmLauncher(cfg.trainer)

    def check_config(self, cfg: PipelineConfig) -> list[str]:
        if cfg.trainer.num_nodes > 1:
            return [f"launcher: {self.name} runs one node; trainer.num_nodes is {cfg.trainer.num_nodes}"]
        return []

    def preflight(self, cfg: PipelineConfig, visible_gpus: Callable[[], int]) -> list[str]:
        path = os.environ.get(SERVER_ENV)
        if not path or not Path(path).is_socket():
            return [f"launcher: {self.name} forks its ranks from a fork server, but {SERVER_ENV} "
                    f"({path or 'unset'}) names no socket; start one with "
                    f"leanagent.launch.warm.start_fork_server, or set launcher: local"]
        return check_accelerator(cfg.trainer, visible_gpus)


PLUGIN = WarmPlugin()


def start_fork_server(socket_path: Path, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a fork server listening on `socket_path` (a new path), its own output appended to `log`; it serves jobs
    once its imports are done.

    The socket is bound here, before the server's imports, so a job may be launched at once: its request waits in
    the socket's queue, and fails at once if the server has died. The server gets SIGTERM when the thread that
    started it ends (Linux); end it yourself otherwise.
    """
    output = open(log, "ab")  # noqa: SIM115 - the server holds its copy; ours is closed below
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(socket_path))
        listener.listen(64)
        # The server's own imports read these once: its thread pools stay unstarted (see fork_server.py).
        server_env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1", "OPENBLAS_NUM_THREADS": "1"}
        for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            server_env.pop(key, None)
        return subprocess.Popen([sys.executable, "-m", SERVER_MODULE, str(listener.fileno())], env=server_env,
                                pass_fds=(listener.fileno(),), stdin=subprocess.DEVNULL, stdout=output,
                                stderr=subprocess.STDOUT, preexec_fn=parent_death_signal(signal.SIGTERM))
    finally:
        listener.close()
        output.close()


class AgentProcess:
    """A job's agent, as `LocalJob` reads torchrun's `Popen`: its pid, its output pipe, and its exit code.

    The agent is the fork server's child, not ours, so its exit code comes over the control socket: the agent sends
    it as its last message. A socket that closes without one means the agent was killed: -SIGKILL.
    """

    def __init__(self, control: socket.socket, output: int, pid: int) -> None:
        self.pid = pid
        self.stdout = os.fdopen(output, "rb", buffering=0)
        self.returncode: int | None = None
        self._control = control
        self._buffer = b""

    def _receive(self, timeout_s: float | None) -> None:
        if self.returncode is not None:
            return
        ready, _, _ = select.select([self._control], [], [], timeout_s)
        if not ready:
            return
        chunk = self._control.recv(4096)
        if not chunk:
            self.returncode = -signal.SIGKILL
            self._control.close()
            return
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            message = json.loads(line)
            if "exit" in message:
                self.returncode = int(message["exit"])
                self._control.close()
                return

    def poll(self) -> int | None:
        self._receive(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"agent {self.pid}", timeout or 0.0)
            self._receive(left)
        return self.returncode


def request_job(socket_path: str, request: dict, output: int) -> tuple[socket.socket, int]:
    """Send the job to the fork server with the write end of its output pipe; the control socket and the agent's
    pid. LaunchError naming the socket if there is no server, or it refuses."""
    control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        control.connect(socket_path)
        body = json.dumps(request).encode()
        socket.send_fds(control, [HEADER.pack(len(body))], [output])
        control.sendall(body)
        answer = b""
        deadline = time.monotonic() + SERVER_ANSWER_S
        while not answer.endswith(b"\n"):  # one line, read to its end and no further: the agent's later lines follow
            ready, _, _ = select.select([control], [], [], max(0.0, deadline - time.monotonic()))
            chunk = control.recv(1) if ready else b""
            if not chunk:
                raise LaunchError(f"the fork server at {socket_path} gave no answer"
                                  f"{'' if ready else f' within {SERVER_ANSWER_S:.0f} s'}")
            answer += chunk
    except OSError as exc:
        control.close()
        raise LaunchError(f"no fork server at {socket_path} ({SERVER_ENV}): {exc}") from None
    except BaseException:
        control.close()
        raise
    message = json.loads(answer)
    if "error" in message:
        control.close()
        raise LaunchError(f"the fork server at {socket_path} refused the job: {message['error']}")
    return control, int(message["agent"])


class WarmLauncher(Launcher):
    """The ranks of one node, forked by an agent of the fork server; `LocalJob` watches them (see the module
    docstring). `entry` replaces `-m leanagent.train.programs`, as for `LocalLauncher` (a probe script)."""

    def __init__(self, cfg: TrainerConfig, entry: Sequence[str] = PROGRAMS_ENTRY) -> None:
        self.cfg = cfg
        self.entry = tuple(entry)
        self.devices = cfg.devices

    def start(self, program_args: Sequence[str], job_dir: Path, log_dir: Path, label: str = "") -> LocalJob:
        path = os.environ.get(SERVER_ENV)
        if not path:
            raise LaunchError(f"launcher: warm needs a fork server: {SERVER_ENV} is not set")
        env = {**child_environment(), **supervisor_environment(job_dir)}
        quiet_environment(env, self.cfg.devices)
        request = {"argv": [*self.entry, *map(str, program_args)], "env": env, "cwd": os.getcwd(),
                   "nproc": self.cfg.devices, "log_dir": str(log_dir)}
        read_end, write_end = os.pipe()
        try:
            control, agent = request_job(path, request, write_end)
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        return LocalJob(AgentProcess(control, read_end, agent), job_dir)  # type: ignore[arg-type]
