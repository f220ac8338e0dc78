"""Endurance: a long CPU run on the 2-node cluster must not leak memory, open files or threads.

The Driver (this process), the controller and every component process are measured with
psutil after warm-up (step 5) and again at step 50, right after the step-50 checkpoint; the run
goes on to step 55 so every process is still alive at the second sample.
"""

from __future__ import annotations

import os
import sys

import pytest
import ray

from rlinf_twoworker import run_grpo_two_worker
from rlinf_twoworker.api.demo import demo_config, make_inputs
from rlinf_twoworker.storage.rundir import complete_checkpoint_steps

STEPS = 55
MIB = 1024 * 1024
# Growth allowed from the step-5 sample to the step-50 sample, per process. A leak of one
# batch's tensors (or one open shard file, one thread) a step would pass these many times over.
RSS_GROWTH = 96 * MIB
FD_GROWTH = 8
THREAD_GROWTH = 4


def usage(pid: int) -> dict[str, int]:
    import psutil  # Ray ships psutil and puts it on the path once ray is imported

    process = psutil.Process(pid)
    return {
        "rss": process.memory_info().rss,
        "fds": process.num_fds(),
        "threads": process.num_threads(),
    }


def sample(pids: dict[str, int]) -> dict[str, dict[str, int]]:
    return {name: usage(pid) for name, pid in pids.items()}


@pytest.mark.slow
def test_fifty_steps_grow_no_memory_files_or_threads(cluster_2x2, tmp_path):
    inputs = make_inputs(tmp_path / "inputs")
    cfg = demo_config(
        inputs,
        tmp_path / "out",
        "endurance",
        [
            f"runner.max_steps={STEPS}",
            "runner.save_interval=10",
            "runner.keep_last_checkpoints=2",
        ],
    )
    handle = run_grpo_two_worker(cfg)
    ray.get(handle.step(5), timeout=300)
    pids = {f"{r['component']}:{r['rank']}": r["pid"] for r in handle.topology()}
    pids["controller"] = handle.status()["controller_pid"]
    pids["driver"] = os.getpid()
    early = sample(pids)
    ray.get(handle.checkpoint(50), timeout=600)
    late = sample(pids)
    report = handle.result(timeout=300)
    assert report.passed, report.errors

    table = "\n".join(
        f"{name:12s} rss {early[name]['rss'] / MIB:7.1f} -> {late[name]['rss'] / MIB:7.1f} MiB  "
        f"fds {early[name]['fds']:4d} -> {late[name]['fds']:4d}  "
        f"threads {early[name]['threads']:3d} -> {late[name]['threads']:3d}"
        for name in pids
    )
    print(f"\nstep 5 -> step 50\n{table}", file=sys.stderr)
    for name in pids:
        before, after = early[name], late[name]
        assert after["rss"] - before["rss"] < RSS_GROWTH, f"{name} memory grew\n{table}"
        assert after["fds"] - before["fds"] <= FD_GROWTH, f"{name} open files grew\n{table}"
        assert after["threads"] - before["threads"] <= THREAD_GROWTH, f"{name} threads\n{table}"
    run_dir = tmp_path / "out" / "endurance"
    assert complete_checkpoint_steps(run_dir) == [50, 55]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
