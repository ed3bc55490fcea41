"""`lifelong.start_checkpoint`: a lifelong run that starts from a LeanAgent checkpoint, through the real flow.

The checkpoint is written in LeanAgent's layout (pytorch_lightning `.ckpt`, `encoder.*` weights, its
hyper-parameters in an AttributeDict) with weights of its own; the untrained-model row must score it,
and the first repository must train from it, counting epochs on from its epoch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import T5Config, T5EncoderModel

from leanagent.checkpoints.ours import read_checkpoint
from leanagent.flows.lifelong import lifelong_retrieval
from tests.conftest import read_json
from tests.reference_layout import save_reference

pytestmark = [pytest.mark.prefect, pytest.mark.ddp]

REFERENCE_EPOCH = 4


def test_a_run_starts_from_a_leanagent_checkpoint(prefect_harness: None, tmp_path: Path, demo_assets,
                                                  write_cpu_config) -> None:
    torch.manual_seed(7)  # weights unlike the demo model's: the run must really take the checkpoint's
    encoder = T5EncoderModel(T5Config.from_pretrained(demo_assets.model)).eval()
    ckpt = tmp_path / "leanagent" / f"epoch={REFERENCE_EPOCH}.ckpt"
    ckpt.parent.mkdir()
    save_reference(ckpt, encoder, REFERENCE_EPOCH)
    config = write_cpu_config(tmp_path / "config.yaml", tmp_path / "run", demo_assets.repos[:1],
                              lifelong={"start_checkpoint": str(ckpt)})
    state = lifelong_retrieval(config_path=str(config), return_state=True)
    assert state.is_completed(), state.message

    jobs = tmp_path / "run" / "jobs"
    results = {str(p.parent.relative_to(jobs)): read_json(p) for p in jobs.rglob("result.json")}
    name = state.result()["order"][0]
    baseline, train = results["untrained/evaluate-00"], results[f"00-{name}/train"]
    assert Path(baseline["checkpoint"]) == ckpt.resolve()  # the "untrained" row is the start checkpoint
    assert Path(train["resumed_from"]) == ckpt.resolve()
    assert (train["start_epochs"], train["target_epochs"]) == (REFERENCE_EPOCH + 1, REFERENCE_EPOCH + 2)
    final = read_checkpoint(Path(train["checkpoint"]))
    assert final["epoch"] == REFERENCE_EPOCH + 1
    start = encoder.state_dict()["shared.weight"]
    assert not torch.equal(final["state_dict"]["encoder.shared.weight"], start)  # trained from there
    assert state.result()["baseline"][0] is not None
