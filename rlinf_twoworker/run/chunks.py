"""The plan of one GRPO step, pure: which prompts each rollout call generates and with which
seed, which answers form each minibatch, and what each actor rank gets of it.

A step's prompts are cut into `cfg.rollout_chunks` equal chunks of whole groups. Each chunk is
one rollout call with its own sampling seed, and is cut into its own minibatches (advantages
are per group, so a chunk's advantages need only its own rewards). Both schedules of
run/pipeline.py run this plan, so the same seeds give the same update whether the stages overlap
or not. With one chunk it is the sequential step the library always had: one rollout call
seeded `actor.seed + step`, minibatches cut from the whole step (shuffled first with
`algorithm.shuffle_rollout`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rlinf_twoworker.algorithm import group_advantages, loss_weights
from rlinf_twoworker.config import GRPOConfig
from rlinf_twoworker.engines.models import SequenceBatch
from rlinf_twoworker.messages import ActorShard


@dataclass(frozen=True)
class Chunk:
    index: int
    prompts: slice
    """The chunk's prompts, as a slice of the step's prompts (whole groups)."""
    seed: int
    """The rollout's sampling seed for this chunk."""


def chunk_seed(base: int, index: int) -> int:
    """Chunk 0 samples with `base` (so one chunk samples what the single call always did);
    chunk i > 0 with a 63-bit seed drawn from (base, i), apart from every other step's and
    chunk's. A function of the seeds only, never of when a chunk runs."""
    if index == 0:
        return base
    state = np.random.SeedSequence([base % 2**64, index]).generate_state(1, np.uint64)
    return int(state[0]) >> 1


def plan_chunks(cfg: GRPOConfig, step: int) -> list[Chunk]:
    """The step's rollout calls, in order."""
    count = cfg.rollout_chunks
    per_chunk = cfg.data.rollout_batch_size // count
    base = cfg.actor.seed + step
    return [
        Chunk(c, slice(c * per_chunk, (c + 1) * per_chunk), chunk_seed(base, c))
        for c in range(count)
    ]


def chunk_order(cfg: GRPOConfig, step: int, chunk: int, rows: int) -> torch.Tensor | None:
    """The order in which a chunk's answers are cut into minibatches: with
    algorithm.shuffle_rollout a permutation seeded by actor.seed, the step and the chunk
    (chunk 0 of a one-chunk step: the library's whole-step shuffle), else None (prompt order,
    a group's answers side by side)."""
    if not cfg.algorithm.shuffle_rollout:
        return None
    seed = chunk_seed(cfg.actor.seed * 1_000_003 + step, chunk)
    return torch.randperm(rows, generator=torch.Generator().manual_seed(seed))


def minibatch_rows(cfg: GRPOConfig, step: int) -> list[torch.Tensor]:
    """The answers of each minibatch of the step, in training order, as indices into the step's
    answers in prompt order (group_size per prompt): each minibatch lies in one chunk."""
    group, per_mb = cfg.algorithm.group_size, cfg.minibatch_rows
    out = []
    for chunk in plan_chunks(cfg, step):
        begin = chunk.prompts.start * group
        rows = (chunk.prompts.stop - chunk.prompts.start) * group
        order = chunk_order(cfg, step, chunk.index, rows)
        local = torch.arange(rows) if order is None else order
        out += [begin + local[s : s + per_mb] for s in range(0, rows, per_mb)]
    return out


def rlinf_micro_batches(cfg: GRPOConfig, ranks: int) -> list[list[slice]]:
    """RLinf's micro-batches of one minibatch, per actor rank, as row slices of the minibatch:
    rank r takes the r-th contiguous share and cuts it into training_batch_size_per_gpu rows."""
    per_rank = cfg.minibatch_rows // ranks
    size = cfg.algorithm.training_batch_size_per_gpu
    return [
        [slice(r * per_rank + b, r * per_rank + b + size) for b in range(0, per_rank, size)]
        for r in range(ranks)
    ]


def split_for_actors(
    cfg: GRPOConfig,
    batch: SequenceBatch,
    old: torch.Tensor,
    adv: torch.Tensor,
    ref: torch.Tensor | None = None,
    *,
    ranks: int,
) -> list[list[ActorShard]]:
    """Shards per actor rank: for each minibatch, the rank's contiguous share of its rows with
    the minibatch's loss weights (algorithm.loss_weights over RLinf's micro-batches). The
    weights are per token and zero on padding, so a batch padded wider gets the same loss."""
    per_mb = cfg.minibatch_rows
    layout = rlinf_micro_batches(cfg, ranks)
    per_rank = per_mb // ranks
    shards: list[list[ActorShard]] = [[] for _ in range(ranks)]
    for start in range(0, len(batch), per_mb):
        mask = batch.response_mask[start : start + per_mb]
        weights = loss_weights(mask, layout, cfg.algorithm.loss_agg_func)
        metric_weights = loss_weights(mask, layout, "token-mean")
        for r in range(ranks):
            local = slice(r * per_rank, (r + 1) * per_rank)
            rows = slice(start + local.start, start + local.stop)
            shards[r].append(
                ActorShard(
                    batch.rows(rows),
                    old[rows],
                    adv[rows],
                    weights[local],
                    metric_weights[local],
                    None if ref is None else ref[rows],
                )
            )
    return shards


def chunk_shards(
    cfg: GRPOConfig,
    step: int,
    chunk: int,
    batch: SequenceBatch,
    columns: list[torch.Tensor | None],
    ranks: int,
) -> list[list[ActorShard]]:
    """One chunk's minibatches as shards per actor rank (`columns`: old log-probs, advantages,
    reference log-probs or None), in the chunk's minibatch order (chunk_order)."""
    old, adv, ref = columns
    assert old is not None and adv is not None
    order = chunk_order(cfg, step, chunk, len(batch))
    if order is not None:
        batch, old, adv = batch.rows(order), old[order], adv[order]
        ref = None if ref is None else ref[order]
    return split_for_actors(cfg, batch, old, adv, ref, ranks=ranks)


def chunk_advantages(cfg: GRPOConfig, rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GRPO advantages of one chunk's answers ([B, R], zero on padding): its groups are whole,
    so they equal the whole step's."""
    per_answer = group_advantages(rewards, cfg.algorithm.group_size)
    return per_answer.unsqueeze(-1) * mask.to(per_answer.dtype)
