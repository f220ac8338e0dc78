"""Ray Tune: two trials at once on one real 2-node cluster, each a GRPO run inside its trial's
placement group (2 nodes x 1 GPU), each verified, each in its own run directory; the trial's
parameters are config overrides, checked by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray.tune", reason="the [tune] extra is not installed")

from omegaconf import OmegaConf  # noqa: E402

from rlinf_twoworker.api.demo import demo_config, make_inputs  # noqa: E402
from rlinf_twoworker.api.tune import trial_config, trial_resources  # noqa: E402
from rlinf_twoworker.errors import ConfigError  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
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
