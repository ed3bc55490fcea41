"""What one `leanagent bench` run measures: its options, validated, with the device-dependent defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from leanagent.config import DataConfig

FisherMethod = Literal["loop", "vectorised"]


class BenchOptions(BaseModel):
    """The bench's settings; None means the default for the device (the properties below resolve them).

    On a CPU the training rows use the model's first 2 layers: every layer of byt5-small's width has the same
    matmuls and attention shapes, so fewer layers keep each step's balance at a fraction of its time.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    dataset: Path = Field(description="a LeanDojo dataset (corpus.jsonl and SPLIT/{train,val,test}.json)")
    model: str | None = Field(None, description="HF model folder or id; None: a random `preset` encoder")
    preset: Literal["tiny", "byt5-small"] = "tiny"
    device: Literal["cpu", "cuda"] = "cpu"
    split: str = "random"
    min_seconds: float = Field(3.0, ge=0, description="time each rate for at least this long")
    embed_sample: PositiveInt | None = Field(None, description="premises embedded (512 on cpu, 4096 on cuda)")
    fisher_examples: PositiveInt = 8
    fisher_methods: tuple[FisherMethod, ...] | None = Field(None, description="loop on cpu, both on cuda")
    launch: bool = Field(True, description="measure a real job's launch overhead")
    compile: bool = Field(True, description="the compiled training row (and compile times)")
    train_max_len: PositiveInt | None = Field(None, description="bytes sequences are cut at (LeanAgent's 1024)")
    train_layers: PositiveInt | None = Field(None, description="layers the training rows keep (2 on cpu, all on cuda)")
    train_batches: PositiveInt | None = Field(None, description="batches of 4 the training rows run (4 cpu, 16 cuda)")
    states: tuple[Path, ...] = Field((), description="LeanDojo split files whose proof states are the contexts")

    @property
    def on_cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def sample(self) -> int:
        return self.embed_sample or (4096 if self.on_cuda else 512)

    @property
    def layers(self) -> int | None:
        """Layers the training rows keep; None: all."""
        return self.train_layers if self.train_layers is not None else (None if self.on_cuda else 2)

    @property
    def batches(self) -> int:
        return self.train_batches or (16 if self.on_cuda else 4)

    @property
    def max_len(self) -> int:
        return self.train_max_len or DataConfig().max_seq_len

    @property
    def methods(self) -> tuple[FisherMethod, ...]:
        return self.fisher_methods or (("loop", "vectorised") if self.on_cuda else ("loop",))
