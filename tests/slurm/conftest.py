"""The SLURM tests' cluster: two real nodes on this machine, started once for the module and stopped by pid.

`scripts/test.sh` installs Debian's slurmctld, slurmd and slurm-client when they are missing (it runs as
root on CI and on this project's machines). Where they cannot be installed the tests are skipped, unless
LEANAGENT_REQUIRE_SLURM=1 (set by `.ci/run`), which makes a missing SLURM a failure.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.slurm.cluster import Cluster, require_slurm


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require_slurm()
    running = Cluster(tmp_path_factory.mktemp("slurm")).start()
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(running.conf)  # for the launcher, in this process and every process it starts
    try:
        yield running
    finally:
        running.stop()
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
        assert not running.leftover_processes()
