"""What crosses an actor boundary during a step, as types instead of dicts whose keys two files
must agree on."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlinf_twoworker.models import SequenceBatch


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

    def __len__(self) -> int:
        return len(self.batch)
