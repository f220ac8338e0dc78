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


RACE_COMPILED_FROM = 2**22
"""Logit entries of a decode step (slots x vocabulary) from which the static sampler compiles its
sampling race into one pass over the logits that draws its noise as it goes
(static_kernels.drawn_race). Below it the eager race's float32 copies cost little (16 slots of a
151936-entry vocabulary: about 0.1 GB of memory traffic a step, tens of microseconds on an
H200), less than compiling one more kernel adds to the first step."""


def race_compiled(slots: int, vocab: int) -> bool:
    """Whether a static sampler of `slots` slots over `vocab` logits compiles its race (on GPUs,
    where it compiles its decode kernels)."""
    return slots * vocab >= RACE_COMPILED_FROM
