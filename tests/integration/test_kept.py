"""cluster.keep_processes: a run's model processes serve the next run of its placement, which
trains as a fresh run would; a run that does not take them, release_kept() and a failure
free them."""

from __future__ import annotations

import json
import time

import pytest
import ray
from support import KEPT

from rlinf_twoworker import TwoWorkerError, release_kept, run_grpo_two_worker
from rlinf_twoworker.api.demo import demo_config
from rlinf_twoworker.run import kept

TIMEOUT = 300
MODEL_PROCESSES = {"rollout:0", "inference:0", "actor:0", "actor:1"}


def pids(run_dir) -> dict[str, int]:
    record = json.loads((run_dir / "placement.json").read_text())
    return {f"{r['component']}:{r['rank']}": r["pid"] for r in record["processes"]}


def trained(steps) -> list[dict[str, float]]:
    """What training computed at each step: rewards, losses, gradient norms (no timings or
    memory)."""
    return [
        {
            k: v
            for k, v in step.metrics.items()
            if k.startswith(("actor/", "rollout/", "reward/"))
            and not any(word in k for word in ("time", "memory", "per_s", "seconds"))
        }
        for step in steps
    ]


def run(inputs, root, name, overrides):
    handle = run_grpo_two_worker(demo_config(inputs, root, name, overrides))
    steps = [ray.get(handle.step(n), timeout=TIMEOUT) for n in (1, 2)]
    report = handle.result(timeout=TIMEOUT)
    assert report.passed, report.errors
    return steps, root / name


def free_gpus(timeout_s: float = 10.0) -> float:
    """The cluster's free GPUs, once killed processes have given theirs back."""
    total = ray.cluster_resources().get("GPU", 0)
    deadline = time.monotonic() + timeout_s
    while (free := ray.available_resources().get("GPU", 0)) < total and time.monotonic() < deadline:
        time.sleep(0.1)
    return free


def test_a_run_in_kept_processes_trains_as_a_fresh_run(cluster_2x2, finished_inputs, tmp_path):
    lr = ["actor.optim.lr=1e-3"]  # the weights move: step 2 reads what step 1 trained
    _, first = run(finished_inputs, tmp_path, "first", [*KEPT, *lr])
    assert "KEPT_PROCESSES 4 processes" in (first / "log" / "main.log").read_text()
    assert len(kept._kept_groups()) == 1 and free_gpus(1.0) == 0  # held, idle, for the next
    steps, second = run(finished_inputs, tmp_path, "second", [*KEPT, *lr])
    log = (second / "log" / "main.log").read_text()
    assert "with 4 kept processes" in log
    # The model components ran in the first run's processes; the reward is made per run.
    before, now = pids(first), pids(second)
    assert {k: now[k] for k in MODEL_PROCESSES} == {k: before[k] for k in MODEL_PROCESSES}
    assert now["reward:0"] != before["reward:0"]
    # A run that does not keep frees them as it starts, and trains as the kept run did.
    fresh_steps, fresh = run(finished_inputs, tmp_path, "fresh", lr)
    assert not set(pids(fresh).values()) & set(now.values())
    assert trained(steps) == trained(fresh_steps)
    assert trained(steps)[0]["actor/training/actor/grad_norm"] > 0  # real updates
    assert kept._kept_groups() == [] and free_gpus() == ray.cluster_resources()["GPU"]


def test_release_kept_frees_them_and_a_failed_run_keeps_nothing(cluster_2x2, demo_inputs, tmp_path):
    run(demo_inputs, tmp_path, "kept", KEPT)
    assert len(kept._kept_groups()) == 1
    assert release_kept() == 1
    assert kept._kept_groups() == [] and free_gpus() == ray.cluster_resources()["GPU"]
    # A run that fails (its first step's timeout) kills its processes and removes its group.
    run(demo_inputs, tmp_path, "kept-again", KEPT)
    handle = run_grpo_two_worker(
        demo_config(demo_inputs, tmp_path, "failing", [*KEPT, "runner.timeouts.step_s=0.001"])
    )
    with pytest.raises(Exception, match="did not finish within"):
        handle.result(timeout=TIMEOUT)
    assert kept._kept_groups() == [] and free_gpus() == ray.cluster_resources()["GPU"]
    # The caller's placement group is never kept: asking for both is refused by name.
    with pytest.raises(TwoWorkerError, match="cluster.keep_processes=true keeps"):
        run_grpo_two_worker(
            demo_config(demo_inputs, tmp_path, "callers", KEPT), placement_group="current"
        )
