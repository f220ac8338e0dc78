"""runner.logger.logger_backends: wandb (offline) and MLflow (its file store) beside TensorBoard,
on a real 2 x 2 run; no network."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
import ray
from support import ONE_RANK

from rlinf_twoworker import run_grpo_two_worker
from rlinf_twoworker.api.demo import demo_config
from rlinf_twoworker.config import load_config, to_typed
from rlinf_twoworker.errors import ConfigError
from rlinf_twoworker.run.metric_loggers import forwarded_env, missing_backends


def wandb_history(run_file: Path) -> list[dict]:
    """The history records of an offline wandb run file (LevelDB's log format: 32 KiB blocks of
    records with a 7-byte header, crc32, length, type; after the file's 7-byte W&B header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos = run_file.read_bytes(), 32768, 7
    assert data[:4] == b":W&B", run_file
    records, pending = [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a record is complete
            records.append(pending)
            pending = b""
    history = []
    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            history.append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
            )
    return history


@pytest.mark.slow
def test_wandb_offline_and_mlflow_hold_every_steps_metrics(
    cluster_2x2, finished_inputs, tmp_path, monkeypatch
):
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    monkeypatch.setenv("WANDB_MODE", "offline")  # forwarded to the controller by the run
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    overrides = [
        "runner.logger.logger_backends=[tensorboard,wandb,mlflow]",
        "runner.logger.project_name=loggers-test",
    ]
    handle = run_grpo_two_worker(
        demo_config(finished_inputs, tmp_path, "logged", [*ONE_RANK, *overrides])
    )
    steps = [ray.get(handle.step(n), timeout=300) for n in (1, 2)]
    report = handle.result(timeout=300)
    assert report.passed, report.errors
    log_dir = tmp_path / "logged"

    [run_file] = (log_dir / "wandb").glob("wandb/offline-run-*/run-*.wandb")
    history = {int(h["_step"]): h for h in wandb_history(run_file)}
    assert sorted(history) == [1, 2]
    for step in steps:
        logged = history[step.step]
        for tag, value in step.scalars().items():
            assert logged[tag] == pytest.approx(value, rel=1e-6, abs=1e-9), tag

    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient((log_dir / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("loggers-test")
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "logged" and run.info.status == "FINISHED"
    assert run.data.params["runner.logger.project_name"] == "loggers-test"
    for tag in ("rollout/reward_scores", "actor/training/actor/final_loss", "time/step"):
        points = {m.step: m.value for m in client.get_metric_history(run.info.run_id, tag)}
        assert points == {s.step: pytest.approx(s.scalars()[tag]) for s in steps}, tag
    every = set(run.data.metrics)
    assert every == set(steps[-1].scalars()), every ^ set(steps[-1].scalars())


def test_swanlab_and_unknown_backends_are_refused_by_name():
    with pytest.raises(ConfigError, match="swanlab is not a backend of the library"):
        to_typed(load_config(None, ["runner.logger.logger_backends=[tensorboard,swanlab]"]))
    with pytest.raises(ConfigError, match="the backends are tensorboard, wandb, mlflow"):
        to_typed(load_config(None, ["runner.logger.logger_backends=[neptune]"]))


def test_a_backend_whose_package_is_absent_names_its_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # Python's own way to make it unimportable
    [problem] = missing_backends(["tensorboard", "mlflow"])
    assert "pip install 'rlinf_twoworker[mlflow]'" in problem


def test_only_a_run_that_logs_to_wandb_or_mlflow_forwards_their_environment(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking:5000")
    assert forwarded_env(["tensorboard"]) == {}
    forwarded = forwarded_env(["tensorboard", "wandb"])
    assert forwarded["WANDB_MODE"] == "offline"
    assert forwarded["MLFLOW_TRACKING_URI"] == "http://tracking:5000"
