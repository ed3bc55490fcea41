"""Run under torchrun by the launcher tests. Modes: fail (rank 1 raises), hang (all ranks sleep),
stale (ranks beat once, then hang), ok (ranks beat for 4 s, rank 0 writes result.json, all exit 0).
Each rank writes its pid so the test can check it was ended."""

import os
import sys
import time
from pathlib import Path

mode, out = sys.argv[1], Path(sys.argv[2])
rank = int(os.environ["RANK"])
out.mkdir(parents=True, exist_ok=True)
(out / f"pid{rank}").write_text(str(os.getpid()))
print(f"rank {rank} started in mode {mode}", flush=True)
if mode == "fail" and rank == 1:
    print("about to fail: the data on this rank is bad", flush=True)
    raise RuntimeError("boom on rank 1")
if mode == "ok":
    import json

    from leanagent.ground.job import beat

    for step in range(8):
        beat(out, "train", step)
        time.sleep(0.5)
    if rank == 0:
        (out / "result.json").write_text(json.dumps({"ok": True}))
    sys.exit(0)
if mode == "stale":
    from leanagent.ground.job import beat

    beat(out, "train", 0)
time.sleep(600)
