"""LeanAgent's learning-rate schedule: AdamW under transformers' cosine schedule with linear warmup.

The horizon is the reference's, not the length of this job: `max_epochs` (cumulative over the
curriculum, as the trainer counts them) times the batches of the *unsharded* training loader
(`examples // batch_size`, drop_last), divided by the gradient-accumulation steps. Under DDP each
rank takes fewer steps than that, and a repository ends well before the horizon, so the LR is
still high when the next repository starts; that is what LeanAgent trains with. On a resumed
fit the step count comes from the checkpoint and the horizon from the new job.
"""

from __future__ import annotations

import torch
from transformers import get_cosine_schedule_with_warmup


def reference_horizon(max_epochs: int, unsharded_batches: int, accumulate_grad_batches: int) -> int:
    return max_epochs * unsharded_batches // accumulate_grad_batches


def use_fused_adamw(params: list[torch.Tensor], gradient_clip_val: float | None) -> bool:
    """Fuse AdamW's update into one kernel when every parameter is on a GPU and nothing clips gradients.

    Lightning's mixed-precision plugin refuses to clip gradients for an optimizer that unscales its
    own (`_step_supports_amp_scaling`, which fused AdamW sets): with the seed's clip of 1.0 a fused
    optimizer crashes the first step on a GPU. Then the multi-tensor (`foreach`) update is used, the
    CUDA default: the same update, a few kernels more, once per accumulated step.
    """
    return bool(params) and all(p.is_cuda for p in params) and not (gradient_clip_val or 0) > 0


def build_optimizer_and_schedule(params, lr: float, warmup_steps: int, horizon: int,
                                 fused: bool | None = None, gradient_clip_val: float | None = None) -> dict:
    """The dict Lightning's `configure_optimizers` returns; the scheduler steps once per optimizer step.

    `fused=None` decides by `use_fused_adamw`; on CPU the plain loop is used.
    """
    params = list(params)
    if fused is None:
        fused = use_fused_adamw(params, gradient_clip_val)
    optimizer = torch.optim.AdamW(params, lr=lr, fused=fused or None)
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=warmup_steps,
                                                num_training_steps=horizon)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
