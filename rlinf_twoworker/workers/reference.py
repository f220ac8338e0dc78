"""The reference policy of the KL term (algorithm.kl_beta > 0): the actor's initial weights,
frozen. It computes log-probs the way inference does (same precision, kernels and temperature)
and never receives weights, as RLinf's reference (its initial weights kept aside) never does."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlinf_twoworker.config.settings import InferenceSettings
from rlinf_twoworker.workers.inference import InferenceWorker


class ReferenceWorker(InferenceWorker):
    """Log-probs of every answer token under the initial policy."""

    def __init__(self, settings: InferenceSettings, rank: int = 0) -> None:
        """`settings.model`: the actor's initial weights (config/settings.reference_settings)."""
        super().__init__(settings, rank, "reference")


# For mypy: ReferenceWorker is what the run asks of the reference (workers/contract.py).
if TYPE_CHECKING:
    from rlinf_twoworker.workers import contract

    _reference: type[contract.LogProbModel] = ReferenceWorker
