"""The retriever's settings, typed: built once, saved in every checkpoint, read back as the same type.

Why one object: the settings used to travel as Lightning's untyped `hparams` dict, read back by string key
with a fallback at each reader, and the fallbacks disagreed (the training step fell back to padded pools, the
vectorised Fisher to sorted ones). `RetrieverOptions` is the `model:` section (`ModelConfig`: its fields, each
with its one default, are inherited, so a new model setting is one field there) plus the one data setting the
retriever reads itself, `eval_batch_size`. The rank programs, both Fisher estimators, the bench, the index and
the server all read `PremiseRetriever.options`; nothing reads the hparams dict.

In a checkpoint the options are stored flat under `hyper_parameters`, beside the encoder's architecture
(`encoder_config`), as plain values that torch's restricted unpickler loads: the layout our checkpoints always
had, so one written before this type existed reads back with `from_hparams`, a key it lacks taking the value
that reproduces it (`leanagent.ground.config.ABSENT_MEANS`, else the default).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ConfigDict, Field, field_validator

from leanagent.ground.config import ABSENT_MEANS, DataConfig, ModelConfig, PipelineConfig, not_a_choice
from leanagent.model.losses import LOSSES

ENCODER_CONFIG_KEY = "encoder_config"  # the architecture, stored beside the options in `hyper_parameters`


class RetrieverOptions(ModelConfig):
    """The `model:` section and `data.eval_batch_size`, frozen: `replace` gives a validated copy."""

    model_config = ConfigDict(frozen=True)

    eval_batch_size: int = Field(DataConfig.model_fields["eval_batch_size"].default, gt=0,
                                 description="premises of model.max_seq_len per corpus embedding batch "
                                             "(its token budget: this x max_seq_len)")

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, loss: str) -> str:
        if loss not in LOSSES:
            raise ValueError(not_a_choice(loss, list(LOSSES)))  # one line, as every enumerated setting's
        return loss

    @classmethod
    def from_config(cls, cfg: PipelineConfig) -> RetrieverOptions:
        """A job's options: its config's `model:` section and `data.eval_batch_size`."""
        return cls(**cfg.model.model_dump(), eval_batch_size=cfg.data.eval_batch_size)

    @classmethod
    def from_hparams(cls, hparams: Mapping[str, Any]) -> RetrieverOptions:
        """The options one of our checkpoints stored, whichever version wrote it (see the module docstring)."""
        absent = {key.removeprefix("model."): value for key, value in ABSENT_MEANS.items()
                  if key.startswith("model.")}
        stored = {name: hparams[name] for name in cls.model_fields if name in hparams}
        return cls(**{**absent, **stored})

    @classmethod
    def for_reference(cls, hparams: Mapping[str, Any], base_model: str | None = None) -> RetrieverOptions:
        """A LeanAgent/ReProver checkpoint's settings that carry over into ours: the encoder it names (`model_name`,
        unless `base_model` is given) and the premise length it embedded at; every other setting is our default."""
        options = cls(name_or_path=base_model or hparams.get("model_name") or cls().name_or_path)
        return options.replace(max_seq_len=int(hparams["max_seq_len"])) if "max_seq_len" in hparams else options

    def to_hparams(self, encoder_config: dict[str, Any]) -> dict[str, Any]:
        """What a checkpoint stores: the options as plain values, and the encoder's architecture."""
        return {**self.model_dump(mode="json"), ENCODER_CONFIG_KEY: encoder_config}

    def replace(self, **changes: Any) -> RetrieverOptions:
        """A copy with `changes`, validated as a new object is (an unknown key or a bad value is refused)."""
        return type(self).model_validate({**self.model_dump(), **changes})

    @property
    def embed_batch_tokens(self) -> int:
        """The padded-token budget of one corpus embedding batch, as evaluation embeds it."""
        return self.eval_batch_size * self.max_seq_len


def stored_encoder_config(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """The encoder's architecture one of our checkpoints stored beside its options."""
    return dict(hparams[ENCODER_CONFIG_KEY])
