"""The compile warm-up (runner.compile_warm_up): compile before step 1 needs it.

torch.compile compiles on a function's first call with a new shape, so without a warm-up step
1 pays each component's compilation (and, with a warm compile cache, the tracing and cache
lookups) inside its stages, one after another: the rollout generates, then inference compiles
and computes the old log-probs, then the actor compiles and trains. Right after the first
weight sync the run hands inference (and the reference) one made-up batch and each actor
rank one made-up minibatch, in the shapes of chunk 0 of a step whose longest answer reaches
the token limit (the shapes of most early steps), cut by the same code that cuts a real step.
They compile while the rollout generates; their real calls of step 1 queue behind these
(calls to one component run in order) and find the kernels made.

Nothing of the training changes: inference's answer is dropped; the actor's gradients are
dropped, its optimiser does not step and its random state is restored.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from rlinf_twoworker.config import GRPOConfig
from rlinf_twoworker.engines.models import SequenceBatch
from rlinf_twoworker.run.chunks import chunk_shards, plan_chunks
from rlinf_twoworker.run.group import ComponentGroup, Member
from rlinf_twoworker.run.startup import StartupClock
from rlinf_twoworker.run.tasks import background
from rlinf_twoworker.storage.rundir import RunLog
from rlinf_twoworker.workers.contract import LogProbModel, Trainer


def full_length_batch(cfg: GRPOConfig, rows: int) -> SequenceBatch:
    """`rows` answers of the longest shape a step makes: the prompt left-padded to
    data.max_prompt_length, the answer max_new_tokens wide, the first answer reaching the
    limit and the others ending earlier, some prompts shorter than the width (so the attention
    mask has padding, as in real batches). Token id 0 throughout: only the shapes matter."""
    prompt, answer = cfg.data.max_prompt_length, cfg.max_new_tokens
    attention = torch.ones(rows, prompt + answer, dtype=torch.long)
    response = torch.ones(rows, answer, dtype=torch.long)
    for row in range(1, rows):
        attention[row, : row % min(prompt, 4)] = 0  # left padding of the prompt
        end = max(1, answer - row % max(1, answer // 2))  # answers ending before the limit
        attention[row, prompt + end :] = 0
        response[row, end:] = 0
    ids = torch.zeros(rows, prompt + answer, dtype=torch.long)
    return SequenceBatch(ids, attention, response, prompt)


def warm_up_inputs(cfg: GRPOConfig, ranks: int) -> tuple[SequenceBatch, list[Any]]:
    """Chunk 0's batch at full length, and each actor rank's shard of its first minibatch
    (zero advantages and old log-probs: the loss is finite and its gradient dropped)."""
    chunk = plan_chunks(cfg, 1)[0]
    rows = (chunk.prompts.stop - chunk.prompts.start) * cfg.algorithm.group_size
    batch = full_length_batch(cfg, rows)
    zeros = torch.zeros(batch.response_mask.shape)
    ref = zeros if cfg.algorithm.kl_beta > 0 else None
    shards = chunk_shards(cfg, 1, chunk.index, batch, [zeros, zeros, ref], ranks)
    return batch, [own[0] for own in shards]


class WarmUp:
    """The warm-up calls in flight, started after the first sync and read after step 1."""

    def __init__(self) -> None:
        self.calls: list[tuple[Member, asyncio.Future]] = []

    def start(self, group: ComponentGroup, cfg: GRPOConfig, log: RunLog) -> None:
        """Make every warm-up call now, without waiting (skipped, and logged, where the actor
        offloads: its state is in CPU memory outside the update)."""
        if not cfg.warms_up:
            return
        if cfg.offloads:
            log.info(
                "WARM_UP skipped: actor.enable_offload keeps the actor's state in CPU memory "
                "outside its update (step 1 compiles as it goes)"
            )
            return
        actors = group.actors()
        batch, shards = warm_up_inputs(cfg, len(actors))
        timeout = cfg.runner.timeouts.step_s
        copies = [m for m in group.all() if group.table[m.slot.component].logprobs]
        stage = "compile warm-up"
        for member in copies:
            call = group.call(member, LogProbModel.warm_up, batch, timeout=timeout, stage=stage)
            self.calls.append((member, background(call)))  # read by finish
        for member, shard in zip(actors, shards):
            call = group.call(member, Trainer.warm_up, shard, timeout=timeout, stage=stage)
            self.calls.append((member, background(call)))

    async def finish(self, clock: StartupClock, log: RunLog) -> None:
        """After step 1: record each warm-up's seconds (warm_up/<component>:<rank>) and, where
        it compiled, torch.compile's share (warm_up_compile/<component>:<rank>). A failed
        warm-up is logged, not raised: the step compiled what it needed itself."""
        calls, self.calls = self.calls, []
        for member, task in calls:
            who = f"{member.slot.component}:{member.slot.rank}"
            try:
                answer = await task
            except Exception as exc:  # the step that followed it succeeded
                log.info(f"WARM_UP {who} failed ({type(exc).__name__}: {exc}); step 1 compiled")
                continue
            clock.record(f"warm_up/{who}", answer["seconds"])
            if answer["compile_s"] > 0:
                clock.record(f"warm_up_compile/{who}", answer["compile_s"])
