"""One GRPO step, as named stages: generate, grade, recompute log-probs, update, sync weights.

The step's plan (run/chunks.py: rollout chunks, their seeds, the minibatches) runs on one of
two schedules (run/pipeline.py, runner.pipeline): sequential, or RLinf's pipeline mode, where
each chunk flows on to the reward, inference and the actor while the rollout generates the
next. The weights are synced once, after the update. Every remote call carries the step
timeout and fails with the component, rank and node that broke.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import torch

from rlinf_twoworker.config import GRPOConfig
from rlinf_twoworker.engines.models import SequenceBatch, dtype_for
from rlinf_twoworker.messages import PromptRow
from rlinf_twoworker.results import StepResult
from rlinf_twoworker.run.chunks import plan_chunks, split_for_actors
from rlinf_twoworker.run.group import ComponentGroup
from rlinf_twoworker.run.pipeline import Marks, Ran, generate, grade, run_pipelined, run_sequential
from rlinf_twoworker.run.tasks import gather_fail_fast
from rlinf_twoworker.workers.contract import Policy, PolicyCopy, Trainer

__all__ = [
    "prompt_rows",
    "run_step",
    "split_for_actors",
    "sync_dtype",
    "sync_weights",
    "validate",
]

R = TypeVar("R")


def prompt_rows(cfg: GRPOConfig, samples: list[Any]) -> list[PromptRow] | None:
    """What reward.reward_fn sees of each prompt (its text and data row), or None without
    one: the math grader needs only the solutions, and nothing more travels to the reward."""
    if cfg.reward.reward_fn is None:
        return None
    if any(s.row is None for s in samples):
        raise RuntimeError("reward.reward_fn's data rows were not kept at load (a library bug)")
    return [PromptRow(s.prompt, s.row) for s in samples]


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


async def sync_weights(group: ComponentGroup, cfg: GRPOConfig) -> dict[str, float]:
    """Actor ranks send, rollout and inference receive: one collective, entered by all."""
    dtype = sync_dtype(cfg)
    timeout = cfg.runner.timeouts.step_s
    await group.settle()  # the last sync's release, done in the actor long ago
    start = time.perf_counter()
    parts: dict[str, float] = {}
    if group.shared_gpus() == (True, True):
        # Where the actor's memory is given back after the sync, its buckets go first.
        nbytes = await _sync_through_ipc(group, dtype, timeout, parts, wait=cfg.offloads)
    else:
        actors, copies = group.actors(), group.policy_copies()
        methods: list[Callable[..., dict[str, float]]] = [Trainer.send_weights] * len(actors)
        methods += [PolicyCopy.receive_weights] * len(copies)
        results = await _gather_methods(
            group, [*actors, *copies], methods, (dtype,), timeout, "weight sync"
        )
        nbytes = int(results[0]["bytes"])  # a count of bytes
    synced = {"bytes": float(nbytes), "seconds": time.perf_counter() - start, **parts}
    if cfg.rollout.validate_weight:
        await check_weights(group, dtype, timeout)
        synced["verified"] = 1.0
    if cfg.offloads:  # as RLinf: the actor's parameters leave the GPU once they are synced
        offloaded = await group.call_each(
            group.actors(), Trainer.offload, timeout=timeout, stage="actor offload after the sync"
        )
        synced["offload_seconds"] = max(o["seconds"] for o in offloaded)
    return synced


async def _sync_through_ipc(
    group: ComponentGroup, dtype: str, timeout: float, parts: dict[str, float], wait: bool
) -> int:
    """Every process on one GPU: the actor exports its buckets (a set of handles for each
    consumer), the copies map and copy them, then the actor frees them. The sync is done
    once the copies are: the release (a garbage collection and CUDA's IPC bookkeeping, 0.3-0.5
    s at the 1.5B shape) runs in the actor behind it, before the actor's next call, unless
    `wait`. Each round's seconds, seen from here, go to `parts` (export_s, import_s and, when
    waited for, release_s)."""
    actors, consumers = group.actors(), group.policy_copies()
    mark = time.perf_counter()
    exported = await group.call_each(
        actors,
        Trainer.export_weights,
        dtype,
        len(consumers),
        wait,  # offloading: the actor's state leaves before the copies take their memory
        timeout=timeout,
        stage="weight export",
    )
    parts["export_s"], mark = time.perf_counter() - mark, time.perf_counter()
    handles = exported[0]["handles"]
    try:
        await group.call_each(
            consumers,
            PolicyCopy.import_weights,
            timeout=timeout,
            stage="weight import",
            per_member=[(own, dtype) for own in handles],
        )
        parts["import_s"], mark = time.perf_counter() - mark, time.perf_counter()
    finally:  # after a failed import too: the buckets are the actor's to free
        for actor in actors:
            group.call_behind(
                actor, Trainer.release_weights, timeout=timeout, stage="weight release"
            )
    if wait:
        await group.settle()
        parts["release_s"] = time.perf_counter() - mark
    return exported[0]["bytes"]


async def check_weights(group: ComponentGroup, dtype: str, timeout: float) -> None:
    """Fail unless rollout's and inference's weights equal the actor's, bit for bit, each in
    its own precision (the actor's weights rounded to it)."""
    from rlinf_twoworker.errors import ComponentError

    consumers = group.policy_copies()
    own = await group.call_each(
        consumers, PolicyCopy.weights_dtype, timeout=timeout, stage="weight check"
    )
    for member, member_dtype in zip(consumers, own):
        members = [*group.actors(), member]
        digests = await group.call_each(
            members, Policy.weights_digest, member_dtype, timeout=timeout, stage="weight check"
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
    methods: list[Callable[..., R]],
    args: tuple,
    timeout: float,
    stage: str,
) -> list[R]:
    calls = [
        group.call(m, method, *args, timeout=timeout, stage=stage)
        for m, method in zip(members, methods)
    ]
    return await gather_fail_fast(calls)


async def run_step(
    group: ComponentGroup,
    cfg: GRPOConfig,
    step: int,
    prompts: list[list[int]],
    solutions: list[list[str]],
    rows: list[PromptRow] | None = None,
    on_answers: Callable[[list[dict[str, Any]]], Awaitable[Any]] | None = None,
) -> StepResult:
    """Generate, grade, recompute, update (on the configured schedule), sync; returns the
    step's metrics and timings. `rows`: each prompt's text and data row, for reward.reward_fn
    (prompt_rows). `on_answers`: awaited with every answer's record (answer_records) once the
    step is done, before it returns (runner.rollout_dump)."""
    marks = Marks()
    schedule = run_pipelined if cfg.pipelined else run_sequential
    plan = plan_chunks(cfg, step)
    ran = await schedule(group, cfg, step, plan, prompts, solutions, marks, rows)
    synced = await sync_weights(group, cfg)
    step_s = time.perf_counter() - marks.start
    result = StepResult(
        step=step,
        metrics=_metrics(cfg, ran, synced),
        timings=_timings(ran, synced, step_s, marks.at),
        finished_at=time.time(),
        minibatches=[_actor_metrics(m) for m in ran.trained[0].minibatches],
    )
    if on_answers is not None:
        await on_answers(answer_records(cfg, ran))
    return result


def answer_records(cfg: GRPOConfig, ran: Ran) -> list[dict[str, Any]]:
    """Each answer of the step, in prompt order (group_size contiguous answers a prompt):
    `prompt` (its index among the step's prompts), answer text, reward, advantage, length in
    tokens and whether it ended before the token limit."""
    out: list[dict[str, Any]] = []
    group = cfg.algorithm.group_size
    for chunk, advantages in zip(ran.chunks, ran.advantages):
        lengths = chunk.rollout.batch.response_mask.sum(-1).tolist()
        first = (chunk.chunk.prompts.start or 0) * group
        for i, text in enumerate(chunk.rollout.texts):
            length = int(lengths[i])
            out.append(
                {
                    "prompt": (first + i) // group,
                    "answer": text,
                    "reward": float(chunk.rewards[i]),
                    # Constant over an answer's tokens (group-relative, whitening affine).
                    "advantage": float(advantages[i, 0]) if length else 0.0,
                    "length": length,
                    "ended": length < cfg.max_new_tokens,
                }
            )
    return out


def _metrics(cfg: GRPOConfig, ran: Ran, synced: dict[str, float]) -> dict[str, float]:
    rollouts = [c.rollout for c in ran.chunks]
    train_s = max(t.seconds for t in ran.trained)
    rewards = torch.cat([c.rewards for c in ran.chunks])
    masks = [r.batch.response_mask for r in rollouts]
    prompts = torch.cat([r.batch.attention_mask[:, : r.batch.prompt_length] for r in rollouts])
    generated = sum(r.generated_tokens for r in rollouts)
    rollout_s = sum(r.seconds for r in rollouts)
    return {
        **_rollout_metrics(rewards, masks, ran.advantages),
        **_length_metrics(prompts.sum(-1), masks, cfg.max_new_tokens),
        **_actor_metrics(ran.trained[0].metrics),
        "throughput/generated_tokens_per_s": generated / max(rollout_s, 1e-9),
        "throughput/real_token_share": real_token_share([r.batch for r in rollouts]),
        "throughput/trained_tokens_per_s": ran.trained[0].trained_tokens / max(train_s, 1e-9),
        "sync/bytes": synced["bytes"],
        **({"sync/verified": synced["verified"]} if "verified" in synced else {}),
        **{f"memory/{k}/gpu_reserved_during_update_gib": v for k, v in ran.released.items()},
        "pipeline/pipelined": float(cfg.pipelined),
        "pipeline/rollout_chunks": float(len(ran.chunks)),
    }


def _timings(
    ran: Ran, synced: dict[str, float], step_s: float, at: dict[str, float]
) -> dict[str, float]:
    """Each stage's busy seconds (summed over the chunks; the actor's slowest rank), the step's
    wall clock, how much of the stages' work overlapped, and when the schedule's turning
    points came (time/at/..., seconds into the step)."""
    chunks, trained = ran.chunks, ran.trained
    refs = [c.ref.seconds for c in chunks if c.ref is not None]
    stages = {
        "time/rollout": sum(c.rollout.seconds for c in chunks),
        "time/reward": sum(c.reward_seconds for c in chunks),
        "time/inference": sum(c.old.seconds for c in chunks),
        "time/actor/training": max(t.seconds for t in trained),
        "time/sync_weights": synced["seconds"],
    }
    return {
        **stages,
        # The colocated sync's rounds: the actor's export, the copies' import, the release
        # (where the sync waits for it).
        **{
            f"time/sync_weights/{part.removesuffix('_s')}": synced[part]
            for part in ("export_s", "import_s", "release_s")
            if part in synced
        },
        **({"time/reference": sum(refs)} if refs else {}),
        "time/actor/forward_backward": max(t.forward_backward_seconds for t in trained),
        "time/actor/optimizer": max(t.optimizer_seconds for t in trained),
        **_offload_timing(trained, synced),
        "time/step": step_s,
        # The stages' seconds beyond the step's: work done while another stage ran (the
        # reference always runs beside inference, so it is left out).
        "time/overlap": max(0.0, sum(stages.values()) - step_s),
        **{f"time/at/{name}": seconds for name, seconds in at.items()},
    }


def _offload_timing(trained: list, synced: dict[str, float]) -> dict[str, float]:
    """actor.enable_offload's cost: the slowest rank's moves to and from CPU memory."""
    if "offload_seconds" not in synced:
        return {}
    moved = max(t.metrics.get("offload_seconds", 0.0) for t in trained)
    return {"time/actor/offload": moved + synced["offload_seconds"]}


async def validate(
    group: ComponentGroup,
    cfg: GRPOConfig,
    step: int,
    prompts: list[list[int]],
    solutions: list[list[str]],
    rows: list[PromptRow] | None = None,
) -> dict[str, float]:
    """Answer the validation prompts with the current policy (group_size answers each, the
    training sampling settings) and grade them, in one rollout call. The library's own
    (runner.validate): RLinf's reasoning runner schedules no validation it acts on."""
    start = time.perf_counter()
    seed = cfg.actor.seed + step + VALIDATION_SEED_OFFSET
    rollout = await generate(group, cfg, prompts, seed, f"step {step} validation")
    stage = f"step {step} validation reward"
    rewards, _ = await grade(group, cfg, rollout, solutions, stage, rows)
    return {
        "val/reward_scores": float(rewards.mean()),
        "val/correct_fraction": float((rewards > 0).float().mean()),
        "time/validation": time.perf_counter() - start,
    }


VALIDATION_SEED_OFFSET = 1_000_000_007
"""Validation samples with seeds apart from the training steps'."""


def real_token_share(batches: list[SequenceBatch]) -> float:
    """The share of the step's batches (rows x width, prompt and answer columns) that is real
    tokens: what a forward at full width computes usefully (runner.trim_padding_multiple=0)."""
    held = sum(b.attention_mask.numel() for b in batches)
    return float(sum(int(b.attention_mask.sum()) for b in batches) / max(held, 1))


def _rollout_metrics(
    rewards: torch.Tensor, masks: list[torch.Tensor], advantages: list[torch.Tensor]
) -> dict[str, float]:
    """Over every answer of the step; chunks have their own widths, so per row and per valid
    token only (padding never enters)."""
    lengths = torch.cat([m.sum(-1) for m in masks]).float()
    adv = torch.cat([a[m.bool()] for a, m in zip(advantages, masks)])
    return {
        "rollout/reward_scores": float(rewards.mean()),
        "rollout/correct_fraction": float((rewards > 0).float().mean()),
        "rollout/response_length": float(lengths.mean()),
        "rollout/response_length_max": float(lengths.max()),
        "rollout/advantages_mean": float(adv.mean()),
        "rollout/advantages_max": float(adv.max()),
        "rollout/advantages_min": float(adv.min()),
    }


def _length_metrics(
    prompt_lengths: torch.Tensor, masks: list[torch.Tensor], max_new_tokens: int
) -> dict[str, float]:
    """RLinf's length metrics of the step's answers (its compute_rollout_metrics): prompt and
    prompt + answer tokens (means), the answers' shortest and the variance of their lengths
    (unbiased), and the share that ended before the token limit (RLinf's is_end: the engine
    stopped on EOS, which it checks after the length limit)."""
    lengths = torch.cat([m.sum(-1) for m in masks]).double()
    prompts = prompt_lengths.double()
    return {
        "rollout/prompt_length": float(prompts.mean()),
        "rollout/total_length": float((prompts + lengths).mean()),
        "rollout/response_length_min": float(lengths.min()),
        "rollout/response_length_variance": float(lengths.var()) if len(lengths) > 1 else 0.0,
        "rollout/ended_fraction": float((lengths < max_new_tokens).double().mean()),
    }


_ACTOR_METRICS = (
    "final_loss",
    "policy_loss",
    "policy_loss_abs",
    "grad_norm",
    "lr",
    "ratio_mean",
    "ratio_max",
    "ratio_abs",
    "clipped_ratio",
    "clip_fraction",
    "dual_clip_fraction",
    "dual_clipped_ratio",
    "approx_kl",
    "entropy_loss",
    "kl_loss",
    "logprob_diff_max",
    "skipped_steps",
    "loss_scale",
)


def _actor_metrics(train: dict[str, float]) -> dict[str, float]:
    """The actor's metrics under the library's TensorBoard tags (actor/training/actor/...;
    storage/rlinf_scalars.py gives RLinf's)."""
    return {f"actor/training/actor/{k}": float(train[k]) for k in _ACTOR_METRICS if k in train}
