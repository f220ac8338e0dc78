"""What crosses an actor boundary during a step, as types instead of dicts whose keys two files
must agree on."""

from __future__ import annotations

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
