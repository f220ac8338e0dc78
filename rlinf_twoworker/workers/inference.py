"""Inference: recompute the log-probabilities of every answer token under the current policy.

Runs with the weights the actor has before its update (the sync happens after each update), so
these are the "old" log-probabilities of the PPO ratio; logits are divided by the sampling
temperature, as in the actor (and in RLinf).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from rlinf_twoworker.config.settings import InferenceSettings
from rlinf_twoworker.engines import offload
from rlinf_twoworker.engines.models import (
    SequenceBatch,
    compile_layers,
    dtype_for,
    micro_batches,
    response_logprobs,
    run_or_eager,
)
from rlinf_twoworker.messages import LogProbs
from rlinf_twoworker.workers.base import PolicyCopy


class InferenceWorker(PolicyCopy):
    """A forward-only copy of the policy."""

    def __init__(
        self,
        settings: InferenceSettings,
        rank: int = 0,
        component: str = "inference",
    ) -> None:
        super().__init__(settings, component, rank)
        self.settings: InferenceSettings = settings
        self.dtype = dtype_for(settings.model.precision, self.device)
        self.model = self.load_model(settings.model.model_path, self.dtype).eval()
        # The actor's kernels: its decoder layers and log-softmax are compiled on GPUs (with
        # actor.compile), so by default the old log-probs are computed the same way as the new
        # ones and the first minibatch's ratio is 1 up to rounding.
        self.fused = self.device.type == "cuda" and settings.compile
        self._layers_compiled = False  # on the first compute: the compiler's imports take seconds

    @torch.no_grad()
    def compute_logprobs(self, batch: SequenceBatch) -> LogProbs:
        if not self._layers_compiled:  # the decoder layers set to compile (with self.fused)
            compile_layers(self.model, self.fused, self.settings.trim_padding_multiple >= 1)
            self._layers_compiled = True
        start = time.perf_counter()
        offload.require_weights(self.model, f"{self.component} rank {self.rank}")
        logprobs = run_or_eager(
            lambda: self._logprobs(batch),
            self.fused,
            self._go_eager,
            f"{self.component} rank {self.rank}: the compiled decoder layers / log-softmax kernel",
            "computing it eagerly from now on",
        )
        return LogProbs(logprobs, time.perf_counter() - start)

    def warm_up(self, batch: SequenceBatch) -> dict[str, float]:
        """runner.compile_warm_up (run/warmup.py): the log-probs of a made-up batch in a step's
        shapes, so what they compile is made before step 1's batch comes; the answer is
        dropped. Returns its seconds (timed_warm_up)."""
        return self.timed_warm_up(lambda: self.compute_logprobs(batch))

    def _go_eager(self) -> None:
        compile_layers(self.model, False)
        self.fused = False

    def _logprobs(self, batch: SequenceBatch) -> torch.Tensor:
        settings = self.settings
        trim, temperature = settings.trim_padding_multiple, settings.temperature
        # Kept on the device until the end: one copy back, not a wait for the GPU after each
        # micro-batch.
        out = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=self.device)
        for rows in micro_batches(batch, settings.micro_batch, trim):
            part = batch.rows(rows).to(self.device)
            out[rows] = response_logprobs(self.model, part, trim, self.fused, temperature)
        return out.cpu() * batch.response_mask


# For mypy: InferenceWorker is what the run asks of inference (workers/contract.py).
if TYPE_CHECKING:
    from rlinf_twoworker.workers import contract

    _inference: type[contract.Inference] = InferenceWorker
