"""The two schedules of a step's plan (run/chunks.py): sequential, and RLinf's pipeline mode.

Sequential: generate every chunk, then grade every chunk, then recompute every chunk's old
log-probs, then one actor call over every minibatch. Pipelined: every chunk's rollout call is
submitted at once (the rollout runs them back to back, in order); as each chunk comes back, the
reward grades it and inference recomputes its log-probs at the same time, and the actor trains
on the chunk's minibatches, one call each, as soon as the chunk's rewards and log-probs are in
(with algorithm.normalize_advantages, once every chunk's rewards are in: the whitening is over
the whole step). Nothing syncs weights inside a step, so rollout and inference compute with the
step's starting weights while the actor updates: both schedules run the same calls on the same
tensors and give the same update.

Every remote call goes through ComponentGroup.call (the step timeout; a failure names the
component, its rank and its node); the first failure cancels the step's other waits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rlinf_twoworker.algorithm import normalize_advantages
from rlinf_twoworker.config import GRPOConfig
from rlinf_twoworker.engines.models import SequenceBatch
from rlinf_twoworker.messages import ActorShard, Graded, LogProbs, PromptRow, Rollout, TrainStats
from rlinf_twoworker.run.chunks import (
    Chunk,
    chunk_advantages,
    chunk_shards,
)
from rlinf_twoworker.run.group import ComponentGroup
from rlinf_twoworker.run.tasks import gather_fail_fast
from rlinf_twoworker.workers import contract


@dataclass
class ChunkResult:
    """One chunk through rollout, reward and inference (and the reference, with a KL term)."""

    chunk: Chunk
    rollout: Rollout
    rewards: torch.Tensor
    reward_seconds: float
    old: LogProbs
    ref: LogProbs | None


@dataclass
class Ran:
    """What a schedule hands back: every chunk, its advantages, each actor rank's update."""

    chunks: list[ChunkResult]
    advantages: list[torch.Tensor]
    trained: list[TrainStats]
    released: dict[str, float] = field(default_factory=dict)
    """actor.enable_offload: what each copy on an actor's GPU still held during the update
    ("<component>/<rank>" -> GiB reserved by PyTorch after it gave its memory back)."""


@dataclass
class Marks:
    """When things happened, in seconds since the step began, as the controller saw them."""

    start: float = field(default_factory=time.perf_counter)
    at: dict[str, float] = field(default_factory=dict)

    def first(self, name: str) -> None:
        self.at.setdefault(name, time.perf_counter() - self.start)

    def last(self, name: str) -> None:
        self.at[name] = time.perf_counter() - self.start


async def generate(
    group: ComponentGroup,
    cfg: GRPOConfig,
    prompts: list[list[int]],
    seed: int,
    stage: str,
) -> Rollout:
    return await group.call(
        group.one("rollout"),
        contract.Rollout.generate,
        prompts,
        seed,
        timeout=cfg.runner.timeouts.step_s,
        stage=stage,
    )


async def grade(
    group: ComponentGroup,
    cfg: GRPOConfig,
    rollout: Rollout,
    solutions: list[list[str]],
    stage: str,
    rows: list[PromptRow] | None = None,
) -> tuple[torch.Tensor, float]:
    """The reward of every answer (`solutions` per prompt) and the grading's seconds. `rows`
    (per prompt; only with reward.reward_fn) go along, one per answer (pickled once each)."""
    per_answer = [s for s in solutions for _ in range(cfg.algorithm.group_size)]
    with_rows = (
        () if rows is None else ([r for r in rows for _ in range(cfg.algorithm.group_size)],)
    )
    start = time.perf_counter()
    graded: Graded = await group.call(
        group.one("reward"),
        contract.Grader.score,
        rollout.texts,
        per_answer,
        *with_rows,
        timeout=cfg.runner.timeouts.step_s,
        stage=stage,
    )
    # The reward's own grading seconds (its calls queue behind one another: a chunk's call
    # timed here would count the wait for the one before); the call's, where it gives none.
    seconds = graded.stats.get("seconds", time.perf_counter() - start)
    return torch.tensor(graded.scores, dtype=torch.float32), float(seconds)


async def logprobs(
    group: ComponentGroup, cfg: GRPOConfig, batch: SequenceBatch, stage: str
) -> tuple[LogProbs, LogProbs | None]:
    """The old log-probs (inference) and, with a KL term, the reference's, computed at once."""
    members = [group.one("inference")]
    if "reference" in group.members:
        members.append(group.one("reference"))
    results = await group.call_each(
        members,
        contract.LogProbModel.compute_logprobs,
        batch,
        timeout=cfg.runner.timeouts.step_s,
        stage=stage,
    )
    return results[0], results[1] if len(results) > 1 else None


def _advantages(cfg: GRPOConfig, done: list[ChunkResult]) -> list[torch.Tensor]:
    advs = [chunk_advantages(cfg, c.rewards, c.rollout.batch.response_mask) for c in done]
    if cfg.algorithm.normalize_advantages:
        return normalize_advantages(advs, [c.rollout.batch.response_mask for c in done])
    return advs


def _shards(
    cfg: GRPOConfig, step: int, done: ChunkResult, adv: torch.Tensor, ranks: int
) -> list[list[ActorShard]]:
    ref = None if done.ref is None else done.ref.logprobs
    columns = [done.old.logprobs, adv, ref]
    return chunk_shards(cfg, step, done.chunk.index, done.rollout.batch, columns, ranks)


async def run_sequential(
    group: ComponentGroup,
    cfg: GRPOConfig,
    step: int,
    chunks: list[Chunk],
    prompts: list[list[int]],
    solutions: list[list[str]],
    marks: Marks,
    rows: list[PromptRow] | None = None,
) -> Ran:
    """Each stage over every chunk, then the next stage; one actor call for the step."""
    named = _namer(step, len(chunks))
    rollouts = []
    for c in chunks:
        rollouts.append(await generate(group, cfg, prompts[c.prompts], c.seed, named("rollout", c)))
    marks.last("rollout_done")
    graded = [
        await grade(
            group, cfg, rollout, solutions[c.prompts], named("rollout reward", c), _of(rows, c)
        )
        for c, rollout in zip(chunks, rollouts)
    ]
    done = []
    for c, rollout, (rewards, seconds) in zip(chunks, rollouts, graded):
        old, ref = await logprobs(group, cfg, rollout.batch, named("log-probs", c))
        marks.first("first_logprobs_done")
        done.append(ChunkResult(c, rollout, rewards, seconds, old, ref))
    advs = _advantages(cfg, done)
    ranks = len(group.actors())
    shards: list[list[ActorShard]] = [[] for _ in range(ranks)]
    for result, adv in zip(done, advs):
        for rank, own in enumerate(_shards(cfg, step, result, adv, ranks)):
            shards[rank] += own
    released: dict[str, float] = {}
    if cfg.offloads:  # the copies on the actor's GPUs give their memory back for the update
        copies = group.copies_beside_actors()
        reports = await group.call_each(
            copies,
            contract.PolicyCopy.release_memory,
            timeout=cfg.runner.timeouts.step_s,
            stage=f"step {step} memory release",
        )
        for member, report in zip(copies, reports):
            released[f"{member.slot.component}/{member.slot.rank}"] = report["reserved_gib"]
    marks.first("first_update_start")
    trained: list[TrainStats] = await group.call_each(
        group.actors(),
        contract.Trainer.train_step,
        timeout=cfg.runner.timeouts.step_s,
        stage=f"step {step} actor update",
        per_member=[(s,) for s in shards],
    )
    marks.last("update_done")
    return Ran(done, advs, trained, released)


async def run_pipelined(
    group: ComponentGroup,
    cfg: GRPOConfig,
    step: int,
    chunks: list[Chunk],
    prompts: list[list[int]],
    solutions: list[list[str]],
    marks: Marks,
    rows: list[PromptRow] | None = None,
) -> Ran:
    """Every chunk flows on as soon as it is generated; the actor trains on each minibatch as
    soon as its chunk is graded and recomputed, in the plan's order."""
    named = _namer(step, len(chunks))

    async def through(c: Chunk) -> ChunkResult:
        # Tasks start in creation order, so the rollout gets its calls in chunk order.
        rollout = await generate(group, cfg, prompts[c.prompts], c.seed, named("rollout", c))
        marks.last("rollout_done")
        (rewards, seconds), (old, ref) = await gather_fail_fast(
            [
                grade(
                    group,
                    cfg,
                    rollout,
                    solutions[c.prompts],
                    named("rollout reward", c),
                    _of(rows, c),
                ),
                logprobs(group, cfg, rollout.batch, named("log-probs", c)),
            ]
        )
        marks.first("first_logprobs_done")
        return ChunkResult(c, rollout, rewards, seconds, old, ref)

    flowing = [asyncio.ensure_future(through(c)) for c in chunks]

    async def train() -> tuple[list[torch.Tensor], list[TrainStats]]:
        ranks = len(group.actors())
        per_minibatch: list[list[TrainStats]] = []
        advs: list[torch.Tensor] = []
        if cfg.algorithm.normalize_advantages:  # whitened over the step: every reward first
            advs = _advantages(cfg, list(await asyncio.gather(*flowing)))
        for index, task in enumerate(flowing):
            result = await task
            if not cfg.algorithm.normalize_advantages:
                advs.append(_advantages(cfg, [result])[0])
            shards = _shards(cfg, step, result, advs[index], ranks)
            for m in range(len(shards[0])):
                marks.first("first_update_start")
                per_minibatch.append(
                    await group.call_each(
                        group.actors(),
                        contract.Trainer.train_step,
                        timeout=cfg.runner.timeouts.step_s,
                        stage=f"step {step} actor update (minibatch {len(per_minibatch)})",
                        per_member=[([own[m]],) for own in shards],
                    )
                )
        marks.last("update_done")
        return advs, [TrainStats.merge([mb[r] for mb in per_minibatch]) for r in range(ranks)]

    *done, (advs, trained) = await gather_fail_fast([*flowing, train()])
    return Ran(done, advs, trained)


def _of(rows: list[PromptRow] | None, chunk: Chunk) -> list[PromptRow] | None:
    """The chunk's prompts' rows (reward.reward_fn), or None."""
    return None if rows is None else rows[chunk.prompts]


def _namer(step: int, chunks: int) -> Callable[[str, Chunk], str]:
    """A stage's name in errors: 'step 3 log-probs (chunk 1 of 4)', 'step 3 log-probs'."""

    def named(what: str, chunk: Chunk) -> str:
        part = f" (chunk {chunk.index} of {chunks})" if chunks > 1 else ""
        return f"step {step} {what}{part}"

    return named
