"""The torchrun command line the local launcher builds, and the environment its ranks inherit (no torchrun is
started: what it would be started with)."""

from __future__ import annotations

from leanagent.ground.config import TrainerConfig
from leanagent.launch.base import SCRUBBED_ENV, child_environment
from leanagent.launch.local import torchrun_command


def test_torchrun_command_single_and_multi_node():
    single = torchrun_command(TrainerConfig(devices=4), ["train", "--config", "c.yaml"])
    assert "--nproc-per-node=4" in single and "--standalone" in single
    assert single[single.index("-m", 3) + 1] == "leanagent.train.programs"
    multi = torchrun_command(TrainerConfig(devices=2, num_nodes=2, node_rank=1, rdzv_endpoint="host0:29500"),
                             ["fisher"])
    assert {"--nnodes=2", "--node-rank=1", "--rdzv-endpoint=host0:29500", "--nproc-per-node=2"} <= set(multi)
    assert "--standalone" not in multi


def test_child_environment_scrubs_inherited_ranks():
    env = child_environment({"LOCAL_RANK": "3", "RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "x",
                             "MASTER_PORT": "1", "NODE_RANK": "1", "PATH": "/bin"})
    assert not set(SCRUBBED_ENV) & set(env)
    assert env["PATH"] == "/bin"
