"""Rollout: sample `group_size` answers per prompt with the current policy.

The sampler is `transformers`' batched, KV-cached `generate` with the configured sampling
settings; prompts are left-padded so every answer starts at the same column.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from rlinf_twoworker.config import GRPOConfig
from rlinf_twoworker.models import SequenceBatch, dtype_for, load_causal_lm, load_tokenizer
from rlinf_twoworker.weight_sync import receive_weights, state_digest, weights_digest
from rlinf_twoworker.worker import Worker


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def response_mask(responses: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """1 for every token up to and including the first EOS of each row."""
    is_eos = torch.isin(responses, torch.tensor(eos_ids, device=responses.device))
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    return (~after_eos).long()


class RolloutWorker(Worker):
    """Holds a copy of the policy and generates answers for a batch of prompts."""

    def __init__(self, cfg: GRPOConfig, rank: int = 0) -> None:
        super().__init__(cfg, "rollout", rank)
        self.tokenizer = load_tokenizer(
            cfg.actor.tokenizer.tokenizer_model or cfg.rollout.model.model_path
        )
        self.dtype = dtype_for(cfg.rollout.model.precision, self.device)
        self.model = load_causal_lm(cfg.rollout.model.model_path, self.dtype, self.device).eval()
        eos = self.tokenizer.eos_token_id
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        eos_ids = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        self.eos_ids = sorted({i for i in [eos, *eos_ids] if i is not None})

    def _sampling_kwargs(self) -> dict[str, Any]:
        params = self.cfg.algorithm.sampling_params
        vocab = self.model.config.vocab_size
        top_k = params.top_k if 0 < params.top_k < vocab else None
        return {
            "do_sample": params.do_sample,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": top_k,
            "max_new_tokens": self.cfg.max_new_tokens,
        }

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], seed: int) -> dict[str, Any]:
        """Answers for each prompt, `group_size` rows per prompt, contiguous per group."""
        start = time.perf_counter()
        group = self.cfg.algorithm.group_size
        rows = [p for p in prompts for _ in range(group)]
        pad_id = self.tokenizer.pad_token_id
        ids, mask = left_pad(rows, pad_id)
        torch.manual_seed(seed)
        outputs = []
        chunk = self.cfg.rollout.max_batch_size
        for begin in range(0, len(rows), chunk):
            out = self.model.generate(
                input_ids=ids[begin : begin + chunk].to(self.device),
                attention_mask=mask[begin : begin + chunk].to(self.device),
                eos_token_id=self.eos_ids,
                pad_token_id=pad_id,
                **self._sampling_kwargs(),
            )
            outputs.append(out[:, ids.shape[1] :].cpu())
        width = max(o.shape[1] for o in outputs)
        responses = torch.cat(
            [torch.nn.functional.pad(o, (0, width - o.shape[1]), value=pad_id) for o in outputs]
        )
        resp_mask = response_mask(responses, self.eos_ids)
        texts = self.tokenizer.batch_decode(
            [r[m.bool()].tolist() for r, m in zip(responses, resp_mask)], skip_special_tokens=True
        )
        batch = SequenceBatch(
            torch.cat([ids, responses], 1), torch.cat([mask, resp_mask], 1), resp_mask, ids.shape[1]
        )
        return {
            "batch": batch,
            "texts": texts,
            "seconds": time.perf_counter() - start,
            "generated_tokens": int(resp_mask.sum()),
        }

    def receive_weights(self, sync_dtype: str) -> dict[str, float]:
        start = time.perf_counter()
        received = receive_weights(self.model, self.sync, getattr(torch, sync_dtype))
        return {"bytes": received, "seconds": time.perf_counter() - start}

    def weights(self) -> dict[str, torch.Tensor]:
        return state_digest(self.model)

    def weights_digest(self, sync_dtype: str) -> str:
        return weights_digest(self.model, getattr(torch, sync_dtype))
