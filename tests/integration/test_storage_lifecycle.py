"""Trust on shared storage: names that cannot collide, checkpoints without half states, nothing
written outside the run directory. Cluster tests use the session's real 2-node cluster; the
pruning test kills a real process with SIGKILL."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch
from support import ONE_RANK

from rlinf_twoworker import TwoWorkerError, run_grpo_two_worker
from rlinf_twoworker.api.cli import main
from rlinf_twoworker.api.demo import demo_config, make_inputs
from rlinf_twoworker.cluster.connect import ray_name
from rlinf_twoworker.config import load_config, to_typed
from rlinf_twoworker.errors import ConfigError
from rlinf_twoworker.storage import checkpoints as ckpt
from rlinf_twoworker.storage.rundir import (
    checkpoint_dir,
    escaping_paths,
    staging_checkpoint_dir,
    stale_checkpoint_dirs,
)
from rlinf_twoworker.workers.actor import ActorWorker

# Classes injected into a run travel by value: the workers cannot import this test module.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

TIMEOUT = 300


@pytest.fixture(scope="module")
def inputs(demo_inputs):
    return demo_inputs


# ---- 4. names that cannot collide ------------------------------------------------------------
# Two runs with one RUN_ID under two roots at once: test_reliability's side-by-side test.


def test_ray_names_lead_with_the_run_id_and_differ_by_run_directory(tmp_path):
    a, b = tmp_path / "a" / "rid-01", tmp_path / "b" / "rid-01"
    assert ray_name(a, "pg").startswith("rid-01-") and ray_name(a, "pg").endswith(":pg")
    assert ray_name(a, "pg") != ray_name(b, "pg")
    assert ray_name(a, "actor", 1) == ray_name(tmp_path / "a" / "." / "rid-01", "actor", 1)


def test_a_failure_after_the_run_directory_exists_leaves_failure_json_and_reclaims_staging(
    cluster_2x2, inputs, tmp_path
):
    """The controller does not start in time: the run directory says why (failure.json,
    RUN_FAILED), and nothing of the run is left in Ray. The start first reclaimed the staging
    directory an ended run left under the same output root, and kept a live run's."""
    ended, live = tmp_path / "ended", tmp_path / "live"
    for run in (ended, live):
        staging_checkpoint_dir(run, 3).mkdir(parents=True)
    (ended / "failure.json").write_text('{"state": "failed"}')
    cfg = demo_config(
        inputs, tmp_path, "no-start", [*ONE_RANK, "runner.timeouts.actor_start_s=0.001"]
    )
    with pytest.raises(TwoWorkerError, match="run controller did not start"):
        run_grpo_two_worker(cfg)
    run_dir = tmp_path / "no-start"
    failure = json.loads((run_dir / "failure.json").read_text())
    assert failure["state"] == "failed" and "did not start" in failure["error"], failure
    assert "RUN_FAILED error=TwoWorkerError" in (run_dir / "driver.log").read_text()
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert ray_name(run_dir, "controller", 0) not in names
    assert stale_checkpoint_dirs(ended) == [] and stale_checkpoint_dirs(live) != []
    assert "RECLAIMED" in (run_dir / "log" / "main.log").read_text()


# ---- 5. checkpoint life-cycle ----------------------------------------------------------------

PRUNE_SCRIPT = """
import sys, time
from pathlib import Path
from rlinf_twoworker.storage.checkpoints import complete_steps, prune
complete_steps(Path(sys.argv[1]))  # every import done: the kill lands in the prune itself
print("ready", flush=True)
sys.stdin.readline()
began = time.monotonic()
prune(Path(sys.argv[1]), 1)
print(time.monotonic() - began, flush=True)
"""


def _tree(template: Path, run_dir: Path, steps: tuple[int, ...]) -> None:
    for step in steps:  # hard links: a copy in a fraction of the time
        shutil.copytree(template, checkpoint_dir(run_dir, step), copy_function=os.link)


def _template(where: Path, padding: int) -> Path:
    """A complete checkpoint (a real DCP save and data.pt) with `padding` more files beside
    its shard, so that deleting it takes a while and its .metadata goes somewhere midway."""
    import torch.distributed.checkpoint as dcp

    state = {"fsdp_checkpoint": {"model": {"w": torch.arange(64.0)}}}
    dcp.save(state, checkpoint_id=str(where / ckpt.DCP_SUBDIR))
    (where / ckpt.DATA_FILE).parent.mkdir(parents=True)
    torch.save({"epoch": 0}, where / ckpt.DATA_FILE)
    for i in range(padding):
        (where / ckpt.DCP_SUBDIR / f"pad-{i:05d}").write_bytes(b"x")
    assert ckpt.checkpoint_problems(where) == []
    return where


def _prune_in_child(run_dir: Path, kill_after: float | None) -> float | None:
    """Prune in a process of its own; SIGKILL it `kill_after` seconds after it began."""
    child = subprocess.Popen(
        [sys.executable, "-c", PRUNE_SCRIPT, str(run_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdin is not None
    assert child.stdout.readline().strip() == "ready"
    child.stdin.write("go\n")
    child.stdin.flush()
    if kill_after is None:
        elapsed = float(child.stdout.readline())
        assert child.wait(timeout=60) == 0
        return elapsed
    time.sleep(kill_after)
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=60)
    return None


def test_sigkill_during_pruning_leaves_only_complete_checkpoints(tmp_path):
    """Pruning renames a checkpoint away before deleting it: however often it is killed, and
    wherever, every global_step_<N> left is complete; the leftovers are never complete."""
    template = _template(tmp_path / "template", padding=1500)
    calibrate = tmp_path / "calibrate"
    _tree(template, calibrate, (1, 2, 3))
    took = _prune_in_child(calibrate, None)
    assert took is not None and ckpt.complete_steps(calibrate) == [3]
    rng = random.Random(34)
    killed_midway = 0
    for attempt in range(6):
        run_dir = tmp_path / f"run-{attempt}"
        _tree(template, run_dir, (1, 2, 3))
        _prune_in_child(run_dir, rng.uniform(0, took))
        left = sorted(p for p in (run_dir / "checkpoints").iterdir() if p.name[0] != ".")
        assert left and left[-1].name == "global_step_3"
        for checkpoint in left:
            assert ckpt.checkpoint_problems(checkpoint) == [], (attempt, checkpoint)
        killed_midway += any(p.name.endswith(".pruning") for p in stale_checkpoint_dirs(run_dir))
        ckpt.prune(run_dir, 1)  # a later prune still works, whatever the kill left
        assert ckpt.complete_steps(run_dir) == [3]
    assert killed_midway, "no kill landed between the rename and the end of the delete"


class ExportBreakingActor(ActorWorker):
    """Rank 0 hides the model's config.json while the first checkpoint is written, so the
    optional Hugging Face export after the rename fails (the test puts it back)."""

    def save_checkpoint(self, path: str):  # type: ignore[no-untyped-def]
        answer = super().save_checkpoint(path)
        config = Path(self.settings.model.model_path) / "config.json"
        if self.rank == 0 and "global_step_1" in path:
            config.rename(config.with_name("config.json.hidden"))
        return answer


def test_a_failed_full_weights_export_does_not_fail_a_complete_step(cluster_2x2, tmp_path):
    inputs = make_inputs(tmp_path / "inputs")  # its own: the test hides a file of its model
    hidden = Path(inputs.model_path) / "config.json.hidden"
    overrides = [*ONE_RANK, "runner.save_interval=1", "runner.save_full_weights=true"]
    cfg = demo_config(inputs, tmp_path, "export-fails", overrides)
    handle = run_grpo_two_worker(cfg, component_classes={"actor": ExportBreakingActor})
    try:
        first = ray.get(handle.checkpoint(1), timeout=TIMEOUT)
    finally:
        if hidden.exists():
            hidden.rename(hidden.with_name("config.json"))
    assert first.step == 1
    report = handle.result(timeout=TIMEOUT)
    run_dir = tmp_path / "export-fails"
    assert ckpt.complete_steps(run_dir) == [1, 2]
    assert not (checkpoint_dir(run_dir, 1) / ckpt.HF_SUBDIR).exists()
    assert (checkpoint_dir(run_dir, 2) / ckpt.HF_SUBDIR / "model.safetensors").is_file()
    assert "EXPORT_FAILED step=1" in (run_dir / "driver.log").read_text()
    assert report.passed, report.errors


def test_reclaim_removes_only_what_ended_runs_left_half_written(tmp_path):
    """An ended run's staging and pruning directories go; a live run's (no failure.json, no
    verification.json) stay; complete checkpoints are never touched."""
    root = tmp_path / "runs"
    failed, verified, live = root / "failed", root / "verified", root / "live"
    for run in (failed, verified, live):
        staging_checkpoint_dir(run, 4).mkdir(parents=True)
        checkpoint_dir(run, 2).mkdir()
    (checkpoint_dir(failed, 1).with_name(".global_step_1.pruning")).mkdir()
    (failed / "failure.json").write_text("{}")
    (verified / "verification.json").write_text("{}")
    new_run = root / "new"
    new_run.mkdir()
    typed = to_typed(
        load_config(overrides=[f"runner.output_dir={root}", "runner.experiment_name=new"])
    )
    lines: list[str] = []
    removed = ckpt.reclaim_staging(typed, new_run, lines.append)
    assert len(removed) == 3 and len(lines) == 3
    assert stale_checkpoint_dirs(failed) == stale_checkpoint_dirs(verified) == []
    assert stale_checkpoint_dirs(live) == [staging_checkpoint_dir(live, 4)]
    assert all(checkpoint_dir(run, 2).is_dir() for run in (failed, verified, live))


# ---- 6. nothing escapes the run directory ----------------------------------------------------

ESCAPING = [
    ("hydra.run.dir", "../x"),
    ("hydra.run.dir", "/tmp/rlinf-elsewhere/hydra"),
    ("hydra.output_subdir", "../../.hydra"),
    ("runner.logger.log_path", "logs/../../.."),
    ("runner.logger.log_path", "checkpoints"),
]


@pytest.mark.parametrize(("key", "value"), ESCAPING)
def test_a_path_outside_the_run_directory_is_refused_by_name_with_nothing_written(
    inputs, tmp_path, key, value
):
    root = tmp_path / "out"
    cfg = demo_config(inputs, root, "escape", [f"{key}={value}"])
    with pytest.raises(ConfigError) as raised:
        run_grpo_two_worker(cfg)
    assert (raised.value.key, raised.value.value) == (key, value)
    assert "run directory" in raised.value.rule
    assert not root.exists()


def test_the_cli_refuses_hydra_run_dir_dotdot_before_writing_anything(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("RUN_ID", "escape")
    monkeypatch.setenv("WORK_ROOT", str(tmp_path))
    code = main(["run", "hydra.run.dir=../x"])
    assert code != 0
    said = capsys.readouterr()
    assert "config key 'hydra.run.dir' = '../x'" in said.out + said.err
    assert list(tmp_path.iterdir()) == []


def test_the_tutorials_own_paths_resolve_inside_the_run_directory(tmp_path):
    output_dir = tmp_path / "runs" / "rid-01"
    typed = to_typed(
        load_config(
            overrides=[
                f"runner.output_dir={tmp_path / 'runs'}",
                "runner.experiment_name=rid-01",
                f"hydra.run.dir={output_dir}/hydra",
                "hydra.output_subdir=.hydra",
                f"runner.logger.log_path={output_dir}",
            ]
        )
    )
    assert escaping_paths(typed) == []
    assert typed.hydra_record_dir == output_dir / "hydra" / ".hydra"
    assert typed.log_dir == output_dir
    relative = to_typed(load_config(overrides=["runner.logger.log_path=logs", "hydra.run.dir=."]))
    assert escaping_paths(relative) == []
    assert relative.log_dir == relative.run_dir / "logs"
    assert relative.hydra_record_dir == relative.run_dir / ".hydra"
