"""runner.compile_warm_up in a whole run: every log-prob component and both actor ranks warm
up beside step 1's rollout, main.log and the first StepResult record it, and the run trains
as it does without it."""

from __future__ import annotations

import pytest
import ray
import torch

from rlinf_twoworker import run_grpo_two_worker
from rlinf_twoworker.api.demo import demo_config, make_inputs
from rlinf_twoworker.storage.readback import load_dcp

TIMEOUT = 300
SETTINGS = ["actor.optim.lr=1e-3", "rollout.validate_weight=true"]
SAME_METRICS = (
    "rollout/reward_scores",
    "rollout/response_length",
    "actor/training/actor/final_loss",
    "actor/training/actor/grad_norm",
    "actor/training/actor/approx_kl",
)


def run(inputs, root, run_id: str, warm_up: bool):
    cfg = demo_config(
        inputs, root, run_id, [*SETTINGS, f"runner.compile_warm_up={str(warm_up).lower()}"]
    )
    handle = run_grpo_two_worker(cfg)
    report = handle.result(timeout=TIMEOUT)
    assert report.passed, report.errors
    steps = [ray.get(handle.step(n), timeout=30) for n in (1, 2)]
    return handle.output_dir, steps


@pytest.mark.slow
def test_the_warm_up_runs_beside_step_1_and_changes_no_training(cluster_2x2, tmp_path):
    inputs = make_inputs(tmp_path / "inputs", task="digit7")
    plain_dir, plain = run(inputs, tmp_path, "plain", warm_up=False)
    warmed_dir, warmed = run(inputs, tmp_path, "warmed", warm_up=True)

    phases = {"warm_up/inference:0", "warm_up/actor:0", "warm_up/actor:1"}
    assert phases <= set(warmed[0].startup), warmed[0].startup
    assert all(warmed[0].startup[p] > 0 for p in phases)
    assert not any(p.startswith("warm_up/") for p in plain[0].startup)
    log = (warmed_dir / "log" / "main.log").read_text()
    for phase in phases:
        assert f"STARTUP {phase} " in log, phase
    assert "WARM_UP" not in log  # neither skipped nor failed

    for before, after in zip(plain, warmed, strict=True):
        assert after.metrics["sync/verified"] == 1.0
        for tag in SAME_METRICS:
            assert after.metrics[tag] == pytest.approx(before.metrics[tag], rel=1e-5), tag
    dcp = "checkpoints/global_step_2/actor/dcp_checkpoint"
    expected, got = load_dcp(plain_dir / dcp), load_dcp(warmed_dir / dcp)
    tensors = [k for k, v in expected.items() if isinstance(v, torch.Tensor)]
    assert any(".exp_avg_sq" in k for k in tensors)
    for key in tensors:  # weights, optimiser moments and steps, RNG
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-7, msg=key)
