"""One GRPO step, as named stages: generate, grade, recompute log-probs, update, sync weights.

Reads top to bottom like the algorithm. Every remote call carries the step timeout and fails
with the component, rank and node that broke.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from rlinf_twoworker.algorithm import group_advantages, loss_weights, normalize_advantages
from rlinf_twoworker.config import GRPOConfig
from rlinf_twoworker.engines.models import SequenceBatch, dtype_for
from rlinf_twoworker.messages import ActorShard, Graded, LogProbs, Rollout, TrainStats
from rlinf_twoworker.results import StepResult
from rlinf_twoworker.run.group import ComponentGroup, gather_fail_fast


def sync_dtype(cfg: GRPOConfig) -> str:
    """Weights travel in the consumers' dtype when rollout and inference share one (bf16 on
    GPUs by default, fp32 on CPUs), else in float32; each consumer casts to its own precision
    on arrival, so both get the actor's weights rounded once."""
    device = torch.device(cfg.cluster.accelerator)  # only its type matters to dtype_for
    dtypes = {
        dtype_for(cfg.rollout.model.precision, device),
        dtype_for(cfg.inference.model.precision, device),
    }
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    return str(dtype).removeprefix("torch.")


def rlinf_micro_batches(cfg: GRPOConfig, ranks: int) -> list[list[slice]]:
    """RLinf's micro-batches of one minibatch, per actor rank, as row slices of the minibatch:
    rank r takes the r-th contiguous share and cuts it into training_batch_size_per_gpu rows."""
    per_rank = len_minibatch(cfg) // ranks
    size = cfg.algorithm.training_batch_size_per_gpu
    return [
        [slice(r * per_rank + b, r * per_rank + b + size) for b in range(0, per_rank, size)]
        for r in range(ranks)
    ]


def len_minibatch(cfg: GRPOConfig) -> int:
    return cfg.data.rollout_batch_size * cfg.algorithm.group_size // cfg.algorithm.n_minibatches


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
    the minibatch's loss weights (algorithm.loss_weights over RLinf's micro-batches)."""
    per_mb = len_minibatch(cfg)
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


def token_advantages(cfg: GRPOConfig, rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GRPO advantages broadcast to every valid answer token ([B, R], zero on padding), and
    whitened over the batch with algorithm.normalize_advantages."""
    per_answer = group_advantages(rewards, cfg.algorithm.group_size)
    adv = per_answer.unsqueeze(-1) * mask.to(per_answer.dtype)
    return normalize_advantages(adv, mask) if cfg.algorithm.normalize_advantages else adv


def shuffled(
    cfg: GRPOConfig, step: int, batch: SequenceBatch, *tensors: torch.Tensor
) -> tuple[SequenceBatch, list[torch.Tensor]]:
    """With algorithm.shuffle_rollout, the answers in a seeded random order (actor.seed and
    the step), so minibatches mix groups; else unchanged."""
    if not cfg.algorithm.shuffle_rollout:
        return batch, list(tensors)
    generator = torch.Generator().manual_seed(cfg.actor.seed * 1_000_003 + step)
    order = torch.randperm(len(batch), generator=generator)
    return batch.rows(order), [t[order] for t in tensors]


async def sync_weights(group: ComponentGroup, cfg: GRPOConfig) -> dict[str, float]:
    """Actor ranks send, rollout and inference receive: one collective, entered by all."""
    dtype = sync_dtype(cfg)
    timeout = cfg.runner.timeouts.step_s
    start = time.perf_counter()
    if group.shared_gpus() == (True, True):
        nbytes = await _sync_through_ipc(group, dtype, timeout)
    else:
        members = [*group.actors(), *group.policy_copies()]
        methods = ["send_weights"] * len(group.actors())
        methods += ["receive_weights"] * len(group.policy_copies())
        results = await _gather_methods(group, members, methods, (dtype,), timeout, "weight sync")
        nbytes = results[0]["bytes"]
    synced = {"bytes": float(nbytes), "seconds": time.perf_counter() - start}
    if cfg.rollout.validate_weight:
        await check_weights(group, dtype, timeout)
        synced["verified"] = 1.0
    return synced


async def _sync_through_ipc(group: ComponentGroup, dtype: str, timeout: float) -> int:
    """Every process on one GPU: the actor exports its buckets, the copies map and copy them,
    then the actor frees them."""
    actors = group.actors()
    exported = await group.call_each(
        actors, "export_weights", dtype, timeout=timeout, stage="weight export"
    )
    handles = exported[0]["handles"]
    consumers = group.policy_copies()
    try:
        await group.call_each(
            consumers, "import_weights", handles, dtype, timeout=timeout, stage="weight import"
        )
    finally:
        await group.call_each(actors, "release_weights", timeout=timeout, stage="weight release")
    return exported[0]["bytes"]


async def check_weights(group: ComponentGroup, dtype: str, timeout: float) -> None:
    """Fail unless rollout's and inference's weights equal the actor's, bit for bit, each in
    its own precision (the actor's weights rounded to it)."""
    from rlinf_twoworker.errors import ComponentError

    consumers = group.policy_copies()
    own = await group.call_each(consumers, "weights_dtype", timeout=timeout, stage="weight check")
    for member, member_dtype in zip(consumers, own):
        members = [*group.actors(), member]
        digests = await group.call_each(
            members, "weights_digest", member_dtype, timeout=timeout, stage="weight check"
        )
        if digests[-1] != digests[0]:
            raise ComponentError(
                member.slot.component,
                member.slot.rank,
                group.describe(member),
                f"weights differ from the actor's after the sync (digest "
                f"{digests[-1][:12]} != {digests[0][:12]} in {member_dtype}); the weight sync "
                "is broken",
            )


async def _gather_methods(
    group: ComponentGroup,
    members: list,
    methods: list[str],
    args: tuple,
    timeout: float,
    stage: str,
) -> list[Any]:
    calls = [
        group.call(m, name, *args, timeout=timeout, stage=stage)
        for m, name in zip(members, methods)
    ]
    return await gather_fail_fast(calls)


async def run_step(
    group: ComponentGroup,
    cfg: GRPOConfig,
    step: int,
    prompts: list[list[int]],
    solutions: list[list[str]],
) -> StepResult:
    """Generate, grade, recompute, update, sync; returns the step's metrics and timings."""
    timeout = cfg.runner.timeouts.step_s
    start = time.perf_counter()
    rollout, rewards, reward_s = await _generate_and_grade(group, cfg, step, prompts, solutions)
    batch = rollout.batch
    adv = token_advantages(cfg, rewards, batch.response_mask)
    old, ref = await _logprobs(group, batch, timeout, f"step {step}")
    columns = [old.logprobs, adv] + ([ref.logprobs] if ref is not None else [])
    train_batch, shuffled_columns = shuffled(cfg, step, batch, *columns)
    shards = split_for_actors(cfg, train_batch, *shuffled_columns, ranks=len(group.actors()))
    trained: list[TrainStats] = await group.call_each(
        group.actors(),
        "train_step",
        timeout=timeout,
        stage=f"step {step} actor update",
        per_member=[(s,) for s in shards],
    )
    synced = await sync_weights(group, cfg)
    train_s = max(t.seconds for t in trained)
    metrics = {
        **_rollout_metrics(rewards, batch, adv),
        **_actor_metrics(trained[0].metrics),
        "throughput/generated_tokens_per_s": rollout.generated_tokens / max(rollout.seconds, 1e-9),
        "throughput/trained_tokens_per_s": trained[0].trained_tokens / max(train_s, 1e-9),
        "sync/bytes": synced["bytes"],
        **({"sync/verified": synced["verified"]} if "verified" in synced else {}),
    }
    timings = {
        "time/rollout": rollout.seconds,
        "time/reward": reward_s,
        "time/inference": old.seconds,
        **({"time/reference": ref.seconds} if ref is not None else {}),
        "time/actor/training": train_s,
        "time/actor/forward_backward": max(t.forward_backward_seconds for t in trained),
        "time/actor/optimizer": max(t.optimizer_seconds for t in trained),
        "time/sync_weights": synced["seconds"],
        "time/step": time.perf_counter() - start,
    }
    return StepResult(step=step, metrics=metrics, timings=timings, finished_at=time.time())


async def _logprobs(
    group: ComponentGroup, batch: SequenceBatch, timeout: float, stage: str
) -> tuple[LogProbs, LogProbs | None]:
    """The old log-probs (inference) and, with a KL term, the reference's, computed at once."""
    members = [group.one("inference")]
    if "reference" in group.members:
        members.append(group.one("reference"))
    results = await group.call_each(
        members, "compute_logprobs", batch, timeout=timeout, stage=f"{stage} log-probs"
    )
    return results[0], results[1] if len(results) > 1 else None


async def validate(
    group: ComponentGroup,
    cfg: GRPOConfig,
    step: int,
    prompts: list[list[int]],
    solutions: list[list[str]],
) -> dict[str, float]:
    """Answer the validation prompts with the current policy (group_size answers each, the
    training sampling settings, as RLinf's evaluation does) and grade them."""
    start = time.perf_counter()
    _, rewards, _ = await _generate_and_grade(
        group, cfg, step, prompts, solutions, seed_offset=VALIDATION_SEED_OFFSET, stage="validation"
    )
    return {
        "val/reward_scores": float(rewards.mean()),
        "val/correct_fraction": float((rewards > 0).float().mean()),
        "time/validation": time.perf_counter() - start,
    }


VALIDATION_SEED_OFFSET = 1_000_000_007
"""Validation samples with seeds apart from the training steps'."""


async def _generate_and_grade(
    group: ComponentGroup,
    cfg: GRPOConfig,
    step: int,
    prompts: list[list[int]],
    solutions: list[list[str]],
    seed_offset: int = 0,
    stage: str = "rollout",
) -> tuple[Rollout, torch.Tensor, float]:
    """The rollout's answers (group_size per prompt), their rewards and the grading time."""
    timeout = cfg.runner.timeouts.step_s
    rollout: Rollout = await group.call(
        group.one("rollout"),
        "generate",
        prompts,
        cfg.actor.seed + step + seed_offset,
        timeout=timeout,
        stage=f"step {step} {stage}",
    )
    answers_solutions = [s for s in solutions for _ in range(cfg.algorithm.group_size)]
    t = time.perf_counter()
    graded: Graded = await group.call(
        group.one("reward"),
        "score",
        rollout.texts,
        answers_solutions,
        timeout=timeout,
        stage=f"step {step} {stage} reward",
    )
    rewards = torch.tensor(graded.scores, dtype=torch.float32)
    return rollout, rewards, time.perf_counter() - t


def _rollout_metrics(
    rewards: torch.Tensor, batch: SequenceBatch, adv: torch.Tensor
) -> dict[str, float]:
    lengths = batch.response_mask.sum(-1).float()
    valid = batch.response_mask.bool()
    return {
        "rollout/reward_scores": float(rewards.mean()),
        "rollout/correct_fraction": float((rewards > 0).float().mean()),
        "rollout/response_length": float(lengths.mean()),
        "rollout/response_length_max": float(lengths.max()),
        "rollout/advantages_mean": float(adv[valid].mean()),
        "rollout/advantages_max": float(adv[valid].max()),
        "rollout/advantages_min": float(adv[valid].min()),
    }


_ACTOR_METRICS = (
    "final_loss",
    "policy_loss",
    "grad_norm",
    "lr",
    "ratio_mean",
    "ratio_max",
    "clip_fraction",
    "dual_clip_fraction",
    "approx_kl",
    "entropy_loss",
    "kl_loss",
    "logprob_diff_max",
    "skipped_steps",
)


def _actor_metrics(train: dict[str, float]) -> dict[str, float]:
    """The actor's step metrics under RLinf's TensorBoard names (actor/training/actor/...)."""
    return {f"actor/training/actor/{k}": float(train[k]) for k in _ACTOR_METRICS if k in train}
