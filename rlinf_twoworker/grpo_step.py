"""One GRPO step, as named stages: generate, grade, recompute log-probs, update, sync weights.

Reads top to bottom like the algorithm. Every remote call carries the step timeout and fails
with the component, rank and node that broke.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from rlinf_twoworker.algorithm import group_advantages
from rlinf_twoworker.components import ComponentGroup, gather_fail_fast
from rlinf_twoworker.config import GRPOConfig
from rlinf_twoworker.models import SequenceBatch, dtype_for
from rlinf_twoworker.results import StepResult


def sync_dtype(cfg: GRPOConfig) -> str:
    """Weights travel in the rollout's dtype (bf16 on GPUs by default, fp32 on CPUs)."""
    device = torch.device(cfg.cluster.accelerator)  # only its type matters to dtype_for
    return str(dtype_for(cfg.rollout.model.precision, device)).removeprefix("torch.")


def split_for_actors(
    cfg: GRPOConfig, batch: SequenceBatch, old: torch.Tensor, adv: torch.Tensor, ranks: int
) -> list[list[dict[str, Any]]]:
    """Shards per actor rank: for each minibatch, a contiguous slice of its rows per rank.

    `norm` is the whole minibatch's aggregation denominator, so every rank scales its loss to
    the same global token-mean (or sequence-mean)."""
    n_mb = cfg.algorithm.n_minibatches
    per_mb = len(batch) // n_mb
    per_rank = per_mb // ranks
    shards: list[list[dict[str, Any]]] = [[] for _ in range(ranks)]
    for mb in range(n_mb):
        mb_rows = slice(mb * per_mb, (mb + 1) * per_mb)
        mask = batch.response_mask[mb_rows]
        norm = float(mask.sum()) if cfg.algorithm.loss_agg_func == "token-mean" else per_mb
        for r in range(ranks):
            rows = slice(mb * per_mb + r * per_rank, mb * per_mb + (r + 1) * per_rank)
            shards[r].append(
                {
                    "batch": batch.rows(rows),
                    "old_logprobs": old[rows],
                    "advantages": adv[rows],
                    "norm": max(norm, 1.0),
                }
            )
    return shards


async def sync_weights(group: ComponentGroup, cfg: GRPOConfig) -> dict[str, float]:
    """Actor ranks send, rollout and inference receive: one collective, entered by all."""
    dtype = sync_dtype(cfg)
    timeout = cfg.runner.timeouts.step_s
    start = time.perf_counter()
    if group.shared_gpus() == (True, True):
        nbytes = await _sync_through_ipc(group, dtype, timeout)
    else:
        members = [*group.actors(), group.one("rollout"), group.one("inference")]
        methods = ["send_weights"] * len(group.actors()) + ["receive_weights"] * 2
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
    consumers = [group.one("rollout"), group.one("inference")]
    try:
        await group.call_each(
            consumers, "import_weights", handles, dtype, timeout=timeout, stage="weight import"
        )
    finally:
        await group.call_each(actors, "release_weights", timeout=timeout, stage="weight release")
    return exported[0]["bytes"]


async def check_weights(group: ComponentGroup, dtype: str, timeout: float) -> None:
    """Fail unless rollout's and inference's weights equal the actor's, bit for bit."""
    from rlinf_twoworker.errors import ComponentError

    consumers = [group.one("rollout"), group.one("inference")]
    members = [*group.actors(), *consumers]
    digests = await group.call_each(
        members, "weights_digest", dtype, timeout=timeout, stage="weight check"
    )
    expected = digests[0]
    for member, digest in zip(consumers, digests[len(group.actors()) :]):
        if digest != expected:
            raise ComponentError(
                member.slot.component,
                member.slot.rank,
                group.describe(member),
                f"weights differ from the actor's after the sync (digest "
                f"{digest[:12]} != {expected[:12]}); the weight sync is broken",
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
    algo = cfg.algorithm
    start = time.perf_counter()

    gen = await group.call(
        group.one("rollout"),
        "generate",
        prompts,
        cfg.actor.seed + step,
        timeout=timeout,
        stage=f"step {step} rollout",
    )
    batch: SequenceBatch = gen["batch"]
    answers_solutions = [s for s in solutions for _ in range(algo.group_size)]
    t = time.perf_counter()
    graded = await group.call(
        group.one("reward"),
        "score",
        gen["texts"],
        answers_solutions,
        timeout=timeout,
        stage=f"step {step} reward",
    )
    reward_s = time.perf_counter() - t
    rewards = torch.tensor(graded["scores"], dtype=torch.float32)
    advantages = group_advantages(rewards, algo.group_size)

    old = await group.call(
        group.one("inference"),
        "compute_logprobs",
        batch,
        timeout=timeout,
        stage=f"step {step} inference",
    )
    shards = split_for_actors(cfg, batch, old["logprobs"], advantages, len(group.actors()))
    trained = await group.call_each(
        group.actors(),
        "train_step",
        timeout=timeout,
        stage=f"step {step} actor update",
        per_member=[(s,) for s in shards],
    )
    synced = await sync_weights(group, cfg)
    total = time.perf_counter() - start

    lengths = batch.response_mask.sum(-1).float()
    train = trained[0]
    train_s = max(r["seconds"] for r in trained)
    metrics = {
        "rollout/reward_scores": float(rewards.mean()),
        "rollout/correct_fraction": float((rewards > 0).float().mean()),
        "rollout/response_length": float(lengths.mean()),
        "rollout/response_length_max": float(lengths.max()),
        "actor/training/actor/final_loss": train["loss"],
        "actor/training/actor/grad_norm": train["grad_norm"],
        "actor/training/actor/lr": train["lr"],
        "actor/training/actor/clip_fraction": train["clip_fraction"],
        "actor/training/actor/approx_kl": train["approx_kl"],
        "throughput/generated_tokens_per_s": gen["generated_tokens"] / max(gen["seconds"], 1e-9),
        "throughput/trained_tokens_per_s": train["trained_tokens"] / max(train_s, 1e-9),
        "sync/bytes": synced["bytes"],
        **({"sync/verified": synced["verified"]} if "verified" in synced else {}),
    }
    timings = {
        "time/rollout": gen["seconds"],
        "time/reward": reward_s,
        "time/inference": old["seconds"],
        "time/actor/training": train_s,
        "time/actor/forward_backward": max(r["forward_backward_seconds"] for r in trained),
        "time/actor/optimizer": max(r["optimizer_seconds"] for r in trained),
        "time/sync_weights": synced["seconds"],
        "time/step": total,
    }
    return StepResult(step=step, metrics=metrics, timings=timings, finished_at=time.time())
