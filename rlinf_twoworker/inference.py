"""Inference: recompute the log-probabilities of every answer token under the current policy.

Runs with the weights the actor has before its update (the sync happens after each update), so
these are the "old" log-probabilities of the PPO ratio.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from rlinf_twoworker.config import GRPOConfig
from rlinf_twoworker.models import (
    SequenceBatch,
    dtype_for,
    load_causal_lm,
    response_logprobs,
    run_or_eager,
)
from rlinf_twoworker.worker import PolicyCopy


class InferenceWorker(PolicyCopy):
    """A forward-only copy of the policy."""

    def __init__(self, cfg: GRPOConfig, rank: int = 0) -> None:
        super().__init__(cfg, "inference", rank)
        self.dtype = dtype_for(cfg.inference.model.precision, self.device)
        self.model = load_causal_lm(cfg.inference.model.model_path, self.dtype, self.device).eval()
        self.fused = self.device.type == "cuda"  # compiled log-softmax kernel (GPUs only)

    @torch.no_grad()
    def compute_logprobs(self, batch: SequenceBatch) -> dict[str, Any]:
        start = time.perf_counter()
        logprobs = run_or_eager(
            lambda: self._logprobs(batch),
            self.fused,
            self._go_eager,
            f"inference rank {self.rank}: the compiled log-softmax kernel",
            "computing it eagerly from now on",
        )
        return {"logprobs": logprobs, "seconds": time.perf_counter() - start}

    def _go_eager(self) -> None:
        self.fused = False

    def _logprobs(self, batch: SequenceBatch) -> torch.Tensor:
        micro = self.cfg.algorithm.logprob_forward_micro_batch_size
        trim = self.cfg.runner.trim_padding_multiple
        parts = []
        for begin in range(0, len(batch), micro):
            rows = batch.rows(slice(begin, begin + micro)).to(self.device)
            parts.append(response_logprobs(self.model, rows, trim, self.fused).cpu())
        return torch.cat(parts) * batch.response_mask
