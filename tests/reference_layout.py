"""Retriever checkpoints in LeanAgent's/ReProver's layout (`retrieval/model.py`: the T5 encoder under `encoder`,
an AttributeDict of hyper-parameters, pytorch_lightning metadata), written here for the tests that start from one."""

from __future__ import annotations

from pathlib import Path

import torch
from pytorch_lightning.utilities.parsing import AttributeDict
from transformers import T5EncoderModel


def reference_hparams() -> AttributeDict:
    return AttributeDict(model_name="kaiyuy/leandojo-lean4-retriever-byt5-small", lr=1e-3, warmup_steps=1000,
                         max_seq_len=512, num_retrieved=100)


def save_reference(path: Path, encoder: T5EncoderModel, epoch: int, **extra) -> Path:
    torch.save({"state_dict": {"encoder." + k: v for k, v in encoder.state_dict().items()},
                "hyper_parameters": reference_hparams(), "epoch": epoch, "global_step": 1234,
                "pytorch-lightning_version": "2.2.1", **extra}, path)
    return path
