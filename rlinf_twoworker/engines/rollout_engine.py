"""The rollout engine interface, and the choice of an engine for a model (`rollout.engine`).

An engine turns left-padded prompts into answers with the policy the rollout component holds.
It shares that component's model: the weight sync writes the new weights into the model's
parameters in place, then calls `weights_loaded()` so an engine that keeps derived state
(fused projections, captured graphs) can check it still reads those parameters.

Engines (each in its own module):
  static  engines/static.py: the library's static-KV-cache sampler, continuous batching over
          decode slots sized to memory, CUDA-graph decode on GPUs (Qwen2, Qwen3, Llama and
          Mistral models, full attention)
  hf      engines/hf_generate.py: transformers' batched, KV-cached `generate` (any causal LM)
`auto` takes static where it supports the model over the whole sequence, else hf with a warning.
A new engine is a module with a class of this interface and a line in ENGINES; the engines
import only engines/sampling.py from here (no import circle).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch

from rlinf_twoworker.engines.sampling import SamplingSettings
from rlinf_twoworker.errors import TwoWorkerError

logger = logging.getLogger(__name__)


class RolloutEngine(Protocol):
    name: str
    fixed_prompt_width: bool
    """Whether prompts should always be padded to data.max_prompt_length (fixed shapes)."""
    continuous: bool
    """True: generate() takes every row of a rollout and bounds its own batch (static: at most
    rollout.max_batch_size decode slots, and no more than fit in memory), giving a slot to the
    next waiting row as soon as its answer ends. False: the caller cuts the rows into chunks
    of rollout.max_batch_size, each decoded until its longest answer ends."""

    def generate(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        max_new: int,
        eos_ids: list[int],
        pad_id: int,
        settings: SamplingSettings,
    ) -> torch.Tensor:
        """Left-padded prompts [B, P] (with their attention mask) -> answers [B, <= max_new]
        on the CPU, in the rows' order, padded with pad_id after each row's EOS."""
        ...

    def weights_loaded(self) -> None:
        """The model's parameters were overwritten in place (a weight sync)."""
        ...

    def release_memory(self) -> None:
        """Drop what the engine keeps between calls on the device (KV caches, captured graphs):
        another component needs the memory (actor.enable_offload); the next call rebuilds it."""
        ...


Builder = Callable[..., RolloutEngine]
"""builder(model, max_batch_size=..., memory_budget_bytes=..., where=...) -> an engine."""


def _static() -> tuple[Callable[[Any, int], str | None], Builder]:
    from rlinf_twoworker.engines.static import StaticEngine, unsupported_reason

    return unsupported_reason, StaticEngine


def _hf() -> tuple[Callable[[Any, int], str | None], Builder]:
    from rlinf_twoworker.engines.hf_generate import GenerateEngine

    # generate sizes its cache per call and its caller chunks the rows (continuous=False): the
    # batch and memory limits are not the engine's to apply.
    return (lambda model, max_len: None), (lambda model, **limits: GenerateEngine(model))


ENGINES: dict[str, Callable[[], tuple[Callable[[Any, int], str | None], Builder]]] = {
    "static": _static,
    "hf": _hf,
}
"""name -> (why the engine cannot run a model over max_len tokens or None, its builder)."""


def choose_engine(
    choice: str,
    model: Any,
    max_len: int,
    where: str,
    max_batch_size: int | None = None,
    memory_budget_bytes: int | None = None,
) -> RolloutEngine:
    """The engine `rollout.engine=choice` asks for, for `model` over prompt + answer of
    `max_len` tokens. 'auto' falls back to hf (with a warning that says why) where static does
    not support the model; a named engine that cannot run it raises, naming `where`.
    `max_batch_size` (rollout.max_batch_size) and `memory_budget_bytes` bound a continuous
    engine's decode slots (None: no bound beyond the rows and the free memory)."""
    limits = {
        "max_batch_size": max_batch_size,
        "memory_budget_bytes": memory_budget_bytes,
        "where": where,
    }
    if choice == "auto":
        unsupported, engine = ENGINES["static"]()
        reason = unsupported(model, max_len)
        if reason is None:
            return engine(model, **limits)
        logger.warning(
            "rollout.engine=auto uses hf, transformers' generate (%s): %s", where, reason
        )
        return ENGINES["hf"]()[1](model, **limits)
    if choice not in ENGINES:
        raise TwoWorkerError(
            f"rollout.engine={choice!r} ({where}) is not an engine; choose auto, "
            + ", ".join(ENGINES)
        )
    unsupported, engine = ENGINES[choice]()
    reason = unsupported(model, max_len)
    if reason is not None:
        raise TwoWorkerError(f"rollout.engine={choice} ({where}): {reason}; use rollout.engine=hf")
    return engine(model, **limits)


__all__ = ["ENGINES", "RolloutEngine", "SamplingSettings", "choose_engine"]
