"""runner.compile_warm_up in a whole run: every log-prob component and both actor ranks warm
up beside step 1's rollout, main.log and the first StepResult record it, and the run trains
as it does without it."""

from __future__ import annotations

import pytest
import ray
import torch
from support import REFERENCE_SETTINGS

from rlinf_twoworker import run_grpo_two_worker
from rlinf_twoworker.api.demo import demo_config
from rlinf_twoworker.config import to_typed
from rlinf_twoworker.storage.readback import load_dcp

TIMEOUT = 300
SAME_METRICS = (
    "rollout/reward_scores",
    "rollout/response_length",
    "actor/training/actor/final_loss",
    "actor/training/actor/grad_norm",
    "actor/training/actor/approx_kl",
)


@pytest.mark.slow
def test_the_warm_up_runs_beside_step_1_and_changes_no_training(
    reference_run, finished_inputs, tmp_path
):
    """The session's reference run (no warm-up: the default on CPUs) against the same run
    with the warm-up."""
    assert reference_run.report.passed, reference_run.report.errors
    plain_dir, plain = reference_run.run_dir, reference_run.steps
    assert not to_typed(reference_run.cfg).warms_up
    cfg = demo_config(
        finished_inputs, tmp_path, "warmed", [*REFERENCE_SETTINGS, "runner.compile_warm_up=true"]
    )
    handle = run_grpo_two_worker(cfg)
    report = handle.result(timeout=TIMEOUT)
    assert report.passed, report.errors
    warmed_dir, warmed = handle.output_dir, [ray.get(handle.step(n), timeout=30) for n in (1, 2)]

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
