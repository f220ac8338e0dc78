"""Ray Tune: two trials at once on one real 2-node cluster, each a GRPO run inside its trial's
placement group (2 nodes x 1 GPU), each verified, each in its own run directory; the trial's
parameters are config overrides, checked by name. A trial that fails is retried by Tune from its
last checkpoint, which Tune holds as a pointer to the run's own checkpoint, in a new run
directory that names its parent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import ray
from support import EXAMPLES

tune = pytest.importorskip("ray.tune", reason="the [tune] extra is not installed")

from omegaconf import OmegaConf  # noqa: E402

from rlinf_twoworker.api.demo import demo_config, make_inputs  # noqa: E402
from rlinf_twoworker.api.tune import (  # noqa: E402
    POINTER_JSON,
    TRIAL_JSON,
    attempt_config,
    grpo_trainable,
    read_pointer,
    trial_config,
    trial_resources,
)
from rlinf_twoworker.errors import ConfigError, TwoWorkerError  # noqa: E402
from rlinf_twoworker.workers.actor import ActorWorker  # noqa: E402

# The injected actor travels by value inside the trainable: the workers cannot import this module.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
FAILED_ONCE = Path(tempfile.mkdtemp(prefix="rlinf-tune-")) / "actor-failed-at-step-2"

ONE_GPU_A_NODE = [
    "cluster.num_nodes=2",
    "cluster.num_gpus_per_node=1",
    "cluster.component_placement={rollout:0,reward:0,inference:0,actor:1}",
]


def test_trial_resources_and_config_follow_the_run(tmp_path):
    inputs = make_inputs(tmp_path / "inputs")
    cfg = demo_config(inputs, tmp_path, "sweep", ONE_GPU_A_NODE)
    factory = trial_resources(cfg)
    assert factory.head_bundle_is_empty and factory.strategy == "STRICT_SPREAD"
    assert factory.bundles == [{"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]
    run = trial_config(cfg, {"actor.optim.lr": 3e-4, "algorithm.group_size": 4}, "abc_00001")
    assert run.actor.optim.lr == 3e-4 and run.algorithm.group_size == 4
    assert run.runner.experiment_name == "sweep-abc_00001"
    assert cfg.actor.optim.lr != 3e-4 and cfg.runner.experiment_name == "sweep"  # untouched
    with pytest.raises(ConfigError, match="actor.optim.learning_rate"):
        trial_config(cfg, {"actor.optim.learning_rate": 1e-4}, "abc_00002")
    with pytest.raises(ConfigError, match="actor.optim.lr"):
        trial_config(cfg, {"actor.optim.lr": -1.0}, "abc_00003")


@pytest.mark.slow
def test_the_sweep_example_runs_two_trials_at_once_each_in_its_group(cluster_2x2, tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "tune_sweep.py"),
            "--demo",
            "--address",
            cluster_2x2.address,
            "--output-root",
            str(tmp_path),
            "--run-id",
            "sweep",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env={**os.environ, "RAY_AIR_NEW_OUTPUT": "0"},
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    trials = [line for line in done.stdout.splitlines() if line.startswith("TUNE_TRIAL ")]
    assert len(trials) == 2, done.stdout[-3000:]
    for line in trials:
        assert "steps=2" in line and "verified=True" in line and "error=None" in line, line
        assert "checkpoint=None" not in line, line  # the step-2 checkpoint reached Tune
    best = next(line for line in done.stdout.splitlines() if line.startswith("TUNE_BEST "))
    assert best.split()[1] in {"lr=0.001", "lr=0.0001"}

    runs = sorted(p for p in tmp_path.iterdir() if p.name.startswith("sweep-"))
    assert len(runs) == 2, [p.name for p in tmp_path.iterdir()]
    lrs, groups, spans = set(), set(), []
    for run in runs:
        report = json.loads((run / "verification.json").read_text())
        assert report["passed"], report["errors"]
        lrs.add(OmegaConf.load(run / "hydra/.hydra/config.yaml").actor.optim.lr)
        log = (run / "log" / "main.log").read_text()
        assert "PLACEMENT_GROUP the caller's" in log  # the trial's group, not one of its own
        groups.add(next(x for x in log.splitlines() if "PLACEMENT_GROUP" in x).split()[-3])
        assert run.name in log and all(other.name not in log for other in runs if other != run)
        spans.append(((run / "preflight.json").stat().st_mtime, report_mtime(run)))
    assert lrs == {1e-3, 1e-4} and len(groups) == 2
    (start_a, end_a), (start_b, end_b) = spans
    assert max(start_a, start_b) < min(end_a, end_b), spans  # the two runs overlapped


def report_mtime(run: Path) -> float:
    return (run / "verification.json").stat().st_mtime


class FailingOnceActor(ActorWorker):
    """Raises in step 2's update (counted in minibatches: a pipelined step calls train_step once
    a minibatch), once: the marker file lets the retried trial's run get past it."""

    def train_step(self, shards):
        self.minibatches = getattr(self, "minibatches", 0) + len(shards)
        if self.minibatches > self.settings.algorithm.n_minibatches and not FAILED_ONCE.exists():
            FAILED_ONCE.touch()
            raise RuntimeError("injected failure in step 2's update (first attempt only)")
        return super().train_step(shards)


def test_attempts_get_new_run_dirs_and_a_pointer_must_name_a_complete_checkpoint(tmp_path):
    inputs = make_inputs(tmp_path / "inputs")
    cfg = trial_config(demo_config(inputs, tmp_path, "sweep", ONE_GPU_A_NODE), {}, "t_00000")
    first, attempt = attempt_config(cfg, None)
    assert (first.runner.experiment_name, attempt, first.runner.resume_dir) == (
        "sweep-t_00000",
        0,
        None,
    )
    (tmp_path / "sweep-t_00000").mkdir()
    (tmp_path / "sweep-t_00000-r1").mkdir()
    again, attempt = attempt_config(cfg, None)  # a retry before any checkpoint: afresh, anew
    assert (again.runner.experiment_name, attempt) == ("sweep-t_00000-r2", 2)
    gone = tmp_path / "sweep-t_00000" / "checkpoints" / "global_step_1"
    pointer = {
        "checkpoint": str(gone),
        "run_dir": str(gone.parent.parent),
        "run_id": "x",
        "step": 1,
    }
    with pytest.raises(
        TwoWorkerError, match="step 1, which cannot be resumed from.*does not exist"
    ):
        attempt_config(cfg, pointer)

    assert read_pointer(None) is None
    (tmp_path / "foreign").mkdir()
    with pytest.raises(TwoWorkerError, match=f"has no {POINTER_JSON}"):
        read_pointer(tune.Checkpoint.from_directory(str(tmp_path / "foreign")))
    (tmp_path / "foreign" / POINTER_JSON).write_text(json.dumps({"checkpoint": str(gone)}))
    with pytest.raises(TwoWorkerError, match="lacks"):
        read_pointer(tune.Checkpoint.from_directory(str(tmp_path / "foreign")))


@pytest.mark.slow
def test_a_failed_trial_is_retried_from_its_checkpoint_held_by_reference(cluster_2x2, tmp_path):
    inputs = make_inputs(tmp_path / "inputs")
    runs = tmp_path / "runs"
    steps = ["runner.max_steps=3", "runner.save_interval=1"]
    cfg = demo_config(inputs, runs, "retry", [*ONE_GPU_A_NODE, *steps])
    trainable = grpo_trainable(cfg, component_classes={"actor": FailingOnceActor})
    tuner = tune.Tuner(
        tune.with_resources(trainable, trial_resources(cfg)),
        run_config=tune.RunConfig(
            storage_path=str(tmp_path / "tune"),
            name="retry",
            verbose=0,
            failure_config=tune.FailureConfig(max_failures=1),
        ),
    )
    (result,) = tuner.fit()
    assert FAILED_ONCE.exists()  # the first attempt did fail
    assert result.error is None, result.error
    assert result.metrics["step"] == 3 and result.metrics["verification_passed"] is True
    assert result.metrics["training_iteration"] == 3  # one report a step, none repeated
    assert result.metrics["rollout/reward_scores"] is not None

    first, retried = sorted(p for p in runs.iterdir() if p.name.startswith("retry-"))
    assert retried.name == f"{first.name}-r1"
    assert json.loads((first / "failure.json").read_text())["step"] == 2
    resumed = json.loads((retried / "resumed_from.json").read_text())
    assert resumed["run_dir"] == str(first) and resumed["step"] == 1
    assert resumed["checkpoint"] == str(first / "checkpoints" / "global_step_1")
    trial = json.loads((retried / TRIAL_JSON).read_text())
    assert trial["attempt"] == 1 and trial["trial_id"] == result.metrics["trial_id"]
    assert trial["parent"]["run_dir"] == str(first) and trial["parent"]["step"] == 1
    assert json.loads((first / TRIAL_JSON).read_text())["parent"] is None
    assert json.loads((retried / "verification.json").read_text())["passed"]

    # Tune holds a pointer to the run's own checkpoint, not a copy of its shards.
    stored = Path(result.checkpoint.path)
    assert sorted(p.name for p in stored.iterdir()) == [POINTER_JSON]
    assert (stored / POINTER_JSON).stat().st_size < 1024
    pointer = json.loads((stored / POINTER_JSON).read_text())
    assert pointer["checkpoint"] == str(retried / "checkpoints" / "global_step_3")
    assert pointer["run_dir"] == str(retried) and pointer["step"] == 3
    assert not list((tmp_path / "tune").rglob("*.distcp"))
    assert not list((tmp_path / "tune").rglob("data.pt"))
