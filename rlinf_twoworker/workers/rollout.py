"""Rollout: sample `group_size` answers per prompt with the current policy.

The answers come from a rollout engine (engines/rollout_engine.py, `rollout.engine`): the
library's static-cache sampler (engines/static.py: preallocated KV cache, CUDA-graph decode; the
default for Qwen2, Qwen3, Llama and Mistral models) or transformers' `generate`
(engines/hf_generate.py). Prompts are left-padded so every answer starts at one column. The
static engine takes all of a call's rows at once and decodes them with continuous batching in
at most rollout.max_batch_size slots (fewer where memory is short); `generate` gets them in
chunks of rollout.max_batch_size rows.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from rlinf_twoworker.config.settings import RolloutSettings
from rlinf_twoworker.engines import offload
from rlinf_twoworker.engines.models import SequenceBatch, dtype_for, load_tokenizer
from rlinf_twoworker.engines.rollout_engine import SamplingSettings, choose_engine
from rlinf_twoworker.messages import Rollout
from rlinf_twoworker.workers.base import PolicyCopy


def left_pad(
    prompts: list[list[int]], pad_id: int, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(width or 0, max(len(p) for p in prompts))
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


class RolloutWorker(PolicyCopy):
    """Holds a copy of the policy and generates answers for a batch of prompts."""

    def __init__(self, settings: RolloutSettings, rank: int = 0) -> None:
        super().__init__(settings, "rollout", rank)
        self.settings: RolloutSettings = settings
        self.dtype = dtype_for(settings.model.precision, self.device)
        start = time.perf_counter()
        self.tokenizer = load_tokenizer(settings.tokenizer_path)
        self.startup["tokenizer"] = time.perf_counter() - start
        self.model = self.load_model(settings.model.model_path, self.dtype).eval()
        eos = self.tokenizer.eos_token_id
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        eos_ids = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        self.eos_ids = sorted({i for i in [eos, *eos_ids] if i is not None})
        # Prompts are cut to max_prompt_length, so every sampler is built for this length.
        max_len = settings.max_prompt_length + settings.max_new_tokens
        where = f"rollout rank {rank}, model {settings.model.model_path}"
        start = time.perf_counter()
        self.engine = choose_engine(
            settings.engine.engine,
            self.model,
            max_len,
            where,
            max_batch_size=settings.engine.max_batch_size,
        )
        self.startup["engine"] = time.perf_counter() - start

    @property
    def static(self) -> bool:
        """Whether the static-cache sampler generates (rollout.engine static, or auto on a
        model it supports)."""
        return self.engine.name == "static"

    def receive_weights(self, sync_dtype: str) -> dict[str, float]:
        got = super().receive_weights(sync_dtype)
        self.engine.weights_loaded()
        return got

    def import_weights(self, handles: list, sync_dtype: str) -> dict[str, float]:
        got = super().import_weights(handles, sync_dtype)
        self.engine.weights_loaded()
        return got

    def release_memory(self) -> dict[str, float]:
        self.engine.release_memory()  # its KV caches and graphs, before the weights
        return super().release_memory()

    def _sampling_kwargs(self) -> dict[str, Any]:
        """The sampling settings for either engine, every one passed explicitly: generate()
        would otherwise take it from the model's generation_config (Qwen2.5-Instruct's sets
        repetition_penalty=1.05, which the static engine would not apply)."""
        params = self.settings.sampling
        vocab = self.model.config.vocab_size
        top_k = params.top_k if 0 < params.top_k < vocab else None
        return {
            "do_sample": params.do_sample,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": top_k,
            "repetition_penalty": params.repetition_penalty,
            "max_new_tokens": self.settings.max_new_tokens,
        }

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], seed: int) -> Rollout:
        """Answers for each prompt, `group_size` rows per prompt, contiguous per group."""
        start = time.perf_counter()
        offload.require_weights(self.model, f"rollout rank {self.rank}")
        group = self.settings.group_size
        rows = [p for p in prompts for _ in range(group)]
        pad_id = self.tokenizer.pad_token_id
        # A fixed prompt width keeps the static sampler's shapes (and its CUDA graph) constant.
        width = self.settings.max_prompt_length if self.engine.fixed_prompt_width else None
        ids, mask = left_pad(rows, pad_id, width)
        torch.manual_seed(seed)
        outputs = []
        # A continuous engine bounds its own batch (decode slots) and refills it as answers end.
        chunk = len(rows) if self.engine.continuous else self.settings.engine.max_batch_size
        for begin in range(0, len(rows), chunk):
            part = slice(begin, begin + chunk)
            outputs.append(self._generate_chunk(ids[part], mask[part], pad_id))
        longest = max(o.shape[1] for o in outputs)
        responses = torch.cat(
            [torch.nn.functional.pad(o, (0, longest - o.shape[1]), value=pad_id) for o in outputs]
        )
        resp_mask = response_mask(responses, self.eos_ids)
        texts = self.tokenizer.batch_decode(
            [r[m.bool()].tolist() for r, m in zip(responses, resp_mask)], skip_special_tokens=True
        )
        batch = SequenceBatch(
            torch.cat([ids, responses], 1), torch.cat([mask, resp_mask], 1), resp_mask, ids.shape[1]
        )
        return Rollout(
            batch=batch,
            texts=texts,
            generated_tokens=int(resp_mask.sum()),
            seconds=time.perf_counter() - start,
        )

    def _generate_chunk(self, ids: torch.Tensor, mask: torch.Tensor, pad_id: int) -> torch.Tensor:
        kwargs = self._sampling_kwargs()
        max_new = kwargs.pop("max_new_tokens")
        return self.engine.generate(
            ids, mask, max_new, self.eos_ids, pad_id, SamplingSettings(**kwargs)
        )


# For mypy: RolloutWorker is what the run asks of the rollout (workers/contract.py).
if TYPE_CHECKING:
    from rlinf_twoworker.workers import contract

    _rollout: type[contract.Rollout] = RolloutWorker
