"""Resume: 2 steps + 2 resumed steps reach the weights of 4 unbroken steps, and `auto` never
takes an incomplete checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray
import torch
from support import KEPT

from rlinf_twoworker import TwoWorkerError, run_grpo_two_worker
from rlinf_twoworker.api.demo import DemoInputs, demo_config, make_inputs
from rlinf_twoworker.api.report import load_scalars
from rlinf_twoworker.config import to_typed, to_yaml
from rlinf_twoworker.results import StepResult
from rlinf_twoworker.storage.checkpoints import resume_source
from rlinf_twoworker.storage.lineage import LINEAGE_JSON
from rlinf_twoworker.storage.readback import load_dcp

TIMEOUT = 300
# lr high enough that 2 steps move the weights far beyond the tolerance; warm-up over all 16
# optimiser steps (4 GRPO steps x 4 minibatches) so a lost lr schedule changes steps 3 and 4.
SETTINGS = [
    *KEPT,  # the three runs, one after another, in the first one's processes
    "actor.optim.lr=1e-3",
    "actor.lr_sched.lr_warmup_iters=16",
    "rollout.validate_weight=true",
    "runner.save_interval=2",
]
SAME_METRICS = (
    "rollout/reward_scores",
    "rollout/correct_fraction",
    "rollout/response_length",
    "actor/training/actor/final_loss",
    "actor/training/actor/grad_norm",
    "actor/training/actor/lr",
    "actor/training/actor/approx_kl",
    "actor/training/actor/clip_fraction",
)


def dcp_dir(run_dir: Path, step: int) -> Path:
    return run_dir / f"checkpoints/global_step_{step}/actor/dcp_checkpoint"


@dataclass
class Runs:
    unbroken: Path
    first_half: Path
    resumed: Path
    unbroken_steps: list[StepResult]
    resumed_steps: list[StepResult]
    resumed_checkpoint_2: str
    inputs: DemoInputs


def finish(cfg) -> tuple[Path, list[StepResult], object]:
    handle = run_grpo_two_worker(cfg)
    report = handle.result(timeout=TIMEOUT)
    assert report.passed, report.errors
    steps = [ray.get(handle.step(n), timeout=30) for n in range(1, cfg.runner.max_steps + 1)]
    return handle.output_dir, steps, handle


def plant_decoys(output_root: Path, first_half: Path) -> None:
    """What `auto` must pass over: a staging directory newer than every complete checkpoint,
    and a newer run whose newest checkpoint lacks .metadata."""
    complete = first_half / "checkpoints" / "global_step_2"
    shutil.copytree(complete, first_half / "checkpoints" / ".global_step_3.incomplete")
    broken = output_root / "zz-crashed" / "checkpoints" / "global_step_3"
    shutil.copytree(complete, broken)
    (broken / "actor" / "dcp_checkpoint" / ".metadata").unlink()


@pytest.fixture(scope="module")
def runs(cluster_2x2, tmp_path_factory) -> Runs:
    inputs = make_inputs(tmp_path_factory.mktemp("inputs"), task="digit7")
    unbroken_root, resume_root = tmp_path_factory.mktemp("unbroken"), tmp_path_factory.mktemp("r")
    unbroken, unbroken_steps, _ = finish(
        demo_config(inputs, unbroken_root, "four", [*SETTINGS, "runner.max_steps=4"])
    )
    first_half, _, _ = finish(demo_config(inputs, resume_root, "two", SETTINGS))
    plant_decoys(resume_root, first_half)
    resumed_cfg = demo_config(
        inputs, resume_root, "two-more", [*SETTINGS, "runner.max_steps=4", "runner.resume_dir=auto"]
    )
    resumed, resumed_steps, handle = finish(resumed_cfg)
    inherited = ray.get(handle.checkpoint(2), timeout=30).directory
    return Runs(unbroken, first_half, resumed, unbroken_steps, resumed_steps, inherited, inputs)


@pytest.mark.slow
def test_resumed_run_reaches_the_unbroken_runs_weights(runs):
    unbroken = load_dcp(dcp_dir(runs.unbroken, 4))
    resumed = load_dcp(dcp_dir(runs.resumed, 4))
    assert unbroken.keys() == resumed.keys()
    tensors = [k for k, v in unbroken.items() if isinstance(v, torch.Tensor)]
    model = [k for k in tensors if k.startswith("fsdp_checkpoint.model.")]
    assert len(model) == 27 and any(".exp_avg_sq" in k for k in tensors)
    for key in tensors:  # model, optimiser moments and steps, RNG
        torch.testing.assert_close(resumed[key], unbroken[key], rtol=1e-5, atol=1e-7, msg=key)
    scheduler = [k for k in unbroken if k.startswith("fsdp_checkpoint.lr_schedulers.")]
    assert all(resumed[k] == unbroken[k] for k in scheduler)
    # The comparison means something: steps 3 and 4 moved the weights far beyond the tolerance.
    halfway = load_dcp(dcp_dir(runs.first_half, 2), model)
    assert max((unbroken[k] - halfway[k]).abs().max().item() for k in model) > 1e-3


@pytest.mark.slow
def test_resumed_steps_sample_and_train_like_the_unbroken_steps(runs):
    """Same prompts, same samples (seeded by step, from weights synced off the restored actor,
    checked bit for bit by rollout.validate_weight), same update."""
    for unbroken, resumed in zip(runs.unbroken_steps[2:], runs.resumed_steps[2:], strict=True):
        assert resumed.step == unbroken.step
        assert resumed.metrics["sync/verified"] == 1.0
        for tag in SAME_METRICS:
            assert resumed.metrics[tag] == pytest.approx(unbroken.metrics[tag], rel=1e-5), tag
    assert [s.metrics for s in runs.resumed_steps[:2]] == [{}, {}]  # done by the earlier run
    assert sorted(load_scalars(runs.resumed)["rollout/reward_scores"]) == [3, 4]


@pytest.mark.slow
def test_auto_resume_records_its_source_and_skips_the_decoys(runs):
    source = runs.first_half / "checkpoints" / "global_step_2"
    record = json.loads((runs.resumed / "resumed_from.json").read_text())
    assert record["checkpoint"] == str(source) and record["step"] == 2
    assert record["run_id"] == "two" and record["resume_dir"] == "auto"
    driver = (runs.resumed / "driver.log").read_text()
    assert f"RESUMED_FROM={source} step=2" in driver
    assert runs.resumed_checkpoint_2 == str(source)


def copy_checkpoint(source: Path, run_dir: Path, step: int, mtime: float) -> Path:
    """A copy of a complete checkpoint in a run of the first half's lineage."""
    target = shutil.copytree(source, run_dir / "checkpoints" / f"global_step_{step}")
    os.utime(target / "actor" / "dcp_checkpoint" / ".metadata", (mtime, mtime))
    lineage = source.parent.parent / LINEAGE_JSON
    if not (run_dir / LINEAGE_JSON).exists():
        shutil.copy(lineage, run_dir / LINEAGE_JSON)
    return target


@pytest.mark.slow
def test_auto_takes_the_newest_complete_checkpoint_only(runs, tmp_path):
    complete = runs.first_half / "checkpoints" / "global_step_2"
    cfg = to_typed(demo_config(runs.inputs, tmp_path, "new", SETTINGS))
    cfg.runner.resume_dir = "auto"
    old = copy_checkpoint(complete, tmp_path / "old", 2, 1_000)
    newer = copy_checkpoint(complete, tmp_path / "newer", 2, 2_000)
    # Newest of all, but not complete: no .metadata, a truncated shard, a staging name.
    no_metadata = copy_checkpoint(complete, tmp_path / "newer", 4, 3_000)
    (no_metadata / "actor" / "dcp_checkpoint" / ".metadata").unlink()
    truncated = copy_checkpoint(complete, tmp_path / "truncated", 4, 4_000)
    os.truncate(truncated / "actor" / "dcp_checkpoint" / "__1_0.distcp", 100)
    shutil.copytree(complete, tmp_path / "staged" / "checkpoints" / ".global_step_6.incomplete")
    assert resume_source(cfg, tmp_path / "new") == newer
    shutil.rmtree(newer)
    assert resume_source(cfg, tmp_path / "new") == old
    cfg.runner.resume_dir = str(no_metadata)
    with pytest.raises(TwoWorkerError, match=r"\.metadata is missing"):
        resume_source(cfg, tmp_path / "new")
    shutil.rmtree(old)
    cfg.runner.resume_dir = "auto"
    with pytest.raises(TwoWorkerError, match="of this run's lineage with a complete checkpoint"):
        resume_source(cfg, tmp_path / "new")


def test_cli_rejects_a_resume_without_a_checkpoint_before_connecting(tmp_path):
    inputs = make_inputs(tmp_path / "inputs")
    config = tmp_path / "run.yaml"
    config.write_text(to_yaml(demo_config(inputs, tmp_path / "unused", "template")))
    (tmp_path / "work").mkdir()
    (tmp_path / "empty-run").mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{s.getsockname()[1]}"
    env = dict(os.environ, RAY_ADDRESS=nowhere, WORK_ROOT=str(tmp_path / "work"))
    env.update(RUN_ID="again", TARGET_STEPS="4")
    done = subprocess.run(
        [sys.executable, "-m", "rlinf_twoworker.api.cli", "run", "--config", str(config)]
        + [f"runner.resume_dir={tmp_path / 'empty-run'}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "no complete checkpoint there" in done.stderr
    assert list((tmp_path / "work").iterdir()) == []
