"""The run directory: created once with the resolved config, never reused, safe against races."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from rlinf_twoworker.config import load_config, to_typed
from rlinf_twoworker.errors import ConfigError, RunDirError, RunDirExistsError
from rlinf_twoworker.storage.rundir import (
    RunLog,
    atomic_write_text,
    checkpoint_dir,
    complete_checkpoint_steps,
    create_run_dir,
    run_dir_of,
    staging_checkpoint_dir,
)

OVERRIDES = [
    "cluster.num_nodes=2",
    'cluster.component_placement.actor="2-3"',
    "runner.max_steps=2",
    "runner.experiment_name=my-run_01",
]


def make_cfg(root: Path, *extra: str):
    overrides = [*OVERRIDES, f"runner.output_dir={root}", *extra]
    return load_config(overrides=overrides), overrides


def snapshot(path: Path) -> dict[str, tuple[int, bytes]]:
    return {
        str(p.relative_to(path)): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else b"")
        for p in sorted(path.rglob("*"))
    }


def test_creation_writes_resolved_config_and_logs(tmp_path: Path):
    root = tmp_path / "runs" / "two-worker-grpo-pipeline"
    cfg, overrides = make_cfg(root)
    run_dir = create_run_dir(cfg, to_typed(cfg), overrides)
    assert run_dir == root.resolve() / "my-run_01"
    resolved = OmegaConf.load(run_dir / "hydra/.hydra/config.yaml")
    assert resolved.cluster.num_nodes == 2
    assert dict(resolved.cluster.component_placement) == {
        "rollout": 0,
        "inference": 1,
        "actor": "2-3",
        "reward": 0,
    }
    assert type(resolved.cluster.component_placement.rollout) is int
    assert resolved.runner.max_steps == 2
    assert Path(resolved.runner.output_dir) == root  # the parent of the run directory
    assert resolved.runner.experiment_name == "my-run_01"
    assert resolved.algorithm.sampling_params.max_new_tokens in (None, 768)
    assert yaml.safe_load((run_dir / "hydra/.hydra/overrides.yaml").read_text()) == overrides
    for name in ("log/main.log", "driver.log"):
        assert (run_dir / name).is_file()
    assert not list(run_dir.rglob(".*.tmp"))  # no half-written files left


def test_resolved_config_keeps_interpolated_values(tmp_path: Path):
    cfg, overrides = make_cfg(
        tmp_path,
        # quoted, as Hydra needs a nested interpolation with a ',' to be
        "algorithm.sampling_params.max_new_tokens="
        "'${subtract:${runner.seq_length},${data.max_prompt_length}}'",
    )
    run_dir = create_run_dir(cfg, to_typed(cfg), overrides)
    resolved = OmegaConf.load(run_dir / "hydra/.hydra/config.yaml")
    assert resolved.algorithm.sampling_params.max_new_tokens == 768


@pytest.mark.parametrize("run_id", ["0123", "2024-01-01", "1e3", "true", "null"])
def test_run_id_round_trips_as_a_string(tmp_path: Path, run_id: str):
    cfg, overrides = make_cfg(tmp_path, f"runner.experiment_name='{run_id}'")
    run_dir = create_run_dir(cfg, to_typed(cfg), overrides)
    assert run_dir.name == run_id
    assert OmegaConf.load(run_dir / "hydra/.hydra/config.yaml").runner.experiment_name == run_id


def test_existing_run_directory_is_refused_untouched(tmp_path: Path):
    cfg, overrides = make_cfg(tmp_path)
    run_dir = create_run_dir(cfg, to_typed(cfg), overrides)
    RunLog(run_dir).status("RLINF_PREFLIGHT_STATUS=passed")
    before = snapshot(run_dir)
    time.sleep(0.01)  # a rewrite would show in the mtimes
    with pytest.raises(RunDirError, match="already exists") as info:
        create_run_dir(cfg, to_typed(cfg), ["runner.max_steps=5"])
    assert str(run_dir) in str(info.value)
    assert "RUN_ID" in str(info.value)  # what to do
    assert snapshot(run_dir) == before
    # One error type wherever the check runs (CLI request check, run_grpo_two_worker, here):
    # a RunDirError and a ConfigError naming the key to change.
    assert isinstance(info.value, RunDirExistsError) and isinstance(info.value, ConfigError)
    assert info.value.key == "runner.experiment_name"


RACER = textwrap.dedent(
    """
    import json, os, sys, time
    from rlinf_twoworker.config import load_config, to_typed
    from rlinf_twoworker.errors import RunDirError
    from rlinf_twoworker.storage.rundir import create_run_dir

    root, go, ready = sys.argv[1:4]
    cfg = load_config(overrides=[f"runner.output_dir={root}", "runner.experiment_name=raced"])
    open(ready, "w").close()
    while not os.path.exists(go):
        time.sleep(0.001)
    try:
        create_run_dir(cfg, to_typed(cfg), [f"pid={os.getpid()}"])
        print(json.dumps({"won": True, "pid": os.getpid()}))
    except RunDirError as exc:
        print(json.dumps({"won": False, "error": str(exc)}))
    """
)


def test_two_concurrent_creators_exactly_one_wins(tmp_path: Path):
    root, go = tmp_path / "runs", tmp_path / "go"
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(root), str(go), str(flag)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for flag in ready
    ]
    deadline = time.monotonic() + 60
    while not all(flag.exists() for flag in ready) and time.monotonic() < deadline:
        time.sleep(0.01)
    go.touch()  # both have loaded their config and now call create_run_dir together
    results = []
    for racer in racers:
        out, err = racer.communicate(timeout=60)
        assert racer.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    winners = [r for r in results if r["won"]]
    losers = [r for r in results if not r["won"]]
    assert len(winners) == 1 and len(losers) == 1
    assert "already exists" in losers[0]["error"]
    run_dir = root / "raced"
    written = yaml.safe_load((run_dir / "hydra/.hydra/overrides.yaml").read_text())
    assert written == [f"pid={winners[0]['pid']}"]  # the winner's config, not overwritten


@pytest.mark.parametrize("run_id", ["../x", "..", ".", "/abs", "a/b", "", "x y", "-x", "~"])
def test_run_ids_that_could_escape_the_output_root_are_refused(tmp_path: Path, run_id: str):
    with pytest.raises(RunDirError, match="invalid"):
        run_dir_of(tmp_path, run_id)


def test_create_refuses_an_escaping_run_id_set_after_validation(tmp_path: Path):
    root = tmp_path / "root"
    cfg, overrides = make_cfg(root)
    typed = to_typed(cfg)
    cfg.runner.experiment_name = "../escaped"  # bypasses load-time validation
    with pytest.raises(RunDirError, match="invalid"):
        create_run_dir(cfg, typed, overrides)
    assert not (tmp_path / "escaped").exists()


def test_unwritable_output_root_is_a_run_dir_error(tmp_path: Path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg, overrides = make_cfg(blocker / "runs")
    with pytest.raises(RunDirError, match="output root"):
        create_run_dir(cfg, to_typed(cfg), overrides)


def test_run_log_appends_to_driver_and_main_log(tmp_path: Path):
    cfg, overrides = make_cfg(tmp_path)
    run_dir = create_run_dir(cfg, to_typed(cfg), overrides)
    log = RunLog(run_dir)
    log.status("RLINF_PREFLIGHT_STATUS=passed")
    log.info("step 1 done\n")
    driver = (run_dir / "driver.log").read_text().splitlines()
    main = (run_dir / "log/main.log").read_text().splitlines()
    assert driver == ["RLINF_PREFLIGHT_STATUS=passed", "step 1 done"]
    assert len(main) == 2
    assert main[0].endswith(" RLINF_PREFLIGHT_STATUS=passed") and main[1].endswith(" step 1 done")


def test_atomic_write_replaces_whole_file(tmp_path: Path):
    target = tmp_path / "verification.json"
    target.write_text("old")
    atomic_write_text(target, '{"status": "passed"}')
    assert target.read_text() == '{"status": "passed"}'
    assert os.listdir(tmp_path) == ["verification.json"]


def test_only_renamed_checkpoints_count_as_complete(tmp_path: Path):
    assert complete_checkpoint_steps(tmp_path) == []
    for step in (10, 2):
        checkpoint_dir(tmp_path, step).mkdir(parents=True)
    staging_checkpoint_dir(tmp_path, 12).mkdir()
    (tmp_path / "checkpoints" / "global_step_x").mkdir()
    (tmp_path / "checkpoints" / "global_step_4").write_text("a file, not a checkpoint")
    assert checkpoint_dir(tmp_path, 2) == tmp_path / "checkpoints" / "global_step_2"
    assert complete_checkpoint_steps(tmp_path) == [2, 10]
