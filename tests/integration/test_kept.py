"""cluster.keep_processes: a run's model processes serve the next run of its placement, which
trains as a fresh run would; a run that does not take them, release_kept() and a failure
free them."""

from __future__ import annotations

import json
import time

import pytest
import ray
from support import KEPT, settled_free_gpus

from rlinf_twoworker import TwoWorkerError, release_kept, run_grpo_two_worker
from rlinf_twoworker.api.demo import demo_config
from rlinf_twoworker.api.tune import trial_resources
from rlinf_twoworker.config import to_yaml
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


def test_a_run_in_kept_processes_trains_as_a_fresh_run(cluster_2x2, finished_inputs, tmp_path):
    lr = ["actor.optim.lr=1e-3"]  # the weights move: step 2 reads what step 1 trained
    first_steps, first = run(finished_inputs, tmp_path, "first", [*KEPT, *lr])
    assert "KEPT_PROCESSES 4 processes" in (first / "log" / "main.log").read_text()
    assert len(kept._kept_groups()) == 1 and settled_free_gpus(1.0) == 0  # held, idle, for the next
    steps, second = run(finished_inputs, tmp_path, "second", [*KEPT, *lr])
    assert "with 4 kept processes" in (second / "log" / "main.log").read_text()
    # The model components ran in the first run's processes; the reward is made per run.
    before, now = pids(first), pids(second)
    assert {k: now[k] for k in MODEL_PROCESSES} == {k: before[k] for k in MODEL_PROCESSES}
    assert now["reward:0"] != before["reward:0"]
    # ... and trained as the first run did in its fresh processes.
    assert trained(steps) == trained(first_steps)
    assert trained(steps)[0]["actor/training/actor/grad_norm"] > 0  # real updates
    # A run that does not keep frees them as it starts: its processes are new, and after it
    # every GPU is free.
    fresh_steps, fresh = run(finished_inputs, tmp_path, "fresh", lr)
    assert not set(pids(fresh).values()) & set(now.values())
    assert trained(fresh_steps) == trained(steps)
    assert kept._kept_groups() == [] and settled_free_gpus() == ray.cluster_resources()["GPU"]


DRIVER = """
import json, sys
from rlinf_twoworker import run_grpo_two_worker
from rlinf_twoworker.config import load_config

handle = run_grpo_two_worker(load_config(sys.argv[1]), ray_address=sys.argv[2])
print(json.dumps(handle.result(timeout=300).passed))
"""


def test_kept_processes_end_with_their_driver_release_kept_or_a_failure(
    cluster_2x2, demo_inputs, tmp_path, own_process
):
    # A Driver (a notebook's kernel, say) keeps its run's processes and exits: they and their
    # group go with its job, and the cluster's GPUs are free again.
    config = tmp_path / "config.yaml"
    config.write_text(to_yaml(demo_config(demo_inputs, tmp_path / "runs", "driver", KEPT)))
    assert own_process(DRIVER, str(config), cluster_2x2.address, timeout=TIMEOUT) is True
    assert "KEPT_PROCESSES 4 processes" in (tmp_path / "runs/driver/log/main.log").read_text()
    deadline = time.monotonic() + 30
    while kept._kept_groups() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert kept._kept_groups() == [] and settled_free_gpus() == ray.cluster_resources()["GPU"]
    # A Tune sweep's set-up frees idle kept processes (release_kept(): its trials' groups are
    # Tune's and would wait behind the kept GPUs); then nothing is left to release.
    run(demo_inputs, tmp_path, "kept", KEPT)
    assert len(kept._kept_groups()) == 1
    trial_resources(demo_config(demo_inputs, tmp_path, "sweep", []))
    assert kept._kept_groups() == [] and settled_free_gpus() == ray.cluster_resources()["GPU"]
    assert release_kept() == 0
    # A run that fails (its first step's timeout) kills its processes, kept or not, and
    # removes its group.
    handle = run_grpo_two_worker(
        demo_config(demo_inputs, tmp_path, "failing", [*KEPT, "runner.timeouts.step_s=0.001"])
    )
    with pytest.raises(Exception, match="did not finish within"):
        handle.result(timeout=TIMEOUT)
    assert kept._kept_groups() == [] and settled_free_gpus() == ray.cluster_resources()["GPU"]
    # The caller's placement group is never kept: asking for both is refused by name.
    with pytest.raises(TwoWorkerError, match="cluster.keep_processes=true keeps"):
        run_grpo_two_worker(
            demo_config(demo_inputs, tmp_path, "callers", KEPT), placement_group="current"
        )


def test_release_kept_without_a_cluster_frees_nothing_and_starts_no_ray(own_process):
    """In a process not connected to Ray (a unit test module's end, trial_resources before a
    cluster exists): release_kept answers 0 and leaves Ray unstarted, where Ray's own calls
    would start a local instance to ask."""
    script = (
        "import json, ray\n"
        "from rlinf_twoworker import release_kept\n"
        "print(json.dumps([release_kept(), ray.is_initialized()]))\n"
    )
    assert own_process(script, timeout=120) == [0, False]
