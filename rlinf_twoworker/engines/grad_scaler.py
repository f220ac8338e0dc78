"""The actor's dynamic loss scaling (actor.fsdp_config.grad_scaler) and its optimiser step.

torch's ShardedGradScaler, as RLinf's FSDP actor builds it: `scale` multiplies the loss before
the backward pass; `unscale_` divides the gradient shards by the scale and finds any inf or nan,
all-reduced over the actor group so that every rank skips together; `update` halves the scale
(backoff_factor) after an overflow and doubles it (growth_factor) after growth_interval good
steps. Disabled, each call passes through and the step is the plain one.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from rlinf_twoworker.config import GradScalerConfig, OptimConfig
from rlinf_twoworker.engines import tensors


def build_grad_scaler(cfg: GradScalerConfig, device: torch.device, group: Any) -> Any:
    """The scaler of one actor rank; `group` is the actor group (its ranks skip together)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(
        device=device.type,
        init_scale=cfg.scale,
        growth_factor=cfg.growth_factor,
        backoff_factor=cfg.backoff_factor,
        growth_interval=cfg.interval,
        enabled=cfg.enabled,
        process_group=group,
    )


def adamw(params: Any, optim: OptimConfig, fused: bool) -> torch.optim.AdamW:
    """The actor's AdamW (actor.optim); `fused`: the one-kernel update (on GPUs)."""
    return torch.optim.AdamW(
        params,
        lr=optim.lr,
        betas=(optim.adam_beta1, optim.adam_beta2),
        eps=optim.adam_eps,
        weight_decay=optim.weight_decay,
        fused=fused,
    )


def clip_and_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: Any, clip: float
) -> tuple[float, bool]:
    """RLinf's optimizer_step: unscale the gradients, clip them to `clip` (<= 0: no clipping)
    and step unless their global norm is not finite (an overflow on any rank); the scaler
    updates its scale either way. Returns (the norm before clipping, whether it stepped)."""
    with warnings.catch_warnings():
        # torch's scaler checks DTensor gradient shards against a 1-element found-inf tensor,
        # which DTensor replicates with a UserWarning on every call: expected, and noise here.
        warnings.filterwarnings("ignore", "Found a non-scalar tensor with numel=1")
        scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else math.inf)
    grad_norm = float(tensors.full(norm))
    stepped = math.isfinite(grad_norm)
    if stepped:
        # A finite global norm: no rank found an inf, so it steps. Not scaler.step: it would
        # skip only on an inf, which the norm rules out, and it hands a fused optimiser its
        # 1-element found-inf tensor, which the optimiser subtracts from its 0-dim step
        # counters and fails ("output with shape [] doesn't match the broadcast shape [1]").
        optimizer.step()
    scaler.update()
    return grad_norm, stepped


def loss_scale(scaler: Any) -> float | None:
    """The scale the next backward pass uses; None when loss scaling is off."""
    return float(scaler.get_scale()) if scaler.is_enabled() else None
