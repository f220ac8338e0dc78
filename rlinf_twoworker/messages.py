"""What crosses an actor boundary during a step, as types instead of dicts whose keys two files
must agree on."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the reward's process never imports torch
    import torch

    from rlinf_twoworker.engines.models import SequenceBatch


@dataclass
class ActorShard:
    """One actor rank's rows of one minibatch, with the minibatch's loss weights.

    `weights` and `metric_weights` are fixed once per minibatch (algorithm.loss_weights): the
    actor's loss is sum(weights * per-token loss), so the micro-batches it runs for speed never
    change the gradient; summed over every rank, the metric weights give RLinf's per
    micro-batch token-means of the metrics."""

    batch: SequenceBatch
    old_logprobs: torch.Tensor
    """[rows, R] the inference component's log-probs (the PPO ratio's denominator)."""
    advantages: torch.Tensor
    """[rows, R] token-level advantages (zero on padding)."""
    weights: torch.Tensor
    """[rows, R] the loss weight of every token."""
    metric_weights: torch.Tensor
    """[rows, R] the weight of every token in the logged metric means."""
    ref_logprobs: torch.Tensor | None = None
    """[rows, R] the reference policy's log-probs (the KL term), when kl_beta > 0."""

    def __len__(self) -> int:
        return len(self.batch)


@dataclass
class Rollout:
    """The rollout's answers to a batch of prompts: group_size rows per prompt, contiguous."""

    batch: SequenceBatch
    texts: list[str]
    """Each answer decoded (special tokens skipped): what the reward grades."""
    generated_tokens: int
    seconds: float


@dataclass
class LogProbs:
    """Per-token log-probabilities of every answer ([B, R], zero on padding)."""

    logprobs: torch.Tensor
    seconds: float


@dataclass
class PromptRow:
    """One prompt as the data gave it, for reward.reward_fn (sent to the reward only then): its
    text, before tokenisation and data.max_prompt_length's cut, and its JSONL record."""

    prompt: str
    row: dict[str, Any]


@dataclass
class Graded:
    """The reward's scores, one per answer, and how grading went (correct, wrong, timed_out,
    errors, seconds)."""

    scores: list[float]
    stats: dict[str, float]


@dataclass
class TrainStats:
    """One actor rank's update of one GRPO step: the step's metrics (means over its
    minibatches, maxes where named so; the same on every rank) and where the time went."""

    metrics: dict[str, float]
    trained_tokens: float
    seconds: float
    optimizer_seconds: float
    minibatches: list[dict[str, float]] = field(default_factory=list)
    """Each minibatch's metrics, in training order (RLinf logs them one by one)."""

    @property
    def forward_backward_seconds(self) -> float:
        return self.seconds - self.optimizer_seconds

    @classmethod
    def merge(cls, parts: list[TrainStats]) -> TrainStats:
        """One rank's step from its updates of the step's parts (a pipelined step updates
        chunk by chunk; one TrainStats each, in training order): the metrics of all their
        minibatches combined by `step_metrics`, as one call over every minibatch gives them,
        with each call's own figures (offload seconds summed, memory figures their largest);
        tokens and seconds summed."""
        minibatches = [m for p in parts for m in p.minibatches]
        metrics = step_metrics(minibatches)
        for key in [k for k in parts[0].metrics if k not in metrics]:  # in the call's order
            values = [p.metrics[key] for p in parts]
            metrics[key] = sum(values) if key == "offload_seconds" else max(values)
        return cls(
            metrics=metrics,
            trained_tokens=sum(p.trained_tokens for p in parts),
            seconds=sum(p.seconds for p in parts),
            optimizer_seconds=sum(p.optimizer_seconds for p in parts),
            minibatches=minibatches,
        )


NOT_METRICS = ("tokens", "optimizer_seconds")
"""A minibatch's figures that are TrainStats fields (trained_tokens, optimizer_seconds)."""


def step_metrics(minibatches: Sequence[dict[str, float]]) -> dict[str, float]:
    """A step's actor metrics from its minibatches' (in training order), as RLinf's step values
    are the mean over the minibatches it logs one by one. Each metric is the mean, except:
    ratio_max, the largest; logprob_diff_max, the first minibatch's (measured before the step's
    first update); skipped_steps, summed; lr and loss_scale, the last (after the step's last
    update); grad_norm, `mean_grad_norm`. The one rule, for one call and for a step's chunks."""
    first = minibatches[0]
    special = {
        "ratio_max": max(m["ratio_max"] for m in minibatches),
        "skipped_steps": sum(m["skipped_steps"] for m in minibatches),
        "lr": minibatches[-1]["lr"],
    }
    if "logprob_diff_max" in first:
        special["logprob_diff_max"] = first["logprob_diff_max"]
    if "grad_norm" in first:
        special["grad_norm"] = mean_grad_norm([m["grad_norm"] for m in minibatches])
    if "loss_scale" in minibatches[-1]:
        special["loss_scale"] = minibatches[-1]["loss_scale"]
    means = {
        k: sum(m[k] for m in minibatches) / len(minibatches)
        for k in first
        if k not in special and k not in NOT_METRICS
    }
    return {**means, **special}


def mean_grad_norm(norms: Sequence[float]) -> float:
    """A step's grad_norm over its minibatches: the mean of those that stepped (a skipped
    minibatch's norm is inf or nan; skipped_steps counts it), the plain mean when none did."""
    kept = [n for n in norms if math.isfinite(n)] or list(norms)
    return sum(kept) / len(kept)
