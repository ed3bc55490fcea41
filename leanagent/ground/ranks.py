"""Who this process is in the job, from the variables torchrun sets; 0 when run alone.

Read from the environment, not from torch.distributed, so that it works before the process
group exists and in data-loader workers.
"""

from __future__ import annotations

import os


def global_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def node_rank() -> int:
    """torchrun calls the node's rank GROUP_RANK."""
    return int(os.environ.get("GROUP_RANK", "0"))
