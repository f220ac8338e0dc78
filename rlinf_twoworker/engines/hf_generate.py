"""The `hf` rollout engine: transformers' batched, KV-cached `generate`, for any causal LM.

Every sampling setting is passed explicitly: `generate` would otherwise take unset ones from the
model's generation_config (Qwen2.5-Instruct's sets repetition_penalty=1.05).
"""

from __future__ import annotations

from typing import Any

import torch

from rlinf_twoworker.engines.sampling import SamplingSettings


class GenerateEngine:
    name = "hf"
    fixed_prompt_width = False
    continuous = False  # the caller cuts the rows into chunks of rollout.max_batch_size

    def __init__(self, model: Any) -> None:
        self.model = model

    def generate(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        max_new: int,
        eos_ids: list[int],
        pad_id: int,
        settings: SamplingSettings,
    ) -> torch.Tensor:
        device = next(self.model.parameters()).device
        out = self.model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            eos_token_id=eos_ids,
            pad_token_id=pad_id,
            max_new_tokens=max_new,
            do_sample=settings.do_sample,
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=settings.top_k,
            repetition_penalty=settings.repetition_penalty,
        )
        return out[:, ids.shape[1] :].cpu()

    def weights_loaded(self) -> None:
        """generate reads the parameters directly: nothing to redo."""

    def release_memory(self) -> None:
        """generate sizes its cache per call: nothing is kept between calls."""
