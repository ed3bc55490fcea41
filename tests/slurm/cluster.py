"""A real SLURM cluster of two nodes on this machine, for the tests: Debian's slurmctld and slurmd, started and
stopped by pid.

Two slurmd daemons on 127.0.0.1 (`NodeName=n[1-2] NodeHostname=localhost Port=...`, Debian's slurmd supports
several per host), no munge (`auth/none`), no cgroups (`proctrack/linuxproc`, `task/none`). Every cluster has
its own folder, ports and pid files, so two never meet. Stopping ends every daemon by its pid, and then any
`slurmstepd` of this cluster that outlived its slurmd (found by SLURM_CONF in its environment), with the job
processes under it: nothing is left behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

NODES = ("n1", "n2")
CPUS_PER_NODE = 2


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def missing_tools() -> list[str]:
    return [tool for tool in ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo")
            if shutil.which(tool) is None]


def require_slurm() -> None:
    """Skip the calling test where SLURM is not installed, or fail it under LEANAGENT_REQUIRE_SLURM=1 (`.ci/run`)."""
    missing = missing_tools()
    if missing:
        message = f"SLURM is not installed ({', '.join(missing)} missing): `bash scripts/test.sh` installs it"
        if os.environ.get("LEANAGENT_REQUIRE_SLURM") == "1":
            pytest.fail(message)
        pytest.skip(message)


@dataclass
class Cluster:
    root: Path

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment a client (sbatch, squeue, leanagent) needs to reach this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), capture_output=True, text=True, env=self.env, check=check, timeout=60)

    def start(self, timeout_s: float = 60.0) -> Cluster:
        root = self.root
        for sub in ("etc", "spool/slurmctld", "log", "run", *(f"spool/slurmd-{n}" for n in NODES)):
            (root / sub).mkdir(parents=True, exist_ok=True)
        ctl_port, *node_ports = free_ports(1 + len(NODES))
        nodes = "\n".join(f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs={CPUS_PER_NODE} "
                          f"RealMemory=4000 State=UNKNOWN" for n, p in zip(NODES, node_ports, strict=True))
        self.conf.write_text(f"""\
ClusterName=leanagent-test
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire=20
SlurmctldPort={ctl_port}
CommunicationParameters=NoInAddrAny
StateSaveLocation={root}/spool/slurmctld
SlurmdSpoolDir={root}/spool/slurmd-%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/log/jobcomp.txt
ReturnToService=2
KillWait=5
MinJobAge=300
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        self.run("slurmctld")
        for n in NODES:
            self.run("slurmd", "-N", n)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = self.run("sinfo", "-h", "-N", "-o", "%t", check=False).stdout.split()
            if len(states) == len(NODES) and all(s == "idle" for s in states):
                return self
            time.sleep(0.1)
        logs = "\n".join(p.read_text()[-2000:] for p in (root / "log").glob("*.log"))
        self.stop()
        raise RuntimeError(f"the test SLURM cluster in {root} did not come up:\n{logs}")

    def pids(self) -> dict[str, int]:
        out = {}
        for path in (self.root / "run").glob("*.pid"):
            try:
                out[path.stem] = int(path.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
        return out

    def jobs(self) -> list[str]:
        """Every job this cluster still knows of that is not finished."""
        return self.run("squeue", "-h", "-o", "%A", check=False).stdout.split()

    def stop(self) -> None:
        if self.jobs():
            self.run("scancel", "--full", *self.jobs(), check=False)
            deadline = time.monotonic() + 20
            while self.jobs() and time.monotonic() < deadline:
                time.sleep(0.2)
        daemons = self.pids()
        for pid in daemons.values():
            _kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in daemons.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in daemons.values():
            _kill(pid, signal.SIGKILL)
        for pid in self.leftover_processes():
            _kill(pid, signal.SIGKILL)

    def leftover_processes(self) -> list[int]:
        """slurmstepd processes of this cluster and everything under them (the jobs' processes)."""
        found: list[int] = []
        for proc in psutil.process_iter(["name"]):
            try:
                if proc.info["name"] == "slurmstepd" and proc.environ().get("SLURM_CONF") == str(self.conf):
                    found += [proc.pid, *(child.pid for child in proc.children(recursive=True))]
            except psutil.Error:
                continue
        return [p for p in found if _alive(p)]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
