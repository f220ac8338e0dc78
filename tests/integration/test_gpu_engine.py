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
cfg = demo_config(inputs, f"{root}/runs", "gpu", [
    "cluster.accelerator=cuda", "cluster.num_nodes=1", "cluster.num_gpus_per_node=1",
    "cluster.component_placement={rollout:0,inference:0,actor:0,reward:0}",
    "rollout.validate_weight=true", "actor.optim.lr=1e-3"])
with LocalCluster(num_nodes=1, gpus_per_node=1) as cluster:
    assert cluster.real_gpus, "LocalCluster did not give its node the GPU"
    handle = run_grpo_two_worker(cfg)
    steps = [ray.get(handle.step(n), timeout=600).metrics for n in (1, 2)]
    report = handle.result(timeout=600)
print("RESULT=" + json.dumps({"passed": report.passed, "errors": report.errors,
                              "verified": [s["sync/verified"] for s in steps]}))
"""


@pytest.mark.gpu
def test_colocated_run_on_one_gpu(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=900
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT=")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT="))
    assert result["passed"], result["errors"]
    assert result["verified"] == [1.0, 1.0]  # bit-exact copies after the IPC sync
