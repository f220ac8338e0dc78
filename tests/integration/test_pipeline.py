"""RLinf's pipeline mode: the step's plan (chunks, seeds, minibatches) as pure functions, and a
pipelined run on a real 2-node cluster that trains exactly as the sequential one while its
stages overlap."""

from __future__ import annotations

import math
import sys
import time

import pytest
import ray
import torch
from support import ONE_RANK

from rlinf_twoworker import ConfigError, run_grpo_two_worker
from rlinf_twoworker.algorithm import group_advantages, normalize_advantages
from rlinf_twoworker.api.demo import demo_config, make_inputs
from rlinf_twoworker.config import load_config, to_typed
from rlinf_twoworker.engines.models import SequenceBatch
from rlinf_twoworker.messages import TrainStats, step_metrics
from rlinf_twoworker.run.chunks import (
    chunk_advantages,
    minibatch_rows,
    plan_chunks,
    split_for_actors,
)
from rlinf_twoworker.workers.rollout import RolloutWorker

# Classes injected into a run travel by value: the workers cannot import this test module.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

COLOCATED = [
    "cluster.num_nodes=1",
    "cluster.component_placement={rollout:0,inference:0,reward:0,actor:'0-1'}",
]


def cfg_of(*overrides: str):
    return to_typed(load_config(overrides=list(overrides)))


# ---- the schedule and the plan ---------------------------------------------------------------


def test_auto_pipelines_the_disaggregated_placement_and_not_a_shared_gpu():
    tutorial = cfg_of()  # rollout 0, inference 1, actor 2-3
    assert tutorial.pipelined and tutorial.rollout_chunks == 4  # one chunk per minibatch
    colocated = cfg_of(*COLOCATED)
    assert not colocated.pipelined and colocated.rollout_chunks == 1
    # Inference beside the actor (the 2 nodes x 1 GPU benchmark): the rollout's GPU is apart.
    beside = cfg_of("cluster.num_gpus_per_node=1", "cluster.component_placement.actor=1")
    assert beside.pipelined
    assert not cfg_of("runner.pipeline=sequential").pipelined
    assert cfg_of(*COLOCATED, "runner.pipeline=pipelined").pipelined
    assert cfg_of("runner.rollout_chunks=2").rollout_chunks == 2
    # Whole groups, each minibatch within a chunk: gcd of prompts and minibatches.
    assert cfg_of("data.rollout_batch_size=6", "algorithm.group_size=4").rollout_chunks == 2


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("runner.pipeline=on", "runner.pipeline"),
        ("runner.rollout_chunks=0", "runner.rollout_chunks"),
        ("runner.rollout_chunks=3", "runner.rollout_chunks"),  # 8 prompts
        ("runner.rollout_chunks=8", "runner.rollout_chunks"),  # 4 minibatches
    ],
)
def test_bad_schedule_settings_are_refused_by_name(override: str, key: str):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert info.value.key == key


def test_chunk_seeds_depend_on_the_seeds_alone():
    cfg = cfg_of()
    plans = {step: plan_chunks(cfg, step) for step in range(1, 101)}
    assert plan_chunks(cfg, 7) == plans[7]  # no state, no clock
    assert [c.prompts for c in plans[1]] == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    assert all(p[0].seed == cfg.actor.seed + s for s, p in plans.items())  # the one-call seed
    seeds = [c.seed for p in plans.values() for c in p]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**63 for s in seeds)


def test_one_chunk_is_the_sequential_step_the_library_had():
    """One chunk: minibatches cut from the whole step, shuffled by the old seed."""
    for shuffle in (True, False):
        cfg = cfg_of("runner.pipeline=sequential", f"algorithm.shuffle_rollout={shuffle}")
        rows = minibatch_rows(cfg, 3)
        order = torch.arange(16)
        if shuffle:
            gen = torch.Generator().manual_seed(cfg.actor.seed * 1_000_003 + 3)
            order = torch.randperm(16, generator=gen)
        assert [r.tolist() for r in rows] == [order[i : i + 4].tolist() for i in (0, 4, 8, 12)]


@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("shuffle", [True, False])
def test_minibatches_cover_every_answer_once_each_within_one_chunk(chunks: int, shuffle: bool):
    cfg = cfg_of(f"runner.rollout_chunks={chunks}", f"algorithm.shuffle_rollout={shuffle}")
    rows = minibatch_rows(cfg, 5)
    assert len(rows) == 4 and all(len(r) == 4 for r in rows)
    assert sorted(torch.cat(rows).tolist()) == list(range(16))
    per_chunk = 16 // chunks
    for index, minibatch in enumerate(rows):  # in training order: chunk by chunk
        assert set((minibatch // per_chunk).tolist()) == {index // (4 // chunks)}
    assert [r.tolist() for r in rows] == [r.tolist() for r in minibatch_rows(cfg, 5)]
    if shuffle and chunks < 4:  # a chunk's minibatches mix its groups
        assert any(r.tolist() != sorted(r.tolist()) for r in rows)


def test_chunk_advantages_are_the_whole_steps():
    rewards = torch.tensor([5.0, -5, 5, 5, -5, -5, 5, -5])
    mask = torch.ones(8, 3)
    whole = group_advantages(rewards, 2)
    parts = [chunk_advantages(cfg_of(), rewards[i : i + 4], mask[i : i + 4]) for i in (0, 4)]
    torch.testing.assert_close(torch.cat(parts)[:, 0], whole, rtol=0, atol=0)


def _padded(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))


def test_whitening_chunks_of_different_widths_is_whitening_the_repadded_step():
    gen = torch.Generator().manual_seed(0)
    masks = [torch.tensor([[1, 1, 0], [1, 0, 0]]), torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])]
    advs = [torch.randn(m.shape, generator=gen) * m for m in masks]
    (whole,) = normalize_advantages(
        [torch.cat([_padded(a, 5) for a in advs])], [torch.cat([_padded(m, 5) for m in masks])]
    )
    parts = normalize_advantages(advs, masks)
    torch.testing.assert_close(torch.cat([_padded(p, 5) for p in parts]), whole)


def test_a_chunk_padded_wider_gets_the_same_loss_weights():
    """Chunks come back with their own answer widths: padding must not move a loss weight."""
    cfg = cfg_of()
    prompt, ids = 3, torch.randint(5, 50, (4, 7))
    resp = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]])
    batch = SequenceBatch(ids, torch.ones_like(ids), resp, prompt)
    wide = SequenceBatch(_padded(ids, 10), _padded(torch.ones_like(ids), 10), _padded(resp, 7), 3)
    zeros = torch.zeros(4, 4)
    narrow_shards = split_for_actors(cfg, batch, zeros, zeros, ranks=2)
    wide_shards = split_for_actors(cfg, wide, _padded(zeros, 7), _padded(zeros, 7), ranks=2)
    for narrow, padded in zip(narrow_shards, wide_shards):
        for a, b in zip(narrow, padded):
            torch.testing.assert_close(_padded(a.weights, 7), b.weights, rtol=0, atol=0)
            torch.testing.assert_close(_padded(a.metric_weights, 7), b.metric_weights)


def test_per_minibatch_updates_sum_up_as_one_train_step():
    first = dict(final_loss=1.0, ratio_max=1.5, skipped_steps=0.0, lr=1e-3, grad_norm=2.0)
    first.update(logprob_diff_max=0.1, tokens=10.0)  # the diff: measured in the first only
    second = dict(final_loss=3.0, ratio_max=1.2, skipped_steps=1.0, lr=2e-3, grad_norm=math.inf)
    second.update(tokens=10.0)  # an overflow: skipped, its norm not finite

    def call(minibatch: dict[str, float]) -> TrainStats:  # one update, as the actor reports it
        return TrainStats(
            {**step_metrics([minibatch]), "offload_seconds": 0.25}, 10, 2, 0.5, [minibatch]
        )

    merged = TrainStats.merge([call(first), call(second)])
    assert merged.metrics == dict(
        final_loss=2.0,
        ratio_max=1.5,
        logprob_diff_max=0.1,
        skipped_steps=1.0,
        lr=2e-3,
        grad_norm=2.0,  # of the minibatch that stepped
        offload_seconds=0.5,
    )
    assert (merged.trained_tokens, merged.seconds, merged.optimizer_seconds) == (20.0, 4.0, 1.0)
    assert merged.forward_backward_seconds == 3.0
    # One call over both minibatches gives the same metrics.
    del merged.metrics["offload_seconds"]
    assert step_metrics([first, second]) == merged.metrics


# ---- a pipelined run on a 2 x 2 cluster equals the sequential one -----------------------------


class SlowRollout(RolloutWorker):
    """Each rollout call takes 0.5 s longer (counted as generation time), so the overlap the
    test looks for has a wide margin on a busy machine. The answers are unchanged."""

    def generate(self, prompts, seed):  # type: ignore[no-untyped-def]
        time.sleep(0.5)
        rollout = super().generate(prompts, seed)
        rollout.seconds += 0.5
        return rollout


SAME = (
    "rollout/reward_scores",
    "rollout/response_length",
    "rollout/advantages_max",
    "actor/training/actor/final_loss",
    "actor/training/actor/policy_loss",
    "actor/training/actor/grad_norm",
    "actor/training/actor/approx_kl",
    "actor/training/actor/logprob_diff_max",
)


def _run(inputs, tmp_path, run_id: str, overrides: list[str], classes=None):
    common = [
        *ONE_RANK,  # the schedule, not the ranks: the actor on a GPU of its own either way
        "runner.save_interval=-1",
        "actor.optim.lr=1e-3",  # step 2 samples from visibly moved weights
        "algorithm.shuffle_rollout=true",
        "runner.rollout_chunks=4",
    ]
    cfg = demo_config(inputs, tmp_path, run_id, [*common, *overrides])
    handle = run_grpo_two_worker(cfg, component_classes=classes)
    report = handle.result(timeout=600)
    assert report.passed, report.errors
    return [ray.get(handle.step(n), timeout=30) for n in (1, 2)]


def test_pipelined_run_trains_as_the_sequential_run_while_its_stages_overlap(cluster_2x2, tmp_path):
    inputs = make_inputs(tmp_path / "inputs")
    piped = _run(inputs, tmp_path, "piped", [], {"rollout": SlowRollout})  # auto: pipelined
    serial = _run(inputs, tmp_path, "serial", ["runner.pipeline=sequential"])
    for p, s in zip(piped, serial):
        assert (p.metrics["pipeline/pipelined"], s.metrics["pipeline/pipelined"]) == (1.0, 0.0)
        assert p.metrics["pipeline/rollout_chunks"] == s.metrics["pipeline/rollout_chunks"] == 4
        for key in SAME:
            assert p.metrics[key] == pytest.approx(s.metrics[key], rel=1e-5, abs=1e-7), key
        at = s.timings  # sequential: each stage after the previous one
        assert at["time/at/rollout_done"] < at["time/at/first_logprobs_done"]
        assert at["time/at/first_logprobs_done"] < at["time/at/first_update_start"]
    # Pipelined (step 2: step 1's grading also starts the graders' math_verify, seconds): the
    # first chunk was recomputed and the actor was training on it before the rollout had
    # handed back its last chunk.
    at = piped[1].timings
    assert at["time/at/first_logprobs_done"] < at["time/at/rollout_done"]
    assert at["time/at/first_update_start"] < at["time/at/rollout_done"]
    assert at["time/overlap"] > 0
