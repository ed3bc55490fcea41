"""The premise retriever: a ByT5 encoder whose pooled embeddings rank premises for a proof state.

Follows ReProver's dense retriever (Yang et al., 2023): masked mean pooling, L2 normalisation,
an MSE loss between the context-premise similarity matrix and the 0/1 label matrix (or, as an option,
InfoNCE over it: `losses.py`), AdamW with a cosine schedule after linear warmup. LeanAgent adds an
EWC penalty that anchors the parameters to their values at the start of training on a new repository,
weighted by a diagonal Fisher (`ewc.py`). Validation and test (embedding premises, ranking, metrics) are
`evaluation.py`; this module holds the encoder, the training step and the Lightning hooks that call them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, ByT5Tokenizer, T5Config, T5EncoderModel

from leanagent.ground.timings import JobClock, no_clock
from leanagent.model.encoder import CompiledBlocks, encoder_hidden
from leanagent.model.evaluation import CorpusEmbedding, RetrievalEvaluation, embed_premises
from leanagent.model.ewc import EWC
from leanagent.model.grad_cache import grad_cached_loss
from leanagent.model.losses import retrieval_loss
from leanagent.model.lr_schedule import build_optimizer_and_schedule, reference_horizon
from leanagent.model.options import RetrieverOptions
from leanagent.model.pool_plan import Piece, PoolPlan, TokenCount, plan_pool
from leanagent.model.sub_batches import call_cost_for

BYT5_VOCAB_SIZE = 384


def load_tokenizer(name_or_path: str, vocab_size: int):
    """ByT5 needs no tokenizer files, so a checkpoint can be evaluated with no hub access at all."""
    if vocab_size == BYT5_VOCAB_SIZE:
        return ByT5Tokenizer()
    return AutoTokenizer.from_pretrained(name_or_path)


def compile_wanted(setting: str | bool, device: torch.device) -> bool:
    """`model.compile`: auto compiles under CUDA only (on a CPU the eager step is matmul-bound already, and the
    first compile takes minutes), true and false as said."""
    if setting == "auto":
        return device.type == "cuda"
    return bool(setting)


class PremiseRetriever(pl.LightningModule):
    """`options`: every setting it reads (`RetrieverOptions`); `encoder_config`: the architecture, when it comes
    from a checkpoint (None: the encoder and its weights from `options.name_or_path`)."""

    def __init__(self, options: RetrieverOptions, encoder_config: dict[str, Any] | None = None) -> None:
        super().__init__()
        if encoder_config is None:
            # First load from the hub or a local dir; the architecture is then kept in the
            # checkpoint so that resuming never needs the hub again.
            # SDPA attention: transformers' T5 supports it (the relative position bias goes in as the mask).
            self.encoder = T5EncoderModel.from_pretrained(options.name_or_path, attn_implementation="sdpa")
        else:
            config = T5Config.from_dict(encoder_config)
            config._attn_implementation = "sdpa"
            self.encoder = T5EncoderModel(config)
        # from_pretrained returns eval mode; Lightning >= 2.4 keeps module modes as it finds them,
        # so without this dropout would silently stay off during training.
        self.encoder.train()
        self.tokenizer = load_tokenizer(options.name_or_path, self.encoder.config.vocab_size)
        self._options = options
        self._store_options()
        self.ewc = EWC()
        self.evaluation = RetrievalEvaluation()
        self.eval_metrics: dict[str, float] = {}
        self.validation_history: list[dict[str, float]] = []
        # Set by the Heartbeat callback: called inside long loops so a watchdog sees progress.
        self.progress_hook: Callable[[str], None] | None = None
        # Where the job's time goes (`leanagent.ground.timings`): a rank program gives its own; elsewhere nothing is
        # timed.
        self.clock: JobClock = no_clock()
        # False: transformers' own forward, which builds the attention mask in every layer (the bench's
        # "sorted" row times it); True: `encoder_hidden`, one mask per forward, bit-identical outputs.
        self.one_mask = True
        self._blocks: CompiledBlocks | None = None
        self._stock = False
        # Tokens of this process's training steps, by epoch (`train_token_efficiency`); they ride in checkpoints,
        # so a resumed job counts what an uninterrupted one did.
        self.train_tokens: dict[int, TokenCount] = {}
        self.last_tokens = TokenCount()  # of the last `batch_loss`

    # ---- settings -------------------------------------------------------------------------
    @property
    def options(self) -> RetrieverOptions:
        return self._options

    def reconfigure(self, **changes: Any) -> None:
        """New settings for the same weights (validated, as `RetrieverOptions.replace`): the bench measures one
        model's rows this way; a job builds its retriever with its options and never changes them."""
        self._options = self._options.replace(**changes)
        self._store_options()

    def _store_options(self) -> None:
        # Lightning's hparams are where checkpoints and loggers take the settings from: written here, never read.
        self.save_hyperparameters(self._options.to_hparams(self.encoder.config.to_dict()))

    # ---- encoding -------------------------------------------------------------------------
    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, padded: bool | None = None
               ) -> torch.Tensor:
        """Masked mean pooling of the encoder's last hidden state, L2-normalised, in fp32 (ReProver's).

        `padded`: whether any row has padding, when the caller knows it (saves reading the mask back)."""
        hidden = self._hidden(input_ids, attention_mask, padded)
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return F.normalize(pooled.float(), dim=1)

    def _hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, padded: bool | None) -> torch.Tensor:
        if not self.one_mask or self._stock:
            return self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        blocks = self.compiled_blocks()
        if blocks is not None:
            return blocks.hidden(input_ids, attention_mask, padded)
        return encoder_hidden(self.encoder, input_ids, attention_mask, padded)

    def compiled_blocks(self) -> CompiledBlocks | None:
        """The compiled blocks when `compile` asks for them on this device (built and compiled at first use)."""
        if not compile_wanted(self.options.compile, self.device):
            return None
        if self._blocks is None:
            self._blocks = CompiledBlocks(self.encoder)
        self._blocks.warm_up(self.device, backward=torch.is_grad_enabled())
        return None if self._blocks.failed else self._blocks

    @contextmanager
    def stock_forward(self) -> Iterator[None]:
        """transformers' own forward, uncompiled, whatever `one_mask` and `compile` say: the vectorised Fisher
        hooks each layer's calls and gives the first attention a per-sequence copy of the bias."""
        before, self._stock = self._stock, True
        try:
            yield
        finally:
            self._stock = before

    def plan_pool(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, lengths: Sequence[int] | None = None,
                  sort: bool | None = None, rows_within_budget: bool = False) -> PoolPlan:
        """How `encode_pool` cuts a pool into encoder calls (`pool_plan.py`): sorted by length into sub-batches
        under `token_budget` when `sort_by_length` (or `sort`, which overrides it) says so, else padded."""
        return plan_pool(input_ids, attention_mask, lengths, self.options.sort_by_length if sort is None else sort,
                         self.options.token_budget, call_cost_for(self.device.type), rows_within_budget)

    def encode_piece(self, piece: Piece) -> torch.Tensor:
        return self.encode(piece.ids, piece.mask, piece.padded)

    def encode_pool(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    lengths: Sequence[int] | None = None, sort: bool | None = None) -> tuple[torch.Tensor, TokenCount]:
        """Embeddings of a pool of sequences (a batch's contexts, or its premises), in the pool's order.

        With `sort_by_length` the pool is sorted by length and cut into sub-batches under `token_budget`, each
        padded to its own longest and encoded on its own; the embeddings are put back in the pool's order, in one
        autograd graph (one DDP forward). Padding is masked, so they are the padded path's up to float rounding;
        in training, dropout draws its masks for other shapes. `lengths`: the sequences' real lengths, when known
        on the host. `sort`: sort whatever `sort_by_length` says (the server's batched pass, which has no training
        numbers to keep). Also returns the tokens real and processed.
        """
        plan = self.plan_pool(input_ids, attention_mask, lengths, sort)
        return plan.assemble([self.encode_piece(piece) for piece in plan.pieces]), plan.tokens

    def batch_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        context_emb, ctx_tokens = self.encode_pool(batch["context_ids"], batch["context_mask"],
                                                   batch.get("context_lengths"))
        premise_emb, prem_tokens = self.encode_pool(batch["premise_ids"], batch["premise_mask"],
                                                    batch.get("premise_lengths"))
        self.last_tokens = ctx_tokens + prem_tokens
        return retrieval_loss(context_emb, premise_emb, batch["label"], self.options)

    def cached_batch_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """`batch_loss` under `model.grad_cache` (`grad_cache.py`): the same value; its backward gives the same
        gradient with one encoder call's activations alive at a time."""
        plans = [self.plan_pool(batch[f"{pool}_ids"], batch[f"{pool}_mask"], batch.get(f"{pool}_lengths"),
                                rows_within_budget=True) for pool in ("context", "premise")]
        self.last_tokens = plans[0].tokens + plans[1].tokens
        return grad_cached_loss(self.encode_piece, plans,
                                lambda contexts, premises: retrieval_loss(contexts, premises, batch["label"],
                                                                          self.options),
                                [p for p in self.parameters() if p.requires_grad], self.device)

    # ---- EWC (`ewc.py`) ----------------------------------------------------------------------
    def set_ewc(self, fisher: dict[str, torch.Tensor], ewc_lambda: float,
                anchor: dict[str, torch.Tensor] | None = None) -> None:
        """Arm the EWC penalty. theta* is `anchor` when given (a retry resuming mid-repository), otherwise
        the parameters in on_fit_start, after the starting checkpoint is restored."""
        self.ewc.set(dict(self.named_parameters()), fisher, ewc_lambda, anchor)

    def ewc_penalty(self) -> torch.Tensor:
        return self.ewc.penalty(self.named_parameters(), self.device)

    def on_fit_start(self) -> None:
        self.ewc.fit_start(self.named_parameters(), self.device)

    # The validation history rides in checkpoints so that a resumed job reports its best epoch's metrics.
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["leanagent_validation_history"] = list(self.validation_history)
        checkpoint["leanagent_train_tokens"] = {e: [t.real, t.processed] for e, t in self.train_tokens.items()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.validation_history = list(checkpoint.get("leanagent_validation_history", []))
        self.train_tokens = {int(e): TokenCount(int(r), int(p))
                             for e, (r, p) in checkpoint.get("leanagent_train_tokens", {}).items()}

    def token_count_since(self, epoch: int) -> TokenCount:
        """Tokens of the training steps of epochs >= `epoch` (this job's, when `epoch` is its first)."""
        total = TokenCount()
        for e, count in self.train_tokens.items():
            if e >= epoch:
                total += count
        return total

    def drop_compiled(self) -> None:
        """Forget the compiled blocks (the next forward that wants them compiles afresh)."""
        self._blocks = None

    def compile_status(self) -> dict[str, Any]:
        """`model.compile`'s outcome, for result.json: compiled or not, the first compile's seconds, or why not."""
        if self._blocks is None:
            return {"compiled": False}
        if self._blocks.failed:
            return {"compiled": False, "compile_failed": self._blocks.failed}
        return {"compiled": True, "compile_s": self._blocks.compile_s}

    # ---- training -------------------------------------------------------------------------
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.cached_batch_loss(batch) if self.options.grad_cache else self.batch_loss(batch)
        epoch_tokens = self.train_tokens.setdefault(self.current_epoch, TokenCount())
        epoch_tokens += self.last_tokens  # in place: the dict's entry grows
        # Not synced: an all-reduce per step only to log a number; the epoch mean is rank 0's.
        self.log("loss_train", loss, on_step=True, on_epoch=True, batch_size=len(batch["index"]))
        # Synced once, at the epoch's end (on_step=False): the mean over all ranks' steps.
        self.log("train_token_efficiency", self.last_tokens.efficiency, on_step=False, on_epoch=True,
                 batch_size=len(batch["index"]), sync_dist=True)
        if self.ewc.active:
            penalty = self.ewc_penalty()
            self.log("ewc_penalty", penalty, on_step=True, on_epoch=False, batch_size=len(batch["index"]))
            loss = loss + penalty
        return loss

    def configure_optimizers(self):
        trainer = self.trainer
        if trainer.max_steps != -1:
            horizon = trainer.max_steps
        else:
            horizon = reference_horizon(trainer.max_epochs, trainer.datamodule.unsharded_train_batches(),
                                        trainer.accumulate_grad_batches)
        return build_optimizer_and_schedule(self.parameters(), self.options.lr, self.options.warmup_steps,
                                            horizon, gradient_clip_val=trainer.gradient_clip_val)

    # ---- retrieval evaluation (`evaluation.py`; validation and test share it) -------------------
    def embed_corpus(self, source, batch_tokens: int | None = None, rows=None) -> torch.Tensor:
        """Every premise's embedding of `source` (a `Corpus`, or a `PremiseTable`'s rows), or of its `rows`, in
        their order, on every rank: `evaluation.embed_premises`."""
        return embed_premises(self, source, batch_tokens, rows)

    @property
    def corpus_embedding(self) -> CorpusEmbedding | None:
        """The premise embedding of the evaluation in progress (None outside one): mined negatives reuse it."""
        return self.evaluation.embedding

    def on_validation_epoch_start(self) -> None:
        self.evaluation.start(self, self.trainer.datamodule, "val")

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.evaluation.step(self, batch)

    def on_validation_epoch_end(self) -> None:
        self.eval_metrics = self.evaluation.finish(self, "_val")
        if not self.trainer.sanity_checking:
            self.validation_history.append({
                "epoch": self.current_epoch, "step": self.global_step,
                "Recall@1_val": self.eval_metrics["Recall@1"], "Recall@10_val": self.eval_metrics["Recall@10"],
                "MRR": self.eval_metrics["MRR"], "num_contexts": self.eval_metrics["num_contexts"],
            })

    def on_test_epoch_start(self) -> None:
        self.evaluation.start(self, self.trainer.datamodule, "test")

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.evaluation.step(self, batch)

    def on_test_epoch_end(self) -> None:
        self.eval_metrics = self.evaluation.finish(self, "")
