"""The whole job on a real GPU: every component colocated on one GPU (weights through CUDA IPC)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, sys, ray
from rlinf_twoworker.api.demo import demo_config, make_inputs
from rlinf_twoworker.api.handle import run_grpo_two_worker
from rlinf_twoworker.cluster.local import LocalCluster

root = sys.argv[1]
inputs = make_inputs(f"{root}/inputs", task="digit7")
common = [
    "cluster.accelerator=cuda", "cluster.num_nodes=1", "cluster.num_gpus_per_node=1",
    "cluster.component_placement={rollout:0,inference:0,actor:0,reward:0}",
    "rollout.validate_weight=true", "actor.optim.lr=1e-3"]
keep = ["cluster.keep_processes=true"]
results = {}
with LocalCluster(num_nodes=1, gpus_per_node=1) as cluster:
    assert cluster.real_gpus, "LocalCluster did not give its node the GPU"
    # The run, the same run in its kept processes, and the same run in fresh ones.
    for name, overrides in [("gpu", keep), ("kept", keep), ("fresh", [])]:
        handle = run_grpo_two_worker(demo_config(inputs, f"{root}/runs", name, common + overrides))
        steps = [ray.get(handle.step(n), timeout=600) for n in (1, 2)]
        report = handle.result(timeout=600)
        results[name] = {
            "passed": report.passed, "errors": report.errors,
            "verified": [s.metrics["sync/verified"] for s in steps],
            "trained": [{k: v for k, v in s.metrics.items()
                         if k.startswith(("rollout/reward", "actor/training/actor/"))}
                        for s in steps],
            "pids": {f"{p['component']}:{p['rank']}": p["pid"] for p in json.load(
                open(f"{root}/runs/{name}/placement.json"))["processes"]},
            "to_first_step_s": steps[0].startup.get("to_first_step"),
        }
print("RESULT=" + json.dumps(results))
"""


@pytest.mark.gpu
def test_colocated_run_on_one_gpu_and_again_in_its_kept_processes(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=900
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT=")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(lines[-1].removeprefix("RESULT="))
    for name, result in results.items():
        assert result["passed"], (name, result["errors"])
        assert result["verified"] == [1.0, 1.0], name  # bit-exact copies after the IPC sync
    # The second run ran in the first one's model processes (cluster.keep_processes) and
    # trained exactly as a run in fresh processes.
    first, kept, fresh = results["gpu"]["pids"], results["kept"]["pids"], results["fresh"]["pids"]
    models = ["rollout:0", "inference:0", "actor:0"]
    assert [kept[m] for m in models] == [first[m] for m in models]
    assert not set(fresh.values()) & set(kept.values())
    assert results["kept"]["trained"] == results["fresh"]["trained"]
    print({name: result["to_first_step_s"] for name, result in results.items()})
