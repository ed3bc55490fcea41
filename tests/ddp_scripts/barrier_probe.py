"""Run under torchrun: does `trainer.strategy.barrier()` before `fit` really wait for every rank?

Rank 1 arrives late; each rank records when it reached and when it left the barrier.
With `--no-init` the process group is not created first (the reference's behaviour).
"""

import json
import os
import sys
import time
from pathlib import Path

from leanagent.ground.config import TrainerConfig
from leanagent.train.trainer import build_training_trainer, init_process_group, set_nccl_environment

out = Path(sys.argv[1])
cfg = TrainerConfig(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), precision="32-true")
set_nccl_environment(cfg)
if "--no-init" not in sys.argv:
    init_process_group(cfg)
trainer = build_training_trainer(cfg, out, max_epochs=1)
rank = int(os.environ["RANK"])
if rank == 1:
    time.sleep(3.0)
arrived = time.time()
trainer.strategy.barrier()
left = time.time()
(out / f"rank{rank}.json").write_text(json.dumps({"arrived": arrived, "left": left,
                                                 "nccl_timeout": os.environ["NCCL_TIMEOUT"],
                                                 "async": os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]}))
