"""The scale benchmark's case runner on a real cluster (CPU, the demo's tiny model): the two-node
topology (--scale-topology 2gpu) places the components on their nodes, trains, verifies, and
reports the figures per GPU of the job."""

from __future__ import annotations

from support import BENCHMARKS

SCRIPT = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import bench_scale
from rlinf_twoworker.api.demo import make_inputs
root = Path(sys.argv[2])
model = make_inputs(root / "inputs").model_path
case = bench_scale.run_case(
    model, root, "tutorial", 2, limit_s=400, extra=["cluster.accelerator=cpu"], topology="2gpu"
)
keys = (
    "topology", "error", "traceback", "figures_error", "steps_done", "verification_passed",
    "component_pids", "generated_tokens_per_s", "generated_tokens_per_s_per_gpu", "plan_gpus",
    "gpu_peak_gib_by_gpu", "per_step",
)
print(json.dumps({k: case.get(k) for k in keys}, default=str))
"""


def test_a_scale_case_runs_on_two_one_gpu_nodes(tmp_path, own_process):
    case = own_process(SCRIPT, str(BENCHMARKS), str(tmp_path), timeout=480)
    assert case["error"] is None, case["traceback"]
    assert case["figures_error"] is None
    assert case["topology"].startswith("2gpu: 2 node(s) x 1 GPU(s)")
    assert case["steps_done"] == 2 and case["verification_passed"] is True
    assert sorted(case["component_pids"].values()) == [
        "actor:0",
        "inference:0",
        "reward:0",
        "rollout:0",
    ]
    # The memory plan has one GPU a node: the rollout's, then inference's and the actor's.
    assert [g["resource_rank"] for g in case["plan_gpus"]] == [0, 1]
    assert case["generated_tokens_per_s"] > 0
    assert case["generated_tokens_per_s_per_gpu"] == case["generated_tokens_per_s"] / 2
    # Both GPUs are sampled (no nvidia-smi here: no figures, but a key for each).
    assert sorted(case["gpu_peak_gib_by_gpu"]) == ["0", "1"]
    assert [sorted(s["gpu_peak_gib_by_gpu"]) for s in case["per_step"]] == [["0", "1"]] * 2
