"""The sampling settings every rollout engine takes (algorithm.sampling_params, resolved)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingSettings:
    do_sample: bool = True
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    """HF's: logits of tokens already in the row (prompt or answer) are divided by it when
    positive, multiplied when negative, before temperature / top-k / top-p; 1.0 is off."""
