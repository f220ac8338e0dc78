"""GRPO's maths as pure functions: advantages, masking, log-probs, the clipped loss, the lr schedule.

No Ray, no I/O, no global state: every function here is tested on small hand-computed tensors, so
the actor only wires them together. Conventions follow RLinf/verl so that losses and metrics are
comparable with the reference runs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean")
KL_KINDS = ("kl", "abs", "mse", "low_var_kl")
LR_STYLES = ("constant", "linear", "cosine")
# exp() of a log-ratio beyond this overflows in low precision; verl clamps at the same bound.
_LOG_RATIO_BOUND = 20.0


def group_advantages(rewards: Tensor, group_size: int, eps: float = 1e-6) -> Tensor:
    """GRPO advantages: (reward - group mean) / (group std + eps), one value per answer.

    `rewards` is [prompts * group_size], the answers of prompt i in rows i*g .. i*g+g-1. The std is
    torch's default unbiased one (divides by g - 1), as RLinf and verl use, so a group [1, -1]
    gives [+0.7071, -0.7071]. A group of one answer has no spread to compare against, so its
    advantage is defined as 0 (the unbiased std of one value would be NaN).
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [prompts * group_size], got shape {rewards.shape}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of algorithm.group_size="
            f"{group_size}; every prompt needs exactly group_size answers"
        )
    scores = rewards.float() if not rewards.is_floating_point() else rewards
    if group_size == 1:
        return torch.zeros_like(scores)
    grouped = scores.view(-1, group_size)
    mean = grouped.mean(dim=-1, keepdim=True)
    std = grouped.std(dim=-1, keepdim=True)
    return ((grouped - mean) / (std + eps)).view(-1)


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of x where mask is 1 (mask is 0/1, bool or float, broadcastable to x)."""
    masked = x * mask.to(x.dtype)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x over the positions where mask is 1; 0 (not NaN) where nothing is selected.

    An all-padding micro-batch must not turn the loss into NaN, hence the clamp of the count.
    """
    mask = mask.to(x.dtype).expand_as(x)
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1.0)


def _picked_logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    x = logits.float()
    return x.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, dim=-1)


# The same arithmetic as one generated kernel each way: the forward reads the low-precision
# logits once, and the backward writes their gradient directly, with no float32 copy of the
# vocabulary-wide tensor in between. Compiled lazily, at the first call with fused=True.
_fused_picked_logprobs = torch.compile(_picked_logprobs, dynamic=None)


def token_logprobs(
    logits: Tensor, labels: Tensor, chunk_size: int = 8, fused: bool = False
) -> Tensor:
    """log softmax(logits)[b, t, labels[b, t]] in float32, as [B, T].

    A [B, T, V] float32 log-softmax of a 152k vocabulary is gigabytes, so rows are processed
    `chunk_size` at a time and only the gathered logit minus the logsumexp is kept. Gradients
    flow back into `logits`. fused=True computes each chunk with a `torch.compile`d kernel
    (same result; meant for GPUs, where it saves the float32 round trips through memory).
    """
    if logits.shape[:2] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} differ")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    kernel = _fused_picked_logprobs if fused else _picked_logprobs
    out = [
        kernel(logits[start : start + chunk_size], labels[start : start + chunk_size])
        for start in range(0, logits.shape[0], chunk_size)
    ]
    return torch.cat(out, dim=0)


def agg_loss(loss_mat: Tensor, mask: Tensor, agg: str) -> Tensor:
    """Reduce a [B, T] per-token loss to a scalar.

    token-mean: every valid token weighs the same, sum(loss * mask) / sum(mask).
    seq-mean-token-mean: every sequence weighs the same: the mean over sequences (those with at
    least one valid token) of each sequence's token mean.
    """
    if agg == "token-mean":
        return masked_mean(loss_mat, mask)
    if agg == "seq-mean-token-mean":
        per_seq = masked_mean(loss_mat, mask, dim=-1)
        has_tokens = mask.to(loss_mat.dtype).sum(dim=-1) > 0
        return masked_mean(per_seq, has_tokens)
    raise ValueError(f"algorithm.loss_agg_func={agg!r} must be one of {LOSS_AGGREGATIONS}")


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token KL(pi || ref) estimate of the given kind, as in verl.

    kl: log-ratio (k1); abs: |log-ratio|; mse: 0.5 * log-ratio^2 (k2); low_var_kl: the unbiased,
    non-negative k3 = exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10] because a single
    token with a huge ratio would otherwise dominate the loss.
    """
    log_ratio = logprobs - ref_logprobs
    if kind == "kl":
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind == "mse":
        return 0.5 * log_ratio.square()
    if kind == "low_var_kl":
        kl = (-log_ratio).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
        return (kl.exp() - kl - 1).clamp(-10.0, 10.0)
    raise ValueError(f"algorithm.kl_penalty_type={kind!r} must be one of {KL_KINDS}")


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float,
    agg: str = "token-mean",
    kl_beta: float = 0.0,
    ref_logprobs: Tensor | None = None,
    kl_penalty_type: str = "low_var_kl",
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate loss (to minimise) and detached metrics.

    Per token: ratio = exp(logp - old_logp); loss = max(-A * ratio, -A * clip(ratio, 1 +- eps)).
    `advantages` is [B] (one per answer, broadcast over its tokens) or [B, T]. With kl_beta > 0,
    kl_beta * agg(kl_penalty(logp, ref_logp)) is added. Metrics: pg_loss; ratio_mean;
    clip_fraction, the share of valid tokens where the clipped branch is the larger one (its
    gradient is zero there); approx_kl, the masked mean of 0.5 * (logp - old_logp)^2 (k2, which
    is never negative, unlike the k1 mean); kl_loss when the KL term is on.
    """
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    log_ratio = (logprobs - old_logprobs).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    ratio = log_ratio.exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    pg_loss = agg_loss(torch.maximum(unclipped, clipped), mask, agg)
    loss = pg_loss
    metrics = {
        "pg_loss": pg_loss.detach(),
        "ratio_mean": masked_mean(ratio.detach(), mask),
        "clip_fraction": masked_mean((clipped > unclipped).detach().float(), mask),
        "approx_kl": masked_mean(0.5 * (logprobs - old_logprobs).detach().square(), mask),
    }
    if kl_beta > 0:
        if ref_logprobs is None:
            raise ValueError("algorithm.kl_beta > 0 needs ref_logprobs (the reference policy's)")
        kl_loss = agg_loss(kl_penalty(logprobs, ref_logprobs, kl_penalty_type), mask, agg)
        loss = loss + kl_beta * kl_loss
        metrics["kl_loss"] = kl_loss.detach()
    return loss, metrics


def lr_at(
    step: int,
    base_lr: float,
    style: str,
    warmup_iters: int,
    warmup_init: float,
    min_lr: float,
    total_steps: int,
) -> float:
    """Learning rate of optimiser step `step` (0-based).

    Linear warm-up from warmup_init (at step 0) to base_lr (at step warmup_iters), as Megatron and
    Hugging Face do; then constant, or a linear/cosine decay that reaches min_lr at total_steps
    (the run's total optimiser steps: runner.max_steps x algorithm.n_minibatches) and stays there.
    """
    if style not in LR_STYLES:
        raise ValueError(f"actor.lr_sched.lr_decay_style={style!r} must be one of {LR_STYLES}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if warmup_iters > 0 and step < warmup_iters:
        return warmup_init + (base_lr - warmup_init) * step / warmup_iters
    if style == "constant":
        return base_lr
    progress = min(1.0, (step - warmup_iters) / max(1, total_steps - warmup_iters))
    if style == "linear":
        return base_lr - (base_lr - min_lr) * progress
    return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
