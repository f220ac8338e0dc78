"""GRPO's maths as pure functions: advantages, masking, log-probs, loss weights, the clipped loss.

No Ray, no I/O, no global state: every function here is tested on small hand-computed tensors, so
the actor only wires them together. Conventions follow RLinf/verl so that losses and metrics are
comparable with the reference runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from rlinf_twoworker.config import KL_KINDS, LOSS_AGGREGATIONS
from rlinf_twoworker.engines.config_rules import EAGER_CHUNK_TOKENS


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


def normalize_advantages(
    advantages: list[Tensor], masks: list[Tensor], eps: float = 1e-5
) -> list[Tensor]:
    """RLinf's `algorithm.normalize_advantages` (its masked_normalization): token-level
    advantages whitened, (A - mean) / (sqrt(biased var) + eps) in float64, the statistics over
    the valid tokens of every part, so padding never enters them. The parts are a step's chunks,
    each with its own answer width; one part is the whole batch. Padding stays 0."""
    values = torch.cat([a.double()[m.bool()] for a, m in zip(advantages, masks)])
    if values.numel() == 0:
        return advantages
    mean = values.mean()
    std = (values - mean).square().mean().sqrt()
    return [
        ((a.double() - mean) / (std + eps) * m.bool()).to(a.dtype)
        for a, m in zip(advantages, masks)
    ]


def _scaled(logits: Tensor, temperature: float) -> Tensor:
    x = logits.float()
    return x / temperature if temperature != 1.0 else x


def _pick_stats(
    logits: Tensor, labels: Tensor, temperature: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Of x = logits / temperature (float32) at each position: log softmax(x)[label], the
    entropy, logsumexp(x) and the softmax-weighted mean of x: the last two are all the backward
    needs besides the logits themselves."""
    x = _scaled(logits, temperature)
    top = x.amax(-1, keepdim=True)
    e = (x - top).exp()
    total = e.sum(-1, keepdim=True)
    lse = top + total.log()
    mean_x = (e * x).sum(-1, keepdim=True) / total
    picked = x.gather(-1, labels.unsqueeze(-1)) - lse
    return picked.squeeze(-1), (lse - mean_x).squeeze(-1), lse.squeeze(-1), mean_x.squeeze(-1)


def _pick_grad(
    logits: Tensor,
    labels: Tensor,
    lse: Tensor,
    mean_x: Tensor,
    g_picked: Tensor | None,
    g_entropy: Tensor | None,
    temperature: float,
) -> Tensor:
    """The gradient of sum(g_picked * picked + g_entropy * entropy) with respect to `logits`,
    in their dtype, from `_pick_stats`' lse and mean_x: pointwise (p = softmax(x)),
    (g_picked * (onehot(label) - p) - g_entropy * p * (x - mean_x)) / temperature."""
    x = _scaled(logits, temperature)
    p = (x - lse.unsqueeze(-1)).exp()
    if g_picked is None:
        grad = torch.zeros_like(x)
    else:  # -g_picked p everywhere, and g_picked more at the label's own entry
        vocab = torch.arange(x.shape[-1], device=x.device)
        grad = -g_picked.unsqueeze(-1) * p
        grad = grad + (vocab == labels.unsqueeze(-1)) * g_picked.unsqueeze(-1)
    if g_entropy is not None:
        grad = grad - g_entropy.unsqueeze(-1) * p * (x - mean_x.unsqueeze(-1))
    if temperature != 1.0:
        grad = grad / temperature
    return grad.to(logits.dtype)


# Each as one generated kernel: the statistics read the low-precision logits and write four
# values a position; the gradient reads them and writes the logits' gradient, pointwise. No
# float32 tensor the size of the logits exists on either side (autograd through the plain
# arithmetic keeps one, or builds one for the gather's backward). Compiled lazily, at the first
# call with fused=True; even the torch.compile wrappers are made then, so importing this module
# does not import the compiler stack (seconds in every process that only needs the arithmetic:
# the controller).
@functools.cache
def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    return torch.compile(fn, dynamic=None)


def _spans(rows: int, width: int, chunk_tokens: int) -> list[tuple[slice, slice]]:
    """(rows, columns) blocks of a [rows, width] grid in reading order, each of at most
    `chunk_tokens` positions (at least one): whole rows together where a row fits, else
    pieces of one row."""
    if width <= chunk_tokens:
        step = max(1, chunk_tokens // max(width, 1))
        return [(slice(r, r + step), slice(0, width)) for r in range(0, rows, step)]
    return [
        (slice(r, r + 1), slice(c, c + chunk_tokens))
        for r in range(rows)
        for c in range(0, width, chunk_tokens)
    ]


def _mark_dynamic(*tensors: Tensor) -> None:
    for tensor in tensors:
        for dim in (0, 1):
            if tensor.dim() > dim and tensor.shape[dim] > 1:
                torch._dynamo.maybe_mark_dynamic(tensor, dim)


class _How(NamedTuple):
    """How token_logprobs computes (its arguments of that name)."""

    temperature: float
    fused: bool
    many_shapes: bool
    chunk_tokens: int


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(logits / T)[label] and the entropy of each position, with a backward that
    holds the logits and writes their gradient and nothing else the size of the logits.
    Fused: each direction is one compiled kernel over the whole tensor; else the arithmetic
    runs eagerly, `chunk_tokens` positions at a time (its float32 copies one chunk's)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: Tensor, labels: Tensor, how: _How
    ) -> tuple[Tensor, Tensor]:
        picked, entropy, lse, mean_x = _stats(logits, labels, how)
        ctx.save_for_backward(logits, labels, lse, mean_x)
        ctx.how = how
        ctx.set_materialize_grads(False)
        return picked, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, g_picked: Tensor | None, g_entropy: Tensor | None
    ) -> tuple[Tensor | None, None, None]:
        logits, labels, lse, mean_x = ctx.saved_tensors
        how: _How = ctx.how
        if g_picked is None and g_entropy is None:
            return None, None, None
        if how.fused:
            if how.many_shapes:
                upstream = [g for g in (g_picked, g_entropy) if g is not None]
                _mark_dynamic(logits, labels, lse, mean_x, *upstream)
            grad = _compiled(_pick_grad)(
                logits, labels, lse, mean_x, g_picked, g_entropy, how.temperature
            )
            return grad, None, None
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for r, c in _spans(logits.shape[0], logits.shape[1], how.chunk_tokens):
            grad[r, c] = _pick_grad(
                logits[r, c],
                labels[r, c],
                lse[r, c],
                mean_x[r, c],
                None if g_picked is None else g_picked[r, c],
                None if g_entropy is None else g_entropy[r, c],
                how.temperature,
            )
        return grad, None, None


def _stats(logits: Tensor, labels: Tensor, how: _How) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """_pick_stats over the whole of `logits`, as `how` says."""
    if how.fused:
        if how.many_shapes:
            _mark_dynamic(logits, labels)
        return _compiled(_pick_stats)(logits, labels, how.temperature)
    spans = _spans(logits.shape[0], logits.shape[1], how.chunk_tokens)
    if len(spans) == 1:
        return _pick_stats(logits, labels, how.temperature)
    out = [torch.empty(logits.shape[:2], device=logits.device) for _ in range(4)]
    for r, c in spans:
        for whole, part in zip(out, _pick_stats(logits[r, c], labels[r, c], how.temperature)):
            whole[r, c] = part
    return out[0], out[1], out[2], out[3]


def token_logprobs(
    logits: Tensor,
    labels: Tensor,
    chunk_tokens: int = EAGER_CHUNK_TOKENS,
    fused: bool = False,
    temperature: float = 1.0,
    with_entropy: bool = False,
    many_shapes: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """log softmax(logits / temperature)[b, t, labels[b, t]] in float32, as [B, T]; with
    `with_entropy` also the entropy of each position's distribution (RLinf computes both from
    the temperature-scaled logits).

    A [B, T, V] float32 log-softmax of a 152k vocabulary is gigabytes, and so is its gradient:
    only the per-token values are kept, and the backward writes the logits' gradient (in their
    dtype) from the logits and two float32 values a position, so the logits and their
    gradient are all it holds the size of the logits (4 bytes a (token, vocabulary entry) in
    bf16). fused=True computes each direction with one `torch.compile`d kernel (same result;
    meant for GPUs); else eagerly, `chunk_tokens` positions at a time. `many_shapes` (calls of
    many rows and widths, as the length-aware cut makes): the fused kernels' first compile
    takes the rows and width as dynamic, so later shapes reuse it.
    """
    if logits.shape[:2] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} differ")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    how = _How(temperature, fused, many_shapes, chunk_tokens)
    if torch.is_grad_enabled() and logits.requires_grad:
        logprobs, entropy = _TokenLogprobs.apply(logits, labels, how)
    else:
        logprobs, entropy, _, _ = _stats(logits, labels, how)
    return (logprobs, entropy) if with_entropy else logprobs


def loss_weights(mask: Tensor, micro_batches: Sequence[Sequence[slice]], agg: str) -> Tensor:
    """Per-token weights [B, T] of one minibatch: the loss the optimiser steps on is
    sum(weights * per-token loss) over every token of the minibatch, all ranks together.

    `micro_batches[r]` lists the row slices that form RLinf's micro-batches on actor rank r.
    RLinf aggregates each micro-batch on its own (`loss_agg_func`), divides it by the number
    of micro-batches of its rank (gradient accumulation) and FSDP averages the ranks; the
    weights say the same thing token by token, so the library may run the forward and backward
    in any other micro-batches (a token budget, say) and get the same gradient:
      token-mean          mask / (valid tokens of the micro-batch)
      seq-mean-token-mean mask / (valid tokens of the row) / (rows of the micro-batch)
      seq-mean-token-sum  mask / (rows of the micro-batch)
    each times 1 / (micro-batches of the rank x ranks). global-token-mean (the library's own)
    is mask / (valid tokens of the whole minibatch): every token weighs the same.
    """
    if agg not in LOSS_AGGREGATIONS:
        raise ValueError(f"algorithm.loss_agg_func={agg!r} must be one of {LOSS_AGGREGATIONS}")
    valid = mask.to(torch.float64)
    if agg == "global-token-mean":
        return (valid / valid.sum().clamp(min=1.0)).float()
    weights = torch.zeros_like(valid)
    ranks = len(micro_batches)
    for parts in micro_batches:
        for rows in parts:
            part = valid[rows]
            if agg == "token-mean":
                share = part / part.sum().clamp(min=1.0)
            elif agg == "seq-mean-token-mean":
                share = part / part.sum(-1, keepdim=True).clamp(min=1.0) / part.shape[0]
            else:
                share = part / part.shape[0]
            weights[rows] = share / (len(parts) * ranks)
    return weights.float()


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate of RLinf's `kl_penalty(logprob, ref_logprob, kind)`.

    kl / k1: logp - ref; abs: |logp - ref|; mse / k2: 0.5 (logp - ref)^2; low_var_kl / k3:
    with d = clamp(ref - logp, -20, 20), clamp(exp(d) - d - 1, -10, 10) (non-negative).
    """
    log_ratio = logprobs - ref_logprobs
    if kind in ("kl", "k1"):
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind in ("mse", "k2"):
        return 0.5 * log_ratio.square()
    if kind in ("low_var_kl", "k3"):
        d = (-log_ratio).clamp(-20.0, 20.0)
        return (d.exp() - d - 1).clamp(-10.0, 10.0)
    raise ValueError(f"algorithm.kl_penalty_type={kind!r} must be one of {KL_KINDS}")


@dataclass(frozen=True)
class PolicyLoss:
    """RLinf's PPO actor loss settings (`compute_ppo_actor_loss` and its caller)."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_c: float | None = None
    """Dual clip: the loss of a token is at most clip_c * |A| (binds for A < 0)."""
    log_ratio_min: float | None = None
    log_ratio_max: float | None = None
    entropy_bonus: float = 0.0
    kl_beta: float = 0.0
    kl_type: str = "low_var_kl"


def ppo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    weights: Tensor,
    metric_weights: Tensor,
    settings: PolicyLoss,
    entropy: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss to minimise, sum(weights * per-token loss), and detached metric sums.

    Per token (RLinf): log_ratio = logp - old (clamped to log_ratio_min/max when set),
    ratio = exp(log_ratio); L = max(-A ratio, -A clip(ratio, 1 - clip_low, 1 + clip_high)),
    then min(L, clip_c |A|) with a dual clip; minus entropy_bonus * entropy, plus
    kl_beta * kl_penalty(ref, logp) (RLinf's FSDP argument order). `advantages` is [B] (one
    per answer) or [B, T].

    Metrics are sums over this part's tokens weighted by `metric_weights` (RLinf's per
    micro-batch token-means, averaged over micro-batches and ranks, so summing every part of
    a minibatch gives RLinf's value): policy_loss, ratio_mean, clip_fraction, dual_clip_fraction,
    approx_kl (mean of old - logp, k1), entropy_loss, kl_loss; ratio_max is a max. RLinf's
    further ones: policy_loss_abs (the aggregated |per-token loss|, the loss's weights),
    ratio_abs (token-mean of |ratio - 1|), clipped_ratio (token-mean of the ratio clipped to
    [1 - clip_low, 1 + clip_high]) and dual_clipped_ratio (token-mean of the ratio where the
    dual clip bound the loss, 0 elsewhere: RLinf's `dual_cliped_ratio`, a ratio, not a share).
    """
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    valid = metric_weights > 0
    log_ratio = logprobs - old_logprobs
    if settings.log_ratio_min is not None:
        log_ratio = log_ratio.clamp(min=settings.log_ratio_min)
    if settings.log_ratio_max is not None:
        log_ratio = log_ratio.clamp(max=settings.log_ratio_max)
    ratio = torch.where(weights > 0, log_ratio.exp(), 0.0)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - settings.clip_low, 1.0 + settings.clip_high)
    per_token = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(valid)
    if settings.clip_c is not None:
        bound = settings.clip_c * adv.abs()
        dual = (bound < per_token).detach()
        per_token = torch.minimum(per_token, bound)
    policy = (weights * per_token).sum()
    loss = policy
    with torch.no_grad():
        live_ratio = torch.where(valid, log_ratio.exp(), 0.0)
        metrics = {
            "policy_loss": policy.detach(),
            "ratio_mean": (metric_weights * live_ratio).sum(),
            # No valid token: 0, as every entry is (a test of valid.any() would sync).
            "ratio_max": live_ratio.max() if live_ratio.numel() else live_ratio.new_zeros(()),
            "clip_fraction": (metric_weights * (unclipped < clipped)).sum(),
            "dual_clip_fraction": (metric_weights * dual).sum(),
            "approx_kl": -(metric_weights * log_ratio).sum(),
            "policy_loss_abs": (weights * per_token.detach().abs()).sum(),
            "ratio_abs": (metric_weights * (live_ratio - 1.0).abs()).sum(),
            "clipped_ratio": (
                metric_weights * live_ratio.clamp(1.0 - settings.clip_low, 1.0 + settings.clip_high)
            ).sum(),
            "dual_clipped_ratio": (metric_weights * torch.where(dual, live_ratio, 0.0)).sum(),
        }
    if entropy is not None:
        entropy_loss = (weights * entropy).sum()
        if settings.entropy_bonus > 0:
            loss = loss - settings.entropy_bonus * entropy_loss
        metrics["entropy_loss"] = entropy_loss.detach()
    if settings.kl_beta > 0:
        if ref_logprobs is None:
            raise ValueError("algorithm.kl_beta > 0 needs ref_logprobs (the reference policy's)")
        # RLinf's FSDP actor calls kl_penalty(ref_logprobs, logprobs): for k3 that is
        # exp(d) - d - 1 with d = logp - ref, clamped.
        kl_loss = (weights * kl_penalty(ref_logprobs, logprobs, settings.kl_type)).sum()
        loss = loss + settings.kl_beta * kl_loss
        metrics["kl_loss"] = kl_loss.detach()
    return loss, metrics
