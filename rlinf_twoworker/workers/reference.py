"""The reference policy of the KL term (algorithm.kl_beta > 0): the actor's initial weights,
frozen. It computes log-probs the way inference does (same precision, kernels and temperature)
and never receives weights, as RLinf's reference (its initial weights kept aside) never does."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlinf_twoworker.config import GRPOConfig
from rlinf_twoworker.workers.inference import InferenceWorker


class ReferenceWorker(InferenceWorker):
    """Log-probs of every answer token under the initial policy."""

    def __init__(self, cfg: GRPOConfig, rank: int = 0) -> None:
        super().__init__(cfg, rank, "reference", cfg.actor.model.model_path)


# For mypy: ReferenceWorker is what the run asks of the reference (workers/contract.py).
if TYPE_CHECKING:
    from rlinf_twoworker.workers import contract

    _reference: type[contract.LogProbModel] = ReferenceWorker
