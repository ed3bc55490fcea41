"""Elastic Weight Consolidation (Kirkpatrick et al., 2017), as LeanAgent applies it between repositories.

The penalty is lambda * sum_i F_i (theta_i - theta*_i)^2 (no 1/2, as LeanAgent and Avalanche), where F is the
diagonal Fisher of the previous repository (`leanagent.model.fisher`) and theta* the parameters at the start of
training on the new one. The anchor is taken when fit starts, after the starting checkpoint is restored; a retry
resuming mid-repository is given the anchor explicitly instead (`leanagent.train.plan.ewc_anchor`), since its
restored weights have moved away from theta* already.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class EWC:
    """The Fisher, the anchor and lambda of one training job; empty (no penalty) until `set`."""

    def __init__(self) -> None:
        self.fisher: dict[str, torch.Tensor] = {}
        self.anchor: dict[str, torch.Tensor] = {}
        self.ewc_lambda = 0.0

    @property
    def active(self) -> bool:
        return bool(self.fisher) and self.ewc_lambda > 0

    def set(self, params: dict[str, torch.Tensor], fisher: dict[str, torch.Tensor], ewc_lambda: float,
            anchor: dict[str, torch.Tensor] | None = None) -> None:
        """Arm the penalty for the model whose parameters are `params`; a Fisher of another model is refused."""
        missing = sorted(set(params) - set(fisher))
        unknown = sorted(set(fisher) - set(params))
        if missing or unknown:
            raise ValueError(
                f"Fisher does not match the model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"unexpected {unknown[:5]}{'...' if len(unknown) > 5 else ''}"
            )
        for name, value in fisher.items():
            if value.shape != params[name].shape:
                raise ValueError(f"Fisher entry {name} has shape {tuple(value.shape)}, parameter has "
                                 f"{tuple(params[name].shape)}")
        self.fisher = dict(fisher)
        self.ewc_lambda = float(ewc_lambda)
        self.anchor = {n: anchor[n].detach().float().clone() for n in fisher} if anchor is not None else {}

    def fit_start(self, named_parameters: Iterable[tuple[str, torch.Tensor]], device: torch.device) -> None:
        """On the training device; theta* from the parameters now, unless an anchor was given."""
        if not self.fisher:
            return
        self.fisher = {n: f.to(device, torch.float32) for n, f in self.fisher.items()}
        if self.anchor:
            self.anchor = {n: a.to(device) for n, a in self.anchor.items()}
        else:
            self.anchor = {n: p.detach().float().clone() for n, p in named_parameters}

    def penalty(self, named_parameters: Iterable[tuple[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
        total = torch.zeros((), device=device)
        if not self.active:
            return total
        for name, param in named_parameters:
            total = total + (self.fisher[name] * (param.float() - self.anchor[name]) ** 2).sum()
        return self.ewc_lambda * total
